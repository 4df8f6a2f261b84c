"""A bounded load test: 32 synthetic sessions at once through one session service and one
worker (both in this process), for a few seconds.

The synthetic model is deterministic per request: its per-session RNN state starts at zero and
advances one step per consumed input frame, and (when no input arrives during a reply) one step
per reply step. So each session's replies can be recomputed exactly from what it sent, with the
model class itself in this process, and every session's audio is checked BY CONTENT against its
own expected replies -- plus ids, fences, frame counts, no error events, and batches > 1 in the
worker's ``duplex_worker_batch_size`` histogram (batching across sessions happened).

Metrics are read from the process-wide registry as differences over the test: the batch-size
histogram is the worker tier's alone; the "nothing went wrong" counters are compared as totals
over every tier (a counter only grows, so no change in the total means no change anywhere).

The synthetic plugin is not lockstep, so the session service feeds no silence during its replies
(fed silence would make the step sequence -- and so the expected audio -- depend on timing);
this test also checks that default.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from duplex.audio import PCM16K_MONO
from duplex.client import DuplexClient, Session, event_kind, turn_detection
from duplex.v1 import session_pb2
from tests.session_helpers import SYNTHETIC, InProcessStack, sample, sample_sum
from worker_service.model import StepBatch
from worker_service.models.synthetic import SyntheticModel, SyntheticOptions

SESSIONS = 32
RUN_S = 4.0
HIDDEN, LAYERS, SEED = 128, 2, 0
FRAME = 512
FRAME_BYTES = FRAME * 2
LSB_TOLERANCE = 4  # s16 steps: batched vs single-row float32 matmuls may round differently


pytestmark = pytest.mark.stack(
    model="synthetic", plugin=SYNTHETIC, model_options={"hidden_size": HIDDEN, "layers": LAYERS}
)

#: Counters that must not move during the test (on any tier).
UNTOUCHED = (
    "duplex_sparse_fail_closed_total",
    "duplex_sparse_unknown_request_total",
    "duplex_session_dropped_outputs_total",
    "duplex_session_errors_total",
    "duplex_worker_fenced_total",
)


@dataclass
class Caller:
    """One session's plan and record."""

    index: int
    options: SyntheticOptions
    turns: list[np.ndarray] = field(default_factory=list)
    """The s16 input frames of each turn, ``(n, 512)``."""
    events: list[session_pb2.ServerEvent] = field(default_factory=list)
    appends: int = 0

    def turn_input(self, t: int) -> np.ndarray:
        rng = np.random.default_rng(1000 * self.index + t)
        n = 2 + (self.index + t) % 5
        return rng.integers(-12000, 12000, size=(n, FRAME), dtype=np.int16)


async def _converse(client: DuplexClient, caller: Caller, deadline: float) -> None:
    opts = caller.options
    session: Session = await client.open_session(
        model="synthetic",
        turn_detection=turn_detection(auto_respond=False, barge_in=False),
        extra_body={"reply_frames": opts.reply_frames, "emit_every": opts.emit_every},
    )
    record = caller.events.append
    try:
        t = 0
        while t < 2 or time.monotonic() < deadline:
            frames = caller.turn_input(t)
            for frame in frames:
                await session.send_audio(frame.astype("<i2").tobytes())
                caller.appends += 1
            await session.commit()
            await session.create_response()
            # Nothing is sent during the reply: the worker steps it without input.
            await session.wait_for("response_done", "error", timeout_s=30, on_event=record)
            caller.turns.append(frames)
            t += 1
        await session.close()
    finally:
        async for ev in session.events():
            record(ev)


def _expected_replies(caller: Caller) -> list[bytes]:
    """The caller's replies, recomputed by stepping the model class alone (batch of one)."""
    with torch.inference_mode():
        model = SyntheticModel(torch.device("cpu"), hidden_size=HIDDEN, layers=LAYERS, seed=SEED)
        state = model.create_state("s")
        model.set_options(state, caller.options)
        replies = []
        for frames in caller.turns:
            for frame in frames:
                x = (frame.astype(np.float32) / np.float32(32768.0))[None, :]
                model.step(StepBatch(["s"], [state], x, np.ones(1, np.bool_)))
            model.commit(state)
            model.respond(state)
            pcm = b""
            while model.is_responding(state):
                result = model.step(
                    StepBatch(["s"], [state], np.zeros((1, FRAME), np.float32), np.zeros(1, np.bool_))
                )
                assert isinstance(result.outputs, dict)
                for wave in result.outputs["audio"]:
                    pcm += np.rint(np.clip(wave, -1, 1) * 32767.0).astype("<i2").tobytes()
            replies.append(pcm)
    return replies


