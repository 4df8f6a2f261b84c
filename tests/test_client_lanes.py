"""The Python client's lanes (``duplex.client_lanes.Lanes``): many ``Session`` objects on one
``ConverseMany`` stream, against the in-process stack (a real gRPC server on a free loopback
port, parrot workers)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from duplex import errors
from duplex.audio import PCM16K_MONO
from duplex.client import DuplexClient, event_kind, load_wav_as
from duplex.client_lanes import Lanes
from duplex.stack import example_path
from tests.session_helpers import InProcessStack, sample
from tests.test_client_stack import SILENCE_1S, one_turn

pytestmark = pytest.mark.stack(clock_speed=4.0)  # as test_client_stack: content, not pace

HELLO = example_path("hello.wav")


async def test_sessions_on_lanes_each_get_their_reply_in_shared_messages(stack: InProcessStack) -> None:
    lanes_before = sample("duplex_session_lanes")
    pcm = load_wav_as(HELLO, PCM16K_MONO)
    async with DuplexClient(stack.target) as client:
        lanes = Lanes(client)
        sessions = [await lanes.open_session(model="parrot") for _ in range(3)]
        assert len({s.session_id for s in sessions}) == 3
        assert sample("duplex_session_lanes") == lanes_before + 3
        turns = await asyncio.gather(*(one_turn(s, pcm) for s in sessions))
        for seen in turns:
            done = seen[-1].response_done
            assert done.status == 1, done  # completed
            reply = b"".join(e.audio_delta.pcm for e in seen if event_kind(e) == "audio_delta")
            committed = next(e.committed for e in seen if event_kind(e) == "committed")
            assert abs(PCM16K_MONO.duration_ms(len(reply)) - committed.audio_ms) < 100
        # The three sessions' appends went out together: fewer messages than events.
        assert lanes.messages_sent < 0.7 * lanes.events_sent, (lanes.messages_sent, lanes.events_sent)
        await sessions[0].close()  # one session closes: the others go on
        assert sessions[0].closed and sessions[0].closed_reason == "client_close"
        assert not sessions[1].closed
        await lanes.close()  # the rest close with the stream
        for s in sessions[1:]:
            await asyncio.wait_for(s.close(), 5)
            assert s.closed_reason == "client_close"
    assert sample("duplex_session_lanes") == lanes_before
    assert len(stack.session.manager) == 0


async def test_a_bad_open_on_a_lane_raises_its_typed_error_and_others_go_on(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client, Lanes(client) as lanes:
        good = await lanes.open_session(model="parrot")
        with pytest.raises(errors.BadRequestError) as bad:
            await lanes.open_session(model="no-such-model")
        assert bad.value.code == "model_mismatch"
        seen = await one_turn(good, load_wav_as(HELLO, PCM16K_MONO))
        assert seen[-1].response_done.status == 1
        await good.close()


async def test_a_dropped_lanes_stream_leaves_its_sessions_to_resume(stack: InProcessStack) -> None:
    async with DuplexClient(stack.target) as client:
        lanes = Lanes(client)
        s = await lanes.open_session(model="parrot")
        session_id, token = s.session_id, s.resume_token
        lanes.cancel()  # the stream is dropped: the session fails here, and waits on the server
        with pytest.raises(errors.DuplexError) as dropped:
            async for _ in s.events():
                pass
        assert dropped.value.status == grpc.StatusCode.CANCELLED
        with pytest.raises(errors.DuplexError) as after:  # a dropped stream takes no new session
            await lanes.open_session(model="parrot")
        assert after.value.status == grpc.StatusCode.CANCELLED
        await asyncio.wait_for(lanes.close(), 2)  # its tasks are over
        resumed = await client.resume(session_id, token)  # on a Converse call of its own
        assert resumed.session_id == session_id
        await resumed.send_audio(SILENCE_1S[:640])
        assert (await resumed.wait_for("input_ack", timeout_s=10)).input_ack.seq == 1
        # And back onto a lane of a new stream.
        async with Lanes(client) as again:
            back = await again.resume(session_id, resumed.resume_token)
            assert back.session_id == session_id
            closed = await resumed.wait_for("closed", timeout_s=10)
            assert closed.closed.reason == "resumed_elsewhere"
            await back.close()
            assert back.closed_reason == "client_close"
