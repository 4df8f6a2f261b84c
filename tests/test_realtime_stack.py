"""The official ``openai`` Python SDK against ``duplex up --realtime-port`` (the Realtime edge
as its own process, in front of a real session service and parrot worker): a turn answered in
``audio/pcm`` 24 kHz and in G.711, barge-in, and a cancelled response."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from duplex.audio import PCMA_8K, PCMU_8K, PcmFormat, decode
from duplex.stack import LocalStack
from realtime_service.protocol import PCM24K
from tests.realtime_helpers import HELLO_SPEECH_S, audio_of, read_until, sdk, sending, speech, types

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def edge() -> Iterator[LocalStack]:
    with LocalStack(realtime_port=0) as stack:
        yield stack


def rms(pcm: bytes, fmt: PcmFormat) -> float:
    samples = decode(pcm, fmt)
    return float(np.sqrt(np.mean(np.square(samples)))) if len(samples) else 0.0


def response_done(event: Any) -> bool:
    return bool(event.type == "response.done")


async def test_a_turn_is_answered_with_the_parrots_reply_in_pcm_24k(edge: LocalStack) -> None:
    async with sdk(edge.realtime_url).realtime.connect(model="parrot") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.audio.input.format.type == "audio/pcm"
        assert created.session.audio.input.format.rate == 24000
        assert created.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "instructions": "repeat after me"})
        updated = await conn.recv()
        assert updated.type == "session.updated" and updated.session.instructions == "repeat after me"

        async with sending(conn, speech(PCM24K), PCM24K):
            events = await read_until(conn, response_done)
        kinds = types(events)
        expected = [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "conversation.item.added",
            "response.created",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_audio.delta",
            "response.output_audio.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.done",
        ]
        positions = [kinds.index(k) for k in expected]
        assert positions == sorted(positions), kinds
        done = events[-1]
        assert done.response.status == "completed"
        # The user item that was committed is the one speech started for.
        started = events[kinds.index("input_audio_buffer.speech_started")]
        committed = events[kinds.index("input_audio_buffer.committed")]
        assert committed.item_id == started.item_id
        # Every delta belongs to this response and its one assistant item.
        deltas = [e for e in events if e.type == "response.output_audio.delta"]
        assert {(d.response_id, d.item_id) for d in deltas} == {
            (done.response.id, done.response.output[0].id)
        }
        reply = audio_of(events)
        assert len(reply) % 2 == 0
        assert math.isclose(PCM24K.duration_ms(len(reply)) / 1000, HELLO_SPEECH_S, rel_tol=0.35)
        assert rms(reply, PCM24K) > 0.01  # a voice, not silence


@pytest.mark.parametrize(("kind", "fmt"), [("audio/pcmu", PCMU_8K), ("audio/pcma", PCMA_8K)])
async def test_g711_in_and_out(edge: LocalStack, kind: str, fmt: PcmFormat) -> None:
    async with sdk(edge.realtime_url).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        audio = {"input": {"format": {"type": kind}}, "output": {"format": {"type": kind}}}
        await conn.session.update(session={"type": "realtime", "audio": audio})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.input.format.type == kind
        assert updated.session.audio.output.format.type == kind
        async with sending(conn, speech(fmt), fmt):
            events = await read_until(conn, response_done)
        assert events[-1].response.status == "completed"
        reply = audio_of(events)
        # One byte per sample at 8 kHz: the reply lasts about as long as the speech.
        assert math.isclose(len(reply) / 8000, HELLO_SPEECH_S, rel_tol=0.35)
        assert rms(reply, fmt) > 0.01


async def test_barge_in_cancels_the_response_and_no_audio_of_it_follows(edge: LocalStack) -> None:
    async with sdk(edge.realtime_url).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        first: list[Any] = []
        async with sending(conn, speech(PCM24K, trailing_silence_ms=800), PCM24K):
            await read_until(conn, lambda e: e.type == "response.output_audio.delta", seen=first)
        response_id = first[-1].response_id
        # The user speaks again over the reply.
        rest: list[Any] = []
        async with sending(conn, speech(PCM24K), PCM24K):
            await read_until(
                conn,
                lambda e: e.type == "response.done" and e.response.id == response_id,
                seen=rest,
            )
            cancelled = rest[-1]
            assert cancelled.response.status == "cancelled"
            assert cancelled.response.status_details.reason == "turn_detected"
            assert "input_audio_buffer.speech_started" in types(rest)
            # ...and the new turn is answered.
            await read_until(
                conn, lambda e: e.type == "response.done" and e.response.id != response_id, seen=rest
            )
        after = rest[rest.index(cancelled) + 1 :]
        assert audio_of(after, response_id) == b"", "audio of the cancelled response after its response.done"
        assert rest[-1].response.status == "completed"
        assert audio_of(after, rest[-1].response.id)


async def test_response_cancel_with_client_turns(edge: LocalStack) -> None:
    async with sdk(edge.realtime_url).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = await conn.recv()
        assert updated.type == "session.updated" and updated.session.audio.input.turn_detection is None
        async with sending(conn, speech(PCM24K, trailing_silence_ms=200), PCM24K) as task:
            await task
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await read_until(conn, lambda e: e.type == "response.output_audio.delta")
        kinds = types(events)
        # No server VAD: no speech events; the commit made the user item.
        assert "input_audio_buffer.speech_started" not in kinds
        assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
        response_id = events[-1].response_id
        await conn.response.cancel()
        rest = await read_until(conn, response_done)
        assert rest[-1].response.id == response_id and rest[-1].response.status == "cancelled"
        assert rest[-1].response.status_details.reason == "client_cancelled"
        # The item it wrote can be truncated to what was played; not past its audio.
        item_id = events[-1].item_id
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=20)
        truncated = await read_until(conn, lambda e: e.type in ("conversation.item.truncated", "error"))
        assert truncated[-1].type == "conversation.item.truncated" and truncated[-1].audio_end_ms == 20
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=600_000)
        error = await read_until(conn, lambda e: e.type == "error")
        assert error[-1].error.code == "invalid_value" and error[-1].error.param == "audio_end_ms"
