"""The Python client against a local stack (one session service, one parrot worker), in process:
the ``stack`` fixture of tests/conftest.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplex import errors
from duplex.audio import PCM16K_MONO, S16LE, PcmFormat, decode
from duplex.client import DuplexClient, Session, SessionClosedError, event_kind, load_wav_as, turn_detection
from duplex.stack import example_path
from duplex.v1 import session_pb2
from tests.session_helpers import InProcessStack

# The session tier's clock at 4x real time: the parrot is lockstep, so each reply plays out at
# the pace of the silence the session feeds it (tests.session_helpers.FastClock). These tests
# check events, order and content; test_session_stack runs the same paths in real time.
pytestmark = pytest.mark.stack(clock_speed=4.0)

HELLO = example_path("hello.wav")
SILENCE_1S = b"\0\0" * 16000


async def collect_until(
    session: Session, *kinds: str, timeout_s: float = 30.0
) -> list[session_pb2.ServerEvent]:
    """Every event up to and including the first of ``kinds``."""
    seen: list[session_pb2.ServerEvent] = []
    await session.wait_for(*kinds, timeout_s=timeout_s, on_event=seen.append)
    return seen


async def one_turn(session: Session, pcm: bytes) -> list[session_pb2.ServerEvent]:
    sender = asyncio.create_task(session.stream_audio([pcm + SILENCE_1S], fmt=PCM16K_MONO))
    seen = await collect_until(session, "response_done")
    await asyncio.wait_for(sender, 10)
    return seen


def kinds_of(events: list[session_pb2.ServerEvent]) -> list[str]:
    return [event_kind(e) for e in events]


async def test_open_talk_and_reply(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        session = await client.open_session(model="parrot")
        assert session.session_id and session.resume_token
        assert session.capabilities.model == "parrot"
        assert session.output_format == PCM16K_MONO
        seen = await one_turn(session, load_wav_as(HELLO, PCM16K_MONO))
        kinds = kinds_of(seen)
        for k in ("opened", "input_ack", "speech_started", "speech_stopped", "committed", "response_started"):
            assert k in kinds, (k, kinds)
        order = [kinds.index(k) for k in ("speech_started", "committed", "response_started", "audio_delta")]
        assert order == sorted(order), kinds
        done = seen[-1].response_done
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
        reply = b"".join(e.audio_delta.pcm for e in seen if event_kind(e) == "audio_delta")
        committed = next(e.committed for e in seen if event_kind(e) == "committed")
        reply_ms = PCM16K_MONO.duration_ms(len(reply))
        # The parrot reply is the committed utterance, duration kept.
        assert abs(reply_ms - committed.audio_ms) < 100, (reply_ms, committed.audio_ms)
        assert np.abs(decode(reply, PCM16K_MONO)).max() > 0.05  # not silence
        await session.close()
        assert session.closed


async def test_manual_commit_and_response(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        # barge_in off: with fast streaming the VAD reports speech from before the commit while
        # the response runs, which the server would take as the user interrupting.
        td = turn_detection(auto_respond=False, barge_in=False)
        session = await client.open_session(turn_detection=td)
        await session.stream_audio([load_wav_as(HELLO, PCM16K_MONO)], fmt=PCM16K_MONO)
        await session.commit()
        committed = await session.wait_for("committed", timeout_s=20)
        assert committed.committed.audio_ms > 1000
        await session.create_response()
        seen = await collect_until(session, "response_done")
        assert "audio_delta" in kinds_of(seen)
        assert seen[-1].response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        await session.close()


async def test_barge_in_cancels_and_seq_restarts(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        session = await client.open_session()
        # A long utterance gives a long reply, so the barge-in surely lands while it streams.
        pcm = load_wav_as(HELLO, PCM16K_MONO) * 3 + SILENCE_1S
        sender = asyncio.create_task(session.stream_audio([pcm], fmt=PCM16K_MONO))
        first = await session.wait_for("audio_delta", timeout_s=30)
        old_epoch = first.audio_delta.epoch
        await session.barge_in()
        await sender
        after: list[session_pb2.ServerEvent] = await collect_until(session, "response_done")
        kinds = kinds_of(after)
        assert "audio_cancelled" in kinds, kinds
        cancel = after[kinds.index("audio_cancelled")].audio_cancelled
        assert (
            cancel.reason == "barge_in" and cancel.cancelled_epoch == old_epoch and cancel.epoch > old_epoch
        )
        # no audio of the cancelled epoch after audio_cancelled
        assert not [e for e in after[kinds.index("audio_cancelled") :] if event_kind(e) == "audio_delta"]
        done = after[-1].response_done
        assert done.status == session_pb2.RESPONSE_STATUS_CANCELLED
        assert session.epoch == cancel.epoch and session.seq.last == 0
        # The session goes on in the new epoch: appends numbered from 1 are accepted.
        for _ in range(5):
            await session.send_audio(b"\0\0" * 320)
        ack = await session.wait_for("input_ack", "error", timeout_s=10)
        assert event_kind(ack) == "input_ack", ack
        assert ack.input_ack.epoch == cancel.epoch and ack.input_ack.seq <= 5
        await session.close()


async def test_two_sessions_at_once(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        a, b = await asyncio.gather(client.open_session(), client.open_session())
        assert a.session_id != b.session_id
        pcm = load_wav_as(HELLO, PCM16K_MONO)
        short = pcm[: len(pcm) // 2]  # a different utterance: replies must not mix
        seen_a, seen_b = await asyncio.gather(one_turn(a, pcm), one_turn(b, short))
        for seen in (seen_a, seen_b):
            assert seen[-1].response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        ms = [
            PCM16K_MONO.duration_ms(
                len(b"".join(e.audio_delta.pcm for e in s if event_kind(e) == "audio_delta"))
            )
            for s in (seen_a, seen_b)
        ]
        assert ms[0] > ms[1] + 500, ms
        await asyncio.gather(a.close(), b.close())


async def test_error_event_keeps_session_and_close_ends_it(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        session = await client.open_session()
        bad = await session.send_audio(b"\0\0" * 160, fmt=PcmFormat(S16LE, 8000, 1))  # not the input format
        err = await session.wait_for("error", timeout_s=10)
        assert err.error.code == errors.ErrorCode.AUDIO_FORMAT_MISMATCH and err.error.event_id == bad
        await session.send_audio(b"\0\0" * 320)  # the session goes on
        await session.close()
        assert session.closed_reason == "client_close"
        with pytest.raises(SessionClosedError):
            await session.send_audio(b"\0\0" * 320)


async def test_bad_open_raises_typed_error(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        with pytest.raises(errors.BadRequestError) as exc:
            await client.open_session(model="no-such-model")
        assert exc.value.code == errors.ErrorCode.MODEL_MISMATCH


async def test_resume_with_token(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        session = await client.open_session()
        with pytest.raises(errors.UnauthenticatedError):
            await client.resume(session.session_id, "0" * 64)
        await session.close()