def _check(caller: Caller) -> None:
    """Ids, fences, counts and content of one session's event stream."""
    i = caller.index
    kinds = [event_kind(e) for e in caller.events]
    assert "error" not in kinds, (i, [e.error for e in caller.events if event_kind(e) == "error"])
    assert kinds[0] == "opened" and kinds[-1] == "closed", (i, kinds[:3], kinds[-3:])
    epoch = caller.events[0].opened.epoch
    active: session_pb2.ResponseStarted | None = None
    replies: list[bytes] = []
    pcm = bytearray()
    done_ids: set[str] = set()
    committed: list[int] = []
    for ev in caller.events:
        kind = event_kind(ev)
        if kind == "response_started":
            assert active is None, (i, "a response started inside another")
            active = ev.response_started
            assert active.epoch == epoch and active.turn_id == len(replies) + 1, (i, active)
            pcm = bytearray()
        elif kind == "audio_delta":
            d = ev.audio_delta
            assert active is not None, (i, "audio outside a response")
            assert (d.response_id, d.turn_id, d.epoch) == (active.response_id, active.turn_id, epoch), (i, d)
            assert d.offset_ms == len(pcm) // 32, (i, d.offset_ms, len(pcm))  # 16 kHz s16: 32 B/ms
            pcm += d.pcm
        elif kind == "response_done":
            done = ev.response_done
            assert active is not None and done.response_id == active.response_id, (i, done)
            assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, (i, done)
            assert done.response_id not in done_ids
            done_ids.add(done.response_id)
            replies.append(bytes(pcm))
            active = None
        elif kind == "committed":
            committed.append(ev.committed.audio_ms)
    assert active is None
    assert len(replies) == len(caller.turns) >= 2, (i, len(replies), len(caller.turns))
    # Each commit covers exactly that turn's input (32 ms frames).
    assert committed == [len(f) * 32 for f in caller.turns], (i, committed)
    acks = [e.input_ack.seq for e in caller.events if event_kind(e) == "input_ack"]
    assert acks == sorted(acks) and acks[-1] == caller.appends, (i, acks[-3:], caller.appends)
    expected = _expected_replies(caller)
    for t, (got, want) in enumerate(zip(replies, expected, strict=True)):
        # Exactly the frames asked for, and this session's own audio.
        assert len(got) == caller.options.reply_frames * FRAME_BYTES == len(want), (i, t, len(got))
        diff = np.abs(np.frombuffer(got, "<i2").astype(np.int32) - np.frombuffer(want, "<i2"))
        assert diff.max() <= LSB_TOLERANCE, (i, t, int(diff.max()))


def _batched_steps() -> float:
    """Worker engine steps so far that batched more than one request."""
    return sample("duplex_worker_batch_size_count") - sample("duplex_worker_batch_size_bucket", {"le": "1.0"})


async def test_32_sessions_each_get_exactly_their_own_replies(stack: InProcessStack) -> None:
    before = _batched_steps()
    untouched = {name: sample_sum(name) for name in UNTOUCHED}
    callers = [
        Caller(i, SyntheticOptions(emit_every=1 + i % 3, reply_frames=6 + (7 * i) % 20))
        for i in range(SESSIONS)
    ]
    deadline = time.monotonic() + RUN_S
    async with DuplexClient(stack.target) as client:
        await asyncio.gather(*(_converse(client, c, deadline) for c in callers))

    for caller in callers:
        _check(caller)
    # The content check tells sessions apart: the same turn of two sessions sounds different.
    firsts = {_expected_replies(Caller(c.index, c.options, c.turns[:1]))[0][:FRAME_BYTES] for c in callers}
    assert len(firsts) == SESSIONS

    assert _batched_steps() > before, "no engine step batched more than one session"
    for name, value in untouched.items():
        assert sample_sum(name) == value, name
    assert PCM16K_MONO.frame_bytes == 2  # the byte arithmetic above
