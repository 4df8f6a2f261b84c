"""Client pieces that need no real stack: seq numbering, WAV conversion, and the protocol
handling against a small in-process fake of the session service (go-away + resume, bearer
token, fatal statuses, error events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from duplex import errors
from duplex.audio import PCM16K_MONO, S16LE, AudioFileError, PcmFormat, write_wav
from duplex.client import (
    ConnectError,
    DuplexClient,
    SeqCounter,
    ServerErrorEvent,
    event_kind,
    load_wav_as,
)
from duplex.v1 import session_pb2, session_pb2_grpc

# ---- pure pieces -------------------------------------------------------------------------


def test_seq_counter_restarts_per_epoch():
    s = SeqCounter()
    assert [s.next(), s.next(), s.next()] == [1, 2, 3]
    s.restart(epoch=2)
    assert s.epoch == 2
    assert [s.next(), s.next()] == [1, 2]


@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2), (16000, 1), (48000, 2)])
def test_load_wav_as_converts_rate_and_channels(tmp_path, rate, channels):
    t = np.arange(rate // 2) / rate  # 0.5 s of a 440 Hz tone
    tone = 0.5 * np.sin(2 * np.pi * 440 * t).astype(np.float32)
    path = tmp_path / "tone.wav"
    write_wav(path, np.repeat(tone[:, None], channels, axis=1), rate)
    pcm = load_wav_as(path, PCM16K_MONO)
    assert len(pcm) == 8000 * 2  # 0.5 s at 16 kHz, 2 bytes per sample
    x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    assert 0.3 < np.abs(x).max() <= 0.51  # the tone survives, no clipping, no channel sum


def test_load_wav_as_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    with pytest.raises(AudioFileError):
        load_wav_as(bad, PCM16K_MONO)
    with pytest.raises(AudioFileError):
        load_wav_as(tmp_path / "missing.wav", PCM16K_MONO)


# ---- a fake session service ----------------------------------------------------------------


class FakeSession(session_pb2_grpc.DuplexSessionServicer):
    """Just enough of the contract to drive the client: acks, a canned reply, cancel, go-away."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.seqs: list[tuple[int, int]] = []  # (epoch, seq) of every append
        self.go_away_after_appends: int | None = None
        self.calls = 0

    async def Converse(self, request_iterator, context) -> AsyncIterator[session_pb2.ServerEvent]:
        self.calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        first = await anext(aiter(request_iterator))
        epoch = 1
        if first.HasField("open"):
            if first.open.model == "nope":
                await errors.abort(
                    context, errors.BadRequestError(errors.ErrorCode.MODEL_MISMATCH, "no such model")
                )
            if first.open.model == "full":
                await errors.abort(context, errors.CapacityError(errors.ErrorCode.CAPACITY_EXHAUSTED, "full"))
            config = first.open.config
        elif first.HasField("resume"):
            if first.resume.resume_token != "tok-2":
                await errors.abort(
                    context, errors.UnauthenticatedError(errors.ErrorCode.INVALID_RESUME_TOKEN, "bad token")
                )
            epoch = 2  # a takeover: new epoch
            config = session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto())
        caps = session_pb2.Capabilities(model="fake", max_append_bytes=4096)
        yield session_pb2.ServerEvent(
            opened=session_pb2.SessionOpened(
                session_id="s1", epoch=epoch, capabilities=caps, resume_token="tok-1", config=config
            )
        )
        appends = 0
        async for ev in request_iterator:
            kind = ev.WhichOneof("event")
            if kind == "append":
                appends += 1
                self.seqs.append((epoch, ev.append.seq))
                yield session_pb2.ServerEvent(
                    input_ack=session_pb2.InputAudioAck(seq=ev.append.seq, epoch=epoch)
                )
                if self.go_away_after_appends == appends and epoch == 1:
                    yield session_pb2.ServerEvent(
                        go_away=session_pb2.GoAway(resume_token="tok-2", reason="draining")
                    )
                    yield session_pb2.ServerEvent(closed=session_pb2.SessionClosed(reason="draining"))
                    return
            elif kind == "commit":
                yield session_pb2.ServerEvent(committed=session_pb2.InputCommitted(turn_id=1, audio_ms=100))
            elif kind == "response_create":
                yield session_pb2.ServerEvent(
                    response_started=session_pb2.ResponseStarted(response_id="r1", turn_id=1, epoch=epoch)
                )
                yield session_pb2.ServerEvent(
                    audio_delta=session_pb2.AudioDelta(
                        response_id="r1", turn_id=1, epoch=epoch, pcm=b"\0\0" * 320
                    )
                )
            elif kind == "barge_in":
                epoch += 1
                yield session_pb2.ServerEvent(
                    audio_cancelled=session_pb2.AudioCancelled(
                        response_id="r1", cancelled_epoch=epoch - 1, epoch=epoch, reason="barge_in"
                    )
                )
                yield session_pb2.ServerEvent(
                    response_done=session_pb2.ResponseDone(
                        response_id="r1", status=session_pb2.RESPONSE_STATUS_CANCELLED, reason="barge_in"
                    )
                )
            elif kind == "clear":
                yield session_pb2.ServerEvent(
                    error=session_pb2.Error(code="invalid_event", message="no", event_id=ev.event_id)
                )
            elif kind == "close":
                yield session_pb2.ServerEvent(closed=session_pb2.SessionClosed(reason="client_close"))
                return


