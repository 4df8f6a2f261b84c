"""Backpressure through input acks: a session service and a worker in this process.

A client that streams a long input as fast as ``input_ack`` allows (``stream_audio`` without
``realtime``, its default 2 s unacked window) against a worker that consumes more slowly than
the session service hands input on: the session service holds acks while more than
``--max-unconsumed-input-ms`` of audio waits unconsumed at the worker, so the worker's
per-request input queue (``--max-queued-frames``, deliberately small here) never overflows and
the client never sees ``capacity_exhausted``.
"""

from __future__ import annotations

import asyncio

import pytest

from duplex.client import DuplexClient, event_kind, turn_detection
from tests.session_helpers import SYNTHETIC, InProcessStack, sample

INPUT_S = 16  # 500 frames of 32 ms: far more than the worker's queue holds
QUEUE_FRAMES = 160  # the worker's per-request input queue
HOLD_MS = 1000  # ~32 frames unconsumed before acks are held; + the client's 2 s window < 160


# A synthetic model heavy enough that one worker steps more slowly than one client sends.
pytestmark = pytest.mark.stack(
    model="synthetic",
    plugin=SYNTHETIC,
    model_options={"hidden_size": 1536, "layers": 6},
    worker={"max_queued_frames": QUEUE_FRAMES},
    runner={"max_unconsumed_input_ms": HOLD_MS},
)
CAPACITY = {"reason": "capacity"}


async def test_a_client_streaming_as_fast_as_acks_allow_is_never_refused(stack: InProcessStack) -> None:
    refused_before = sample("duplex_worker_fenced_total", CAPACITY)
    pcm = bytes(16000 * 2 * INPUT_S)
    async with DuplexClient(stack.target) as client:
        session = await client.open_session(
            model="synthetic", turn_detection=turn_detection(auto_respond=False, barge_in=False)
        )
        errors: list[str] = []
        last_ack = 0
        max_jump = 0

        async def read() -> None:
            nonlocal last_ack, max_jump
            async for ev in session.events():
                kind = event_kind(ev)
                if kind == "error":
                    errors.append(ev.error.code)
                elif kind == "input_ack":
                    max_jump = max(max_jump, ev.input_ack.seq - last_ack)
                    last_ack = ev.input_ack.seq

        reader = asyncio.create_task(read())
        sent_ms = await asyncio.wait_for(session.stream_audio([pcm], realtime=False), timeout=120)
        assert sent_ms == INPUT_S * 1000
        # Every append is acknowledged in the end, and none was refused on the way.
        assert await session.wait_acked(0, timeout_s=30)
        await session.close(timeout_s=5.0)
        await asyncio.wait_for(reader, 10)
    assert errors == []
    assert sample("duplex_worker_fenced_total", CAPACITY) == refused_before  # the worker's alone
    # The worker really was the slower side: acks were held and went out collapsed (one ack for
    # several appends; unheld, every append gets its own). With the bound off (0) this same setup
    # overflows the worker's queue: capacity_exhausted errors.
    assert max_jump > 1
