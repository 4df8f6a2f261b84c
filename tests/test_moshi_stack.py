"""``duplex up --model moshi --checkpoint DIR --temperature 0`` as real processes, with a small
random-weight checkpoint of the real layout (issue 37's done-when, in CI):

- eight sessions at once in real time, each hearing the model's audio and text continuously,
  ``opened`` saying the model takes turns itself, a commit refused ``unsupported_by_model``, and
  the worker's ticks on time (under 1 % late);
- a session's audio and text are the same whether it runs alone or while others join, talk and
  leave around it (greedy, fixed batch slots);
- the official ``openai`` SDK through the Realtime edge hears the model's speech spans as
  Realtime responses, with audio and transcript deltas;
- a worker killed mid-conversation: the session goes on on the other worker, and the client was
  told the model's context started over (``context_reset``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from duplex.stack import LocalStack
from duplex.v1 import session_pb2
from tests.moshi_helpers import FRAME, PCM24K, pcm24k, small_checkpoint, voice_24k
from tests.realtime_helpers import read_until, sdk
from tests.session_helpers import Conversation, metric_sum, metric_value, open_event

pytestmark = pytest.mark.process

FRAME_S = 0.08
FRAME_BYTES = 2 * FRAME


def moshi_stack(checkpoint: Path, *, workers: int = 1, realtime: bool = False) -> LocalStack:
    return LocalStack(
        workers=workers,
        model="moshi",
        plugin="session_service.plugins.moshi:MoshiPlugin",
        # No real-time admission bound: a loaded test machine's slow ticks must not refuse the
        # sessions these tests need (admission has tests of its own).
        worker_args=[
            "--checkpoint",
            str(checkpoint),
            "--temperature",
            "0",
            "--torch-threads",
            "1",
            "--max-tick-load",
            "0",
        ],
        realtime_port=0 if realtime else None,
        startup_timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by the stack's processes: nothing is fetched
    return small_checkpoint(tmp_path_factory.mktemp("moshi"))


@pytest.fixture(scope="module")
def stack(checkpoint: Path) -> Iterator[LocalStack]:
    with moshi_stack(checkpoint, realtime=True) as s:
        yield s


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


async def released(stack: LocalStack, within_s: float = 15.0) -> None:
    """Until the workers hold no session: the sessions an earlier test closed are released at the
    worker a moment after their calls end, and a test that needs the worker's 8 slots waits."""
    deadline = time.monotonic() + within_s
    while True:
        held = sum(
            metric_value(scrape(w.metrics_url), "duplex_worker_active_requests") or 0.0
            for w in stack.worker_children
        )
        if held == 0:
            return
        assert time.monotonic() < deadline, f"the workers still hold {held:g} sessions"
        await asyncio.sleep(0.1)


async def stream(conv: Conversation, x: np.ndarray, *, speed: float = 1.0) -> None:
    """Append ``x`` in 80 ms frames, ``speed`` times real time."""
    t0 = time.monotonic()
    pcm = pcm24k(x)
    for k, i in enumerate(range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)):
        conv.append(pcm[i : i + FRAME_BYTES])
        delay = t0 + (k + 1) * FRAME_S / speed - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


def frames_heard(conv: Conversation) -> list[tuple[bytes, str]]:
    """The model's frames as the client heard them, in order: each audio delta with the text of
    its step (a transcript delta comes just before the audio of its frame)."""
    out: list[tuple[bytes, str]] = []
    text = ""
    for e in conv.events:
        if e.HasField("transcript_delta"):
            text += e.transcript_delta.text
        elif e.HasField("audio_delta"):
            out.append((e.audio_delta.pcm, text))
            text = ""
    return out


async def test_eight_sessions_in_real_time_each_hear_the_model_continuously(stack: LocalStack) -> None:
    await released(stack)
    worker = stack.worker_children[0]
    before = scrape(worker.metrics_url)
    seconds = 8.0  # 100 ticks: a tick late is 1 %
    async with grpc.aio.insecure_channel(stack.target) as ch:
        convs = [Conversation(ch).start(open_event(PCM24K, model="moshi")) for _ in range(8)]
        opened = [(await c.wait_kind("opened", within=20)).opened for c in convs]
        await asyncio.gather(*(stream(c, voice_24k(seconds, seed=i)) for i, c in enumerate(convs)))
        convs[0].send(session_pb2.ClientEvent(event_id="c1", commit=session_pb2.InputAudioCommit()))
        await convs[0].wait_kind("error", within=10)
        for c in convs:
            c.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await asyncio.gather(*(c.wait_done(within=15) for c in convs))
    after = scrape(worker.metrics_url)

    for op in opened:
        caps = op.capabilities
        assert caps.turn_policy == session_pb2.TURN_POLICY_MODEL_NATIVE and caps.model_barge_in
        assert caps.frame_period_ms == 80 and "text" in caps.modalities
    err = convs[0].of("error")[0].error
    assert (err.code, err.event_id, err.retryable) == ("unsupported_by_model", "c1", False)
    for c in convs:
        assert [e.error.code for e in c.of("error")] in ([], ["unsupported_by_model"])
        heard = frames_heard(c)
        # Audio for nearly every frame it heard (a random model speaks all along), and text.
        assert len(heard) >= 0.8 * seconds / FRAME_S, len(heard)
        assert all(len(pcm) == FRAME_BYTES for pcm, _ in heard)
        assert "".join(t for _, t in heard).strip()
        assert c.of("response_started") and c.of("context_reset") == []
    ticks = metric_value(after, "duplex_worker_tick_duration_seconds_count") or 0.0
    ticks -= metric_value(before, "duplex_worker_tick_duration_seconds_count") or 0.0
    late = metric_sum(after, "duplex_worker_ticks_late_total") - metric_sum(
        before, "duplex_worker_ticks_late_total"
    )
    assert ticks >= 0.8 * seconds / FRAME_S
    assert late <= 0.01 * ticks, (late, ticks)  # the model keeps real time for all eight