@pytest.fixture
async def fake():
    server = grpc.aio.server()
    servicer = FakeSession()
    session_pb2_grpc.add_DuplexSessionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_open_talk_barge_in_restarts_seq(fake):
    servicer, target = fake
    async with DuplexClient(target, token="secret") as client:
        session = await client.open_session(model="fake")
        assert session.session_id == "s1" and session.epoch == 1
        for _ in range(3):
            await session.send_audio(b"\0\0" * 320)
        await session.commit()
        await session.create_response()
        await session.wait_for("audio_delta", timeout_s=5)
        assert session.active_response_id == "r1"
        await session.barge_in()
        cancelled = await session.wait_for("audio_cancelled", timeout_s=5)
        assert cancelled.audio_cancelled.epoch == 2 and session.epoch == 2
        done = await session.wait_for("response_done", timeout_s=5)
        assert done.response_done.status == session_pb2.RESPONSE_STATUS_CANCELLED
        await session.send_audio(b"\0\0" * 320)
        await session.send_audio(b"\0\0" * 320)
        await session.close()
        assert session.closed and session.closed_reason == "client_close"
    assert servicer.seqs == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2)]
    assert servicer.metadata[0]["authorization"] == "Bearer secret"


async def test_large_append_is_split_to_server_limit(fake):
    servicer, target = fake
    async with DuplexClient(target) as client:
        session = await client.open_session()
        await session.send_audio(b"\1\0" * 5000)  # 10000 bytes, limit 4096
        await session.close()
    assert [s for _, s in servicer.seqs] == [1, 2, 3]


async def test_stream_audio_converts_and_chunks(fake):
    servicer, target = fake
    async with DuplexClient(target) as client:
        session = await client.open_session()
        src = PcmFormat(S16LE, 8000, 2)
        chunks = [b"\0\0\0\0" * 800 for _ in range(5)]  # 0.5 s of 8 kHz stereo
        sent = await session.stream_audio(chunks, fmt=src, chunk_ms=100)
        await session.close()
    assert sent == pytest.approx(500, abs=2)
    assert len(servicer.seqs) == 5


async def test_go_away_reconnects_with_resume_token(fake):
    servicer, target = fake
    servicer.go_away_after_appends = 2
    async with DuplexClient(target) as client:
        session = await client.open_session()
        kinds: list[str] = []

        async def read() -> None:
            async for ev in session.events():
                kinds.append(event_kind(ev))
                if kinds.count("opened") == 2 and ev.WhichOneof("event") == "opened":
                    return

        reader = asyncio.create_task(read())
        for _ in range(2):
            await session.send_audio(b"\0\0" * 320)
        for _ in range(500):  # until the client has seen go_away (or already resumed)
            if session.go_away is not None or session.epoch != 1:
                break
            await asyncio.sleep(0.01)
        for _ in range(2):  # held until the resumed call is up, then sent there
            await session.send_audio(b"\0\0" * 320)
        await asyncio.wait_for(reader, 5)
        assert session.epoch == 2 and session.resume_token == "tok-1"
        await session.close()
    assert servicer.calls == 2
    assert "go_away" in kinds and kinds.count("opened") == 2
    # the third append went to the resumed call, numbered in the new epoch
    assert servicer.seqs[:2] == [(1, 1), (1, 2)] and servicer.seqs[2:] == [(2, 1), (2, 2)]


async def test_fatal_open_errors_are_typed(fake):
    _, target = fake
    async with DuplexClient(target) as client:
        with pytest.raises(errors.BadRequestError) as bad:
            await client.open_session(model="nope")
        assert bad.value.code == "model_mismatch"
        with pytest.raises(errors.CapacityError) as full:
            await client.open_session(model="full")
        assert full.value.code == "capacity_exhausted" and full.value.retryable
        with pytest.raises(errors.UnauthenticatedError) as unauth:
            await client.resume("s1", "wrong")
        assert unauth.value.code == "invalid_resume_token"


async def test_error_event_is_yielded_or_raised(fake):
    _, target = fake
    async with DuplexClient(target) as client:
        session = await client.open_session()
        event_id = await session.clear()
        ev = await session.wait_for("error", timeout_s=5)
        assert ev.error.code == "invalid_event" and ev.error.event_id == event_id
        await session.close()
        strict = await client.open_session(raise_on_error=True)
        await strict.clear()
        with pytest.raises(ServerErrorEvent) as err:
            await strict.wait_for("closed", timeout_s=5)
        assert err.value.code == "invalid_event"
        await strict.close()


async def test_connect_failure_is_clear():
    async with DuplexClient("127.0.0.1:1", connect_timeout_s=0.2) as client:
        with pytest.raises(ConnectError) as err:
            await client.open_session()
    assert err.value.code == "connect_failed"


async def test_call_failure_keeps_the_stable_code():
    from duplex.client import _call_failure

    status = errors.to_rpc_status(errors.FencedError(errors.ErrorCode.STALE_EPOCH, "moved on"))

    class EndedCall:  # what grpc.aio reports for a call the server ended with that status
        async def code(self):
            return status.code

        async def details(self):
            return status.details

        async def trailing_metadata(self):
            return grpc.aio.Metadata(*status.trailing_metadata)

    err = await _call_failure(EndedCall())
    assert isinstance(err, errors.FencedError) and err.code == "stale_epoch" and err.message == "moved on"
