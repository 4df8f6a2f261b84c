"""The session service end to end: one session service, two parrot workers, in this process
(the ``stack`` fixture of tests/conftest.py); what only a process shows -- SIGTERM and its drain --
with a real ``duplex session`` process. The CLI's refusal of a bad plugin (its exit code and
message) is its ``main`` called in this process.

Checks by CONTENT that every caller gets back only its own reply, that no audio of a cancelled
epoch follows ``audio_cancelled``, that bad input gets its stable code (or call status) while
other sessions go on, and that sessions spread over both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat, StreamConverter, decode, encode
from duplex.cli import main
from duplex.v1 import common_pb2, session_pb2, session_pb2_grpc
from session_service.session import outbound
from session_service.workers.placement import rendezvous_pick
from tests.procs import start_service
from tests.session_helpers import (
    Conversation,
    InProcessStack,
    metrics_text,
    open_event,
    sample,
    sample_sum,
    session_args,
    session_server,
    similarity,
    speech,
    to_16k,
    utterance_pcm,
    worker_server,
)
from tests.worker_helpers import wait_until
from worker_service.models.parrot import parrot_reply

pytestmark = pytest.mark.stack(n_workers=2, runner={"idle_timeout_s": 20})

PITCH = 4.0
SERVING = health_pb2.HealthCheckResponse.SERVING
# A few sessions speak other formats, so conversion both ways is on the path being checked.
FORMATS = [PCM16K_MONO] * 12 + [
    PcmFormat(F32LE, 24000, 1),
    PcmFormat(S16LE, 48000, 2),
    PcmFormat(S16LE, 8000, 1),
    PcmFormat(F32LE, 16000, 1),
]


async def _reply(
    conv: Conversation, fmt: PcmFormat, within: float = 30
) -> tuple[session_pb2.ResponseDone, bytes]:
    done = await conv.wait_kind("response_done", within=within)
    rid = done.response_done.response_id
    pcm = b"".join(e.audio_delta.pcm for e in conv.of("audio_delta") if e.audio_delta.response_id == rid)
    return done.response_done, pcm


@pytest.mark.stack(clock_speed=4.0)  # replies paced by silence continuation at 4x (content is checked)
async def test_sixteen_sessions_each_get_only_their_own_reply(stack: InProcessStack) -> None:
    voices = [speech(i) for i in range(16)]
    workers = stack.worker_addresses
    placed_before = {w: sample("duplex_session_worker_sessions", {"worker": w}) for w in workers}
    async with grpc.aio.insecure_channel(stack.target) as ch:
        convs = [Conversation(ch).start(open_event(fmt)) for fmt in FORMATS]
        opened = [await c.wait_kind("opened") for c in convs]
        ids = [o.opened.session_id for o in opened]
        assert len(set(ids)) == 16
        # Sessions spread over both workers: rendezvous placement, visible in the placement gauge
        # (only the session tier writes it, per worker address; compared with before, as earlier
        # tests in this process may have left their value on a reused port).
        worker_ids = [w.config.worker_id for w in stack.workers]  # placement ranks by worker id
        placement = {rendezvous_pick(sid, worker_ids) for sid in ids}
        assert placement == set(worker_ids)
        for w in workers:
            assert sample("duplex_session_worker_sessions", {"worker": w}) - placed_before[w] >= 1, w
        await asyncio.gather(
            *(c.stream(utterance_pcm(v, f), f) for c, v, f in zip(convs, voices, FORMATS, strict=True))
        )
        replies = await asyncio.gather(*(_reply(c, f) for c, f in zip(convs, FORMATS, strict=True)))
        for c in convs:
            c.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await asyncio.gather(*(c.wait_done() for c in convs))

    # Each reply is parrot_reply(committed span) of its own input: find that span (frame-aligned,
    # as the worker cut it) to get the exact expected reply, then check each reply against every
    # session's expected reply by content.
    got = [to_16k(pcm, out_format(fmt)) for (_, pcm), fmt in zip(replies, FORMATS, strict=True)]
    heard = [worker_input(utterance_pcm(v, f), f) for v, f in zip(voices, FORMATS, strict=True)]
    # The worker commits whole frames (speech padded by a frame each side): the exact length.
    lengths = [round(c.of("committed")[0].committed.audio_ms * 16 / 512) * 512 for c in convs]
    expected = [
        best_expected(n, g, h, out_format(f)) for n, g, h, f in zip(lengths, got, heard, FORMATS, strict=True)
    ]
    for i, ((done, _), conv) in enumerate(zip(replies, convs, strict=True)):
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, (i, done)
        assert conv.of("error") == [], (i, conv.of("error"))
        assert conv.kinds()[-1] == "closed"
        # Duration kept: the reply is as long as the committed utterance (speech + a frame each side).
        assert 0.6 * len(voices[i]) < len(got[i]) < 1.6 * len(voices[i]) + 16000, (i, len(got[i]))
        scores = [similarity(got[i], e) for e in expected]
        own, others = scores[i], max(s for j, s in enumerate(scores) if j != i)
        assert own > 0.8 and own > others + 0.4, (i, own, others)
        # Every audio delta names this session's response and epoch.
        for e in conv.of("audio_delta"):
            assert (e.audio_delta.response_id, e.audio_delta.epoch) == (done.response_id, 1)
        acks = [e.input_ack.seq for e in conv.of("input_ack")]
        assert acks == sorted(acks) and acks[-1] == conv.seq


def out_format(fmt: PcmFormat) -> PcmFormat:
    """The default output format of a session: the input's rate with the model's encoding (the
    parrot's s16), mono."""
    return PcmFormat(PCM16K_MONO.encoding, fmt.sample_rate_hz, 1)


def worker_input(pcm: bytes, fmt: PcmFormat) -> np.ndarray:
    """What the worker heard: the session's conversion to 16 kHz mono (chunking-independent)."""
    out = StreamConverter(fmt, PCM16K_MONO).convert(pcm)
    return decode(out, PCM16K_MONO)[:, 0]


def best_expected(
    n: int, got: np.ndarray, heard: np.ndarray, out: PcmFormat, *, phase: int = 0
) -> np.ndarray:
    """parrot_reply of the frame-aligned span of ``heard`` that best explains ``got``, sent
    through the same output conversion as the real reply."""
    best, best_score = parrot_reply(heard[:n], PITCH), -1.0
    for a in range(phase, min(len(heard) - n, 14 * 512) + 1, 512):
        reply = encode(parrot_reply(heard[a : a + n], PITCH), PCM16K_MONO)
        cand = to_16k(StreamConverter(PCM16K_MONO, out).convert(reply), out)
        score = similarity(got, cand)
        if score > best_score:
            best, best_score = cand, score
    return best


@pytest.mark.stack(clock_speed=4.0)  # the reply is paced by silence continuation: at 4x
async def test_barge_in_mid_reply_leaves_no_cancelled_audio(stack: InProcessStack) -> None:
    # A long utterance (all voices back to back, the worker caps it at 15 s) makes a reply long
    # enough to interrupt even on a worker that steps much faster than real time (and with the
    # session's silence continuation at 4x: about 4 s).
    voice = np.concatenate([speech(i) for i in range(16)])
    events_before = sample_sum("duplex_session_events_total")
    async with grpc.aio.insecure_channel(stack.target) as ch:
        conv = Conversation(ch).start(open_event(extra_body={"silence_ms": 1500}))
        await conv.wait_kind("opened")
        cancelled: list[tuple[int, session_pb2.AudioCancelled]] = []  # where, and what
        cancelled_mid_reply = False
        for attempt in range(3):
            start = len(conv.events)
            await conv.stream(
                utterance_pcm(voice, PCM16K_MONO, tail_s=1.8), PCM16K_MONO, chunk_ms=40, speedup=16
            )
            await conv.wait_kind("audio_delta", start=start, within=30)
            conv.send(session_pb2.ClientEvent(event_id=f"barge{attempt}", barge_in=session_pb2.BargeIn()))
            ac_ev = await conv.wait_kind("audio_cancelled", start=start)
            ac = ac_ev.audio_cancelled
            i_ac = conv.events.index(ac_ev)
            cancelled.append((i_ac, ac))
            assert ac.epoch == ac.cancelled_epoch + 1
            if ac.response_id:
                done = (await conv.wait_kind("response_done", start=i_ac + 1)).response_done
                assert done.status == session_pb2.RESPONSE_STATUS_CANCELLED
                assert done.reason == "barge_in"
                cancelled_mid_reply = True
                break
            conv.seq = 0  # the epoch advanced anyway: seq restarts
        assert cancelled_mid_reply
        # The session goes on in the new epoch: seq restarts at 1 and a new turn gets a full reply.
        conv.seq = 0
        start = len(conv.events)
        phase = -(conv.sent_bytes // 2) % 512  # where this utterance sits in the worker's frame grid
        await conv.stream(utterance_pcm(speech(5), PCM16K_MONO, tail_s=1.8), PCM16K_MONO, speedup=8)
        done = (await conv.wait_kind("response_done", start=start, within=30)).response_done
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        new = [e for e in conv.events[start:] if e.HasField("audio_delta")]
        assert new and all(e.audio_delta.epoch == ac.epoch for e in new)
        got = to_16k(b"".join(e.audio_delta.pcm for e in new), PCM16K_MONO)
        committed = [e for e in conv.events[start:] if e.HasField("committed")][-1].committed
        n = round(committed.audio_ms * 16 / 512) * 512
        heard = worker_input(utterance_pcm(speech(5), PCM16K_MONO, tail_s=1.8), PCM16K_MONO)
        assert similarity(got, best_expected(n, got, heard, PCM16K_MONO, phase=phase)) > 0.8
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done()
    # No audio of a cancelled epoch came after its audio_cancelled, up to the end of the stream
    # (a whole further turn later: anything that was in flight from the worker has arrived).
    for i_ac, ac in cancelled:
        stale = [
            e
            for e in conv.events[i_ac + 1 :]
            if e.HasField("audio_delta") and e.audio_delta.epoch <= ac.cancelled_epoch
        ]
        assert stale == [], f"{len(stale)} audio deltas of the cancelled epoch after audio_cancelled"
    assert sample_sum("duplex_session_events_total") > events_before


async def test_acks_ride_on_reply_audio_for_a_client_that_reads_them(stack: InProcessStack) -> None:
    """A client that opened with ``acks_on_output`` and keeps streaming while the reply plays gets
    its acks on the reply's audio (fewer messages), each append still acknowledged, in order."""
    carried_before = sample_sum("duplex_session_carried_acks_total")
    async with grpc.aio.insecure_channel(stack.target) as ch:
        first = open_event(extra_body={"silence_ms": 300})
        first.open.acks_on_output = True
        conv = Conversation(ch).start(first)
        await conv.wait_kind("opened")
        # An utterance, then 4 s more of quiet input streamed at real time while the reply plays.
        voice = utterance_pcm(speech(3), PCM16K_MONO, tail_s=0.6)
        await conv.stream(voice, PCM16K_MONO, chunk_ms=32, speedup=1)
        quiet = bytes(PCM16K_MONO.bytes_for_ms(32))
        for _ in range(125):
            conv.append(quiet)
            await asyncio.sleep(0.032)
        done = (await conv.wait_kind("response_done", within=30)).response_done
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        last = conv.seq
        await conv.wait_for(
            lambda e: (e.input_ack.seq if e.HasField("input_ack") else e.carried_ack.seq) >= last, within=10
        )
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done()
    acks = [
        (e.WhichOneof("event"), (e.input_ack if e.HasField("input_ack") else e.carried_ack).seq)
        for e in conv.events
        if e.HasField("input_ack") or e.HasField("carried_ack")
    ]
    seqs = [seq for _, seq in acks]
    assert seqs == sorted(seqs) and seqs[-1] == last  # in order, every append covered
    on_audio = [seq for kind, seq in acks if kind == "audio_delta"]
    deltas = sum(e.HasField("audio_delta") for e in conv.events)
    # The reply's frames carried acks: most of them (a frame made while the input ran late,
    # from the service's own silence, has no append to carry), never none.
    assert deltas > 0 and len(on_audio) >= deltas / 2, (deltas, acks)
    standalone = [seq for kind, seq in acks if kind == "input_ack"]
    assert len(standalone) <= last - len(on_audio)  # an input_ack message fewer for each carried
    assert sample_sum("duplex_session_carried_acks_total") - carried_before >= len(on_audio)


async def test_bad_input_gets_its_code_and_other_sessions_are_unaffected(stack: InProcessStack) -> None:
    counted = ("private_runtime_key", "invalid_pcm_length", "chunk_too_large", "session_not_open")
    errors_before = {code: sample("duplex_session_errors_total", {"code": code}) for code in counted}
    async with grpc.aio.insecure_channel(stack.target) as ch:
        good = Conversation(ch).start(open_event())
        await good.wait_kind("opened")
        good_stream = asyncio.create_task(good.stream(utterance_pcm(speech(9), PCM16K_MONO), PCM16K_MONO))

        # Fatal opens end the call with a status and the stable code.
        fatal = {
            "private key": (
                open_event(extra_body={"_worker_params": {"x": 1}}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "private_runtime_key",
            ),
            "model_path": (
                open_event(extra_body={"model_path": "/x"}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "private_runtime_key",
            ),
            "bad runtime": (
                open_event(extra_body={"pitch_semitones": 99}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_runtime_config",
            ),
            "huge extra_body": (
                open_event(extra_body={f"k{i}": "v" * 32 for i in range(600)}),
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_runtime_config",
            ),
            "silence out of range": (
                open_event(turn_detection=session_pb2.TurnDetection(auto_respond=True, silence_ms=20_000)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_config",
            ),
            "wrong model": (
                open_event(model="gpt-voice"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "model_mismatch",
            ),
            "bad format": (
                open_event(PcmFormat(S16LE, 12345, 1)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "unsupported_audio_format",
            ),
            "bad token": (
                session_pb2.ClientEvent(
                    resume=session_pb2.SessionResume(session_id="sess_x", resume_token="nope")
                ),
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid_resume_token",
            ),
        }
        for name, (ev, status, code) in fatal.items():
            c = Conversation(ch).start(ev)
            await c.wait_done()
            assert c.status == status and c.error is not None and c.error.code == code, (
                name,
                c.status,
                c.error,
            )

        # A message far beyond any valid event is refused by gRPC before it is parsed.
        huge = Conversation(ch).start(open_event())
        await huge.wait_kind("opened")
        huge.send(_append(1, b"\x00" * (2 * 1024 * 1024)))
        await huge.wait_done()
        assert huge.status == grpc.StatusCode.RESOURCE_EXHAUSTED

        bad = Conversation(ch).start(
            session_pb2.ClientEvent(event_id="early", commit=session_pb2.InputAudioCommit())
        )
        err = await bad.wait_kind("error")
        assert (err.error.code, err.error.event_id) == ("session_not_open", "early")
        bad.send(open_event())
        await bad.wait_kind("opened")
        checks = [
            (session_pb2.ClientEvent(event_id="again", open=open_event().open), "already_open"),
            (_append(1, b"\x00" * 1001), "invalid_pcm_length"),
            (
                _append(
                    2,
                    b"\x00" * 1024,
                    common_pb2.AudioFormat(encoding=S16LE, sample_rate_hz=44100, channels=1),
                ),
                "audio_format_mismatch",
            ),
            (
                _append(
                    3, b"\x00" * 1024, common_pb2.AudioFormat(encoding=7, sample_rate_hz=16000, channels=1)
                ),
                "unsupported_audio_format",
            ),
            (_append(4, b"\x00" * (256 * 1024 + 2)), "chunk_too_large"),
            (_append(5, b"\x00" * 1024), ""),
            (_append(5, b"\x00" * 1024), "seq_out_of_order"),
            (
                session_pb2.ClientEvent(event_id="rc", response_create=session_pb2.ResponseCreate()),
                "no_committed_input",
            ),
            (
                session_pb2.ClientEvent(event_id="cancel", response_cancel=session_pb2.ResponseCancel()),
                "no_active_response",
            ),
        ]
        for ev, _ in checks:
            bad.send(ev)
        await bad.wait_for(lambda e: e.HasField("error") and e.error.event_id == "cancel")
        errors = [(e.error.event_id, e.error.code) for e in bad.of("error")[1:]]
        assert errors == [(ev.event_id, code) for ev, code in checks if code], errors
        assert [e.input_ack.seq for e in bad.of("input_ack")] == [5]

        await good_stream
        done = (await good.wait_kind("response_done", within=30)).response_done
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED and good.of("error") == []
        got = to_16k(b"".join(e.audio_delta.pcm for e in good.of("audio_delta")), PCM16K_MONO)
        n = round(good.of("committed")[0].committed.audio_ms * 16 / 512) * 512
        heard = worker_input(utterance_pcm(speech(9), PCM16K_MONO), PCM16K_MONO)
        assert similarity(got, best_expected(n, got, heard, PCM16K_MONO)) > 0.8
        for c in (good, bad):
            c.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await c.wait_done()
    for code in counted:
        assert sample("duplex_session_errors_total", {"code": code}) - errors_before[code] >= 1, code


def _append(seq: int, pcm: bytes, fmt: common_pb2.AudioFormat | None = None) -> session_pb2.ClientEvent:
    ev = session_pb2.ClientEvent(
        event_id=f"ap{seq}-{len(pcm)}", append=session_pb2.InputAudioAppend(seq=seq, pcm=pcm)
    )
    if fmt is not None:
        ev.append.format.CopyFrom(fmt)
    return ev


async def test_resume_rebinds_to_the_live_session(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        first = Conversation(ch).start(
            open_event(turn_detection=session_pb2.TurnDetection(auto_respond=False))
        )
        opened = (await first.wait_kind("opened")).opened
        first.append(b"\x00" * 2048)
        await first.wait_kind("input_ack")
        first.cancel()  # the stream drops; the session stays for a resume
        await first.wait_done()
        second = Conversation(ch).start(
            session_pb2.ClientEvent(
                resume=session_pb2.SessionResume(
                    session_id=opened.session_id, resume_token=opened.resume_token
                )
            )
        )
        again = (await second.wait_kind("opened")).opened
        assert (again.session_id, again.epoch) == (opened.session_id, opened.epoch)
        second.seq = 1
        second.append(b"\x00" * 2048)
        ack = await second.wait_kind("input_ack")
        assert ack.input_ack.seq == 2
        second.send(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
        committed = (await second.wait_kind("committed")).committed
        assert committed.audio_ms == 128
        second.half_close()  # half-close ends the session
        await second.wait_for(lambda e: e.HasField("closed"))


def _id(ev: session_pb2.ServerEvent) -> int:
    prefix, _, n = ev.event_id.partition("_")
    assert prefix == "se", ev.event_id
    return int(n)


async def test_event_ids_go_on_across_a_resume_in_the_order_they_arrive(
    stack: InProcessStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25: after a resume, ids jumped (``se_283``, then ``opened`` ``se_304``, then
    ``se_284``...): events that waited for the resumed stream were numbered as they were queued,
    and ``opened`` was put ahead of them. Ids are given as events go out.

    A client stops reading mid-reply: its window (64 KiB) fills, the server waits in a write and
    the reply piles up in the session's queue. It resumes on a new call, and the old call reads
    on to its ``closed{resumed_elsewhere}``. Each stream's ids increase, the new one starts with
    ``opened``, every id is used once and none is skipped, and the reply arrives whole."""
    # The old stream reads again only once the resume is in: it must not be cut off meanwhile.
    monkeypatch.setattr(outbound, "HANDOVER_TIMEOUT_S", 60.0)
    options = [("grpc.http2.bdp_probe", 0)]  # the old stream's window stays at 64 KiB
    out_fmt = PcmFormat(S16LE, 48000, 2)  # 192 KB of reply a second: it fills the window soon
    first = open_event()
    first.open.config.output_format.CopyFrom(out_fmt.to_proto())
    reading = asyncio.Event()
    reading.set()
    old: list[session_pb2.ServerEvent] = []
    async with (
        grpc.aio.insecure_channel(stack.target, options=options) as ch,
        grpc.aio.insecure_channel(stack.target) as ch2,
    ):
        call = session_pb2_grpc.DuplexSessionStub(ch).Converse(timeout=60)

        async def read_old() -> None:
            async for ev in call:  # type: ignore[attr-defined]
                old.append(ev)
                await reading.wait()

        await call.write(first)
        reader = asyncio.create_task(read_old())
        await wait_until(lambda: bool(old))
        opened = old[0].opened
        runner = stack.session.registry.get(opened.session_id)
        assert runner is not None
        pcm = utterance_pcm(speech(0), PCM16K_MONO)
        step = PCM16K_MONO.bytes_for_ms(20)
        for seq, at in enumerate(range(0, len(pcm), step), 1):
            await call.write(_append(seq, pcm[at : at + step]))
        await wait_until(lambda: any(e.HasField("audio_delta") for e in old), within=30)
        reading.clear()  # the client stops reading mid-reply
        await wait_until(lambda: len(runner.outbound) >= 5, within=30)  # the reply waits in the queue
        attached = runner.outbound.current_attachment
        resume = session_pb2.SessionResume(
            session_id=opened.session_id, resume_token=opened.resume_token, last_event_id=old[-1].event_id
        )
        new = Conversation(ch2).start(session_pb2.ClientEvent(resume=resume))
        await wait_until(lambda: runner.outbound.current_attachment != attached)  # the resume is in
        reading.set()  # the old stream reads what it was sent, then its farewell
        await asyncio.wait_for(reader, 30)
        done = (await new.wait_kind("response_done", within=30)).response_done
        new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await new.wait_done()

    before, after = [_id(e) for e in old], [_id(e) for e in new.events]
    assert old[-1].closed.reason == "resumed_elsewhere"
    assert new.kinds()[0] == "opened" and new.kinds()[-1] == "closed"
    assert before == sorted(before) and after == sorted(after), (before[-5:], after[:5])
    assert sorted(before + after) == list(range(1, len(before) + len(after) + 1))
    # The reply is whole: its audio on both streams is what response_done counts.
    pcm_out = b"".join(
        e.audio_delta.pcm for e in [*old, *new.events] if e.audio_delta.response_id == done.response_id
    )
    assert len(pcm_out) // out_fmt.frame_bytes * 1000 // out_fmt.sample_rate_hz == done.audio_ms > 0


async def test_the_event_a_dropped_stream_was_writing_goes_to_the_stream_that_resumes(
    stack: InProcessStack,
) -> None:
    """A client stops reading mid-reply (the server waits in a write: its window is full) and
    drops the call. The event that write held was never sent: it goes back to the session's
    queue, with its id given back, and the resumed stream gets it right after ``opened``."""
    options = [("grpc.http2.bdp_probe", 0)]  # the window stays at 64 KiB
    out_fmt = PcmFormat(S16LE, 48000, 2)  # 192 KB of reply a second: it fills the window soon
    first = open_event()
    first.open.config.output_format.CopyFrom(out_fmt.to_proto())
    reading = asyncio.Event()
    reading.set()
    old: list[session_pb2.ServerEvent] = []
    async with grpc.aio.insecure_channel(stack.target, options=options) as ch:
        call = session_pb2_grpc.DuplexSessionStub(ch).Converse(timeout=60)

        async def read_old() -> None:
            async for ev in call:  # type: ignore[attr-defined]
                old.append(ev)
                await reading.wait()

        await call.write(first)
        reader = asyncio.create_task(read_old())
        await wait_until(lambda: bool(old))
        opened = old[0].opened
        runner = stack.session.registry.get(opened.session_id)
        assert runner is not None
        pcm = utterance_pcm(speech(0), PCM16K_MONO)
        step = PCM16K_MONO.bytes_for_ms(20)
        for seq, at in enumerate(range(0, len(pcm), step), 1):
            await call.write(_append(seq, pcm[at : at + step]))
        await wait_until(lambda: any(e.HasField("audio_delta") for e in old), within=30)
        reading.clear()  # the client stops reading mid-reply
        out = runner.outbound
        await wait_until(lambda: len(out) >= 5, within=30)  # the server waits in a write
        held = out.numbered  # the id of the event that write holds
        call.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await wait_until(lambda: runner._detached_at is not None)
        assert out.numbered == held - 1  # given back, with its event
    async with grpc.aio.insecure_channel(stack.target) as ch2:
        resume = session_pb2.SessionResume(session_id=opened.session_id, resume_token=opened.resume_token)
        new = Conversation(ch2).start(session_pb2.ClientEvent(resume=resume))
        await new.wait_kind("response_done", within=30)
        new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await new.wait_done()
    ids = [_id(e) for e in new.events]
    assert new.kinds()[0] == "opened" and ids == list(range(held, held + len(ids)))


async def test_an_error_echoes_at_most_256_characters_of_an_event_id(stack: InProcessStack) -> None:
    """Issue 25: an error echoed a 100 KB ``event_id`` in full. It echoes its first 256
    characters, before the open (``session_not_open``) and in a session (``invalid_event``); a
    shorter one is echoed as it is."""
    long_id = "".join(chr(ord("a") + i % 26) for i in range(100_000))
    async with grpc.aio.insecure_channel(stack.target) as ch:
        conv = Conversation(ch).start(session_pb2.ClientEvent(event_id=long_id))  # not an open
        conv.send(open_event())
        await conv.wait_kind("opened")
        conv.send(session_pb2.ClientEvent(event_id=long_id))  # nothing set
        conv.send(session_pb2.ClientEvent(event_id="e" * 256))
        await conv.wait_until(lambda: len(conv.of("error")) == 3)
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done()
    errors = [e.error for e in conv.of("error")]
    assert [e.code for e in errors] == ["session_not_open", "invalid_event", "invalid_event"]
    assert [len(e.event_id) for e in errors] == [256, 256, 256]  # (not the 100 KB in a failure)
    assert [e.event_id for e in errors] == [long_id[:256], long_id[:256], "e" * 256]
    assert all(e.ByteSize() < 2048 for e in conv.of("error"))


@pytest.mark.stack(service={"metrics_port": 0})  # /metrics on a free port
async def test_health_reflection_and_metrics(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "duplex.v1.DuplexSession"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in call for s in r.list_services_response.service]
        assert "duplex.v1.DuplexSession" in names
    assert stack.session.metrics is not None
    # The process-wide registry (every tier of this process), as this replica's /metrics serves it.
    text = await asyncio.to_thread(metrics_text, f"127.0.0.1:{stack.session.metrics.port}")
    for name in (
        "duplex_session_active_sessions",
        "duplex_session_events_total",
        "duplex_session_errors_total",
        "duplex_session_dropped_outputs_total",
        "duplex_session_frame_latency_seconds_bucket",
        "duplex_sparse_fail_closed_total",
        "duplex_session_worker_command_items_bucket",
    ):
        assert name in text, name
    assert "sess_" not in text  # no per-session labels


def test_unknown_plugin_path_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI's own refusal, in this process: the plugin is loaded before any worker is dialled
    # (none is needed) and before anything is bound or served.
    for plugin in ("no_such_pkg.plugins:Nope", "session_service.plugins.parrot:Missing"):
        code = main(
            [
                "session",
                "--plugin",
                plugin,
                "--workers",
                "127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "0",
            ]
        )
        out, err = capsys.readouterr()
        assert code == 2 and "unknown plugin" in err and out == "", err


async def test_takeover_by_another_replica_fences_the_old_owner_then_drain(stack: InProcessStack) -> None:
    manual = session_pb2.TurnDetection(auto_respond=False)
    # Replica B: the same workers and resume secret as the stack's replica A.
    async with (
        session_server(stack.worker_addresses, resume_keys=stack.resume_keys) as other,
        grpc.aio.insecure_channel(stack.target) as ch_a,
        grpc.aio.insecure_channel(other.address) as ch_b,
    ):
        old = Conversation(ch_a).start(open_event(turn_detection=manual))
        opened = (await old.wait_kind("opened")).opened
        old.append(b"\x00" * 2048)
        await old.wait_kind("input_ack")
        # Resume on replica B: it attaches with takeover and gets a higher epoch.
        new = Conversation(ch_b).start(
            session_pb2.ClientEvent(
                resume=session_pb2.SessionResume(
                    session_id=opened.session_id, resume_token=opened.resume_token
                )
            )
        )
        taken = (await new.wait_kind("opened")).opened
        assert taken.session_id == opened.session_id and taken.epoch > opened.epoch
        # The old owner is fenced out by the worker, which tells it at once: its stream is told
        # closed{resumed_elsewhere}, as a stream displaced on its own replica is, and nothing after.
        assert (await old.wait_kind("closed")).closed.reason == "resumed_elsewhere"
        await old.wait_done()
        assert old.of("error") == []
        # The new owner goes on.
        new.append(b"\x00" * 2048)
        new.send(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
        assert (await new.wait_kind("committed")).committed.audio_ms == 64  # counted by this replica
        # Draining replica B: go_away with the resume token, then closed (a process does this on
        # SIGTERM: test_sigterm_drains_a_session_process).
        drained = asyncio.create_task(other.drain())
        away = (await new.wait_kind("go_away")).go_away
        assert away.resume_token == opened.resume_token and away.reason == "draining"
        assert (await new.wait_kind("closed")).closed.reason == "draining"
        await new.wait_done()
        await asyncio.wait_for(drained, 15)
        await asyncio.wait_for(other.stop(), 15)


@pytest.mark.process
async def test_sigterm_drains_a_session_process() -> None:
    """A real ``duplex session``: its listening line, then on SIGTERM go_away (with the resume
    token) and closed to its clients, and exit 0. Its worker runs in this process."""
    async with worker_server() as worker:
        proc = await asyncio.to_thread(start_service, session_args([worker.address]))
        try:
            async with grpc.aio.insecure_channel(proc.grpc) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                async with asyncio.timeout(30):  # SERVING once it has linked to the worker
                    async for resp in health.Watch(health_pb2.HealthCheckRequest(service="")):
                        if resp.status == SERVING:
                            break
                conv = Conversation(ch).start(
                    open_event(turn_detection=session_pb2.TurnDetection(auto_respond=False))
                )
                opened = (await conv.wait_kind("opened")).opened
                conv.append(b"\x00" * 2048)
                await conv.wait_kind("input_ack")
                proc.proc.send_signal(signal.SIGTERM)
                away = (await conv.wait_kind("go_away")).go_away
                assert away.resume_token == opened.resume_token and away.reason == "draining"
                assert (await conv.wait_kind("closed")).closed.reason == "draining"
                await conv.wait_done()
            assert await asyncio.to_thread(proc.proc.wait, 15) == 0
        finally:
            await asyncio.to_thread(proc.terminate, 10)


async def test_a_client_that_stops_reading_is_cut_off_and_its_call_ends(stack: InProcessStack) -> None:
    """``update``s, each answered with a 4 KB ``updated`` (the config, its instructions in it),
    never read: they fill the client's 64 KiB window, so the handler waits in a write. The
    session's queue overflows, the session is closed, and the call ends now
    (``duplex_session_streams``), not when the client goes away."""
    update = session_pb2.ClientEvent(
        update=session_pb2.SessionUpdate(config=session_pb2.SessionConfig(instructions="x" * 4000))
    )
    cut_before = sample("duplex_session_errors_total", {"code": "slow_consumer"})
    streams_before = sample("duplex_session_streams")
    options = [("grpc.http2.bdp_probe", 0)]  # else the client grows its window and buffers it all
    async with grpc.aio.insecure_channel(stack.target, options=options) as ch:
        call = session_pb2_grpc.DuplexSessionStub(ch).Converse(timeout=30)
        await call.write(open_event())
        assert (await call.read()).HasField("opened")  # type: ignore[attr-defined]
        assert sample("duplex_session_streams") == streams_before + 1
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            for _ in range(1400):  # 5.6 MB of answers, more than the session's 4 MiB queue
                await asyncio.wait_for(call.write(update), 5)
        async with asyncio.timeout(10):
            while sample("duplex_session_streams") != streams_before or len(stack.session.manager):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        call.cancel()
    assert sample("duplex_session_errors_total", {"code": "slow_consumer"}) == cut_before + 1