async def test_a_sessions_speech_does_not_depend_on_who_else_is_there(stack: LocalStack) -> None:
    await released(stack)
    x = voice_24k(3.0, seed=3)
    frames = len(x) // FRAME

    async def session(ch: grpc.aio.Channel, audio: np.ndarray, delay: float = 0.0) -> Conversation:
        await asyncio.sleep(delay)
        conv = Conversation(ch).start(open_event(PCM24K, model="moshi"))
        await conv.wait_kind("opened", within=20)
        # Ahead of real time: the model hears exactly these frames (no silence fed in between).
        await stream(conv, audio, speed=2.0)
        await conv.wait_until(lambda: len(frames_heard(conv)) >= frames - 3, within=20)
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done(within=15)
        return conv

    async with grpc.aio.insecure_channel(stack.target) as ch:
        alone = await session(ch, x)
        others = [voice_24k(1.5, seed=7), voice_24k(2.0, seed=8), voice_24k(1.0, seed=9)]
        crowd, *_ = await asyncio.gather(
            session(ch, x),
            session(ch, others[0], delay=0.2),  # joins after it, leaves before it
            session(ch, others[1]),  # there as it starts
            session(ch, others[2], delay=0.8),  # joins mid-way
        )
    n = frames - 3
    assert frames_heard(crowd)[:n] == frames_heard(alone)[:n]


async def test_the_openai_sdk_hears_moshi_speak_as_realtime_responses(stack: LocalStack) -> None:
    await released(stack)
    pcm = pcm24k(voice_24k(2.0, seed=4))
    async with sdk(stack.realtime_url).realtime.connect(model="moshi") as conn:
        created = await conn.recv()
        assert created.type == "session.created", created
        assert created.session.audio.input.turn_detection.type == "semantic_vad"  # the model's own
        for i in range(0, len(pcm), FRAME_BYTES):
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + FRAME_BYTES]).decode())
        events: list[Any] = []
        await read_until(
            conn,
            lambda e: (
                e.type == "response.output_audio_transcript.delta"
                and sum(x.type == "response.output_audio.delta" for x in events) >= 10
            ),
            seen=events,
        )
        await conn.input_audio_buffer.commit()
        await read_until(conn, lambda e: e.type == "error", seen=events)
    kinds = [e.type for e in events]
    assert kinds.index("response.created") < kinds.index("response.output_audio.delta")
    created_id = next(e.response.id for e in events if e.type == "response.created")
    deltas = [e for e in events if e.type == "response.output_audio.delta"]
    assert deltas and all(e.response_id == created_id for e in deltas[:5])
    assert len(base64.b64decode(deltas[0].delta)) == FRAME_BYTES
    assert any(e.type == "response.output_audio_transcript.delta" and e.delta for e in events)
    assert events[-1].error.code == "unsupported_by_model"


async def test_a_worker_killed_mid_conversation_resets_the_models_context(checkpoint: Path) -> None:
    with moshi_stack(checkpoint, workers=2) as two:
        async with grpc.aio.insecure_channel(two.target) as ch:
            conv = Conversation(ch).start(open_event(PCM24K, model="moshi"))
            await conv.wait_kind("opened", within=20)
            talking = asyncio.create_task(stream(conv, voice_24k(8.0, seed=6)))
            await conv.wait_until(lambda: len(frames_heard(conv)) >= 10, within=20)
            # The worker holding it is the one with an active request.
            busy = [
                w
                for w in two.worker_children
                if (metric_value(scrape(w.metrics_url), "duplex_worker_active_requests") or 0) > 0
            ]
            assert len(busy) == 1
            os.kill(busy[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            reset = await conv.wait_kind("context_reset", within=15)
            heard_at_reset = len(frames_heard(conv))
            await conv.wait_until(lambda: len(frames_heard(conv)) >= heard_at_reset + 10, within=20)
            talking.cancel()
            conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await conv.wait_done(within=15)
    assert reset.context_reset.reason == "worker_lost"
    assert time.monotonic() - killed < 60
    kinds = conv.kinds()
    at = kinds.index("context_reset")
    # What it was saying ended failed, for good; then it speaks on, from the other worker.
    failed = [
        e.response_done
        for e in conv.of("response_done")
        if e.response_done.status == session_pb2.RESPONSE_STATUS_FAILED
    ]
    assert failed and failed[0].reason == "worker_unavailable" and not failed[0].restarting
    assert "response_started" in kinds[at:] and "audio_delta" in kinds[at:]
    assert [e.error.code for e in conv.of("error")] == []
