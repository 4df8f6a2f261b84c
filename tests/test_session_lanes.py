"""``ConverseMany``: many sessions ("lanes") on one stream, against the in-process stack (parrot
workers, a real gRPC server on a free loopback port).

Checks by CONTENT that every lane gets back only its own reply (beside a plain ``Converse``
session), that several lanes' events share messages, that a lane ends with the status its own
``Converse`` call would have had while the others go on, that a barge-in on one lane leaves no
cancelled audio on it, that the stream's bounds hold, and that a dropped stream leaves its
sessions to be resumed (on a ``Converse`` call, or a lane of another stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest

from benchmarks import loadgen
from duplex.audio import PCM16K_MONO
from duplex.v1 import session_pb2, session_pb2_grpc
from session_service.api import calls, lanes
from tests.session_helpers import (
    Conversation,
    InProcessStack,
    LaneCall,
    open_event,
    sample,
    similarity,
    speech,
    to_16k,
    utterance_pcm,
)
from tests.test_session_auth import ALICE_TOKEN, CAROL_TOKEN, Principals, bearer, service, write_tokens
from tests.test_session_stack import best_expected, out_format, worker_input

pytestmark = pytest.mark.stack(n_workers=2, runner={"idle_timeout_s": 20})

CLOSE = session_pb2.ClientEvent(close=session_pb2.SessionClose())
FRAME = PCM16K_MONO.bytes_for_ms(32)


def _reply_pcm(events: list[session_pb2.ServerEvent]) -> tuple[session_pb2.ResponseDone, bytes]:
    done = next(e.response_done for e in events if e.WhichOneof("event") == "response_done")
    pcm = b"".join(
        e.audio_delta.pcm
        for e in events
        if e.WhichOneof("event") == "audio_delta" and e.audio_delta.response_id == done.response_id
    )
    return done, pcm


async def _stream_lanes(
    call: LaneCall, pcms: dict[str, bytes], *, chunk_ms: int = 32, speedup: float = 4.0
) -> None:
    """Append every lane's audio, one chunk of each lane per message, faster than real time."""
    step = PCM16K_MONO.bytes_for_ms(chunk_ms)
    longest = max(len(p) for p in pcms.values())
    for i in range(0, longest, step):
        call.send(*(call.append_event(lane, pcm[i : i + step]) for lane, pcm in pcms.items() if i < len(pcm)))
        await asyncio.sleep(chunk_ms / 1000 / speedup)


@pytest.mark.stack(clock_speed=4.0)  # replies paced by silence continuation at 4x (content is checked)
async def test_lanes_each_get_only_their_own_reply_and_share_messages(stack: InProcessStack) -> None:
    names = ["a", "b", "c", "lane/with spaces"]
    voices = {name: speech(i) for i, name in enumerate(names)}
    solo_voice = speech(len(names))
    lanes_before = sample("duplex_session_lanes")
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        call.send(*((name, open_event()) for name in names))
        solo = Conversation(ch).start(open_event())
        opened = [await call.wait_kind(name, "opened") for name in names]
        assert sample("duplex_session_lanes") == lanes_before + len(names)
        await solo.wait_kind("opened")
        assert len({o.opened.session_id for o in opened}) == len(names)
        pcms = {name: utterance_pcm(v, PCM16K_MONO) for name, v in voices.items()}
        await asyncio.gather(
            _stream_lanes(call, pcms), solo.stream(utterance_pcm(solo_voice, PCM16K_MONO), PCM16K_MONO)
        )
        for name in names:
            await call.wait_kind(name, "response_done", within=30)
        await solo.wait_kind("response_done", within=30)
        call.send(("a", CLOSE))  # one lane closes: it ends OK, the others go on
        assert (await call.wait_ended("a")).status == 0
        assert call.of("a", "closed")[-1].closed.reason == "client_close"
        assert "b" not in call.ended
        call.half_close()  # the rest close with the stream
        await call.wait_done(within=10)
        solo.send(CLOSE)
        await solo.wait_done()

    assert call.status == grpc.StatusCode.OK
    assert sample("duplex_session_lanes") == lanes_before
    assert call.events.get("", []) == []
    for name in names:
        assert [e.status for e in call.ended[name]] == [0]
        assert call.order.index((name, "closed")) < call.order.index((name, "ended"))
    # Several lanes' events share messages (how many depends on timing: about 0.55 messages per
    # event here; one event per message would be 1.0).
    total = sum(len(v) for v in call.events.values())
    assert call.batches < 0.8 * total, (call.batches, total)

    got = {name: to_16k(_reply_pcm(call.events[name])[1], out_format(PCM16K_MONO)) for name in names}
    got["solo"] = to_16k(_reply_pcm(solo.events)[1], out_format(PCM16K_MONO))
    voices["solo"] = solo_voice
    events = dict(call.events) | {"solo": solo.events}
    expected = {}
    for name, v in voices.items():
        committed = next(e.committed for e in events[name] if e.WhichOneof("event") == "committed")
        n = round(committed.audio_ms * 16 / 512) * 512
        heard = worker_input(utterance_pcm(v, PCM16K_MONO), PCM16K_MONO)
        expected[name] = best_expected(n, got[name], heard, out_format(PCM16K_MONO))
    for name in voices:
        done, _ = _reply_pcm(events[name])
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, (name, done)
        scores = {other: similarity(got[name], e) for other, e in expected.items()}
        own = scores.pop(name)
        assert own > 0.8 and own > max(scores.values()) + 0.4, (name, own, scores)
        session_id = next(e.opened.session_id for e in events[name] if e.WhichOneof("event") == "opened")
        ids = {e.audio_delta.response_id for e in events[name] if e.WhichOneof("event") == "audio_delta"}
        assert ids == {done.response_id}, (name, session_id, ids)


def _events_in(kind: str) -> float:
    return sample("duplex_session_events_total", {"direction": "in", "type": kind})


async def test_a_lane_ends_with_its_own_status_while_the_others_go_on(stack: InProcessStack) -> None:
    appends_before, opens_before = _events_in("append"), _events_in("open")
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        ok = open_event()
        ok.open.acks_on_output = False
        # The open and the lane's first appends in one message: they wait for the open, in order.
        call.send(("ok", ok), call.append_event("ok", bytes(FRAME)), call.append_event("ok", bytes(FRAME)))
        call.send(("bad", open_event(model="no-such-model")))
        bad = await call.wait_ended("bad")
        assert (bad.status, bad.code, bad.retryable) == (
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            "model_mismatch",
            False,
        )
        ack = await call.wait_kind("ok", "input_ack")
        await call.wait_until(lambda: call.of("ok", "input_ack")[-1].input_ack.seq == 2, what="ack of seq 2")
        assert ack.input_ack.epoch == 1
        # An event for a lane that is not open: answered on that lane, nothing else happens.
        call.send(call.append_event("ghost", bytes(FRAME)))
        ghost = await call.wait_kind("ghost", "error")
        assert ghost.error.code == "session_not_open"
        assert "ghost" not in call.ended
        # A name that cannot be a lane: an error about the stream (lane "").
        for name in ("", "x" * 65, "new\nline", "é"):
            call.send((name, open_event()))
        await call.wait_until(lambda: len(call.events.get("", [])) == 4, what="4 stream errors")
        assert {e.error.code for e in call.events[""]} == {"invalid_event"}
        # A bad event of an open lane is an error event on it, and the lane goes on.
        call.send(call.append_event("ok", b"\x00"))  # half a sample
        err = await call.wait_kind("ok", "error")
        assert err.error.code == "invalid_pcm_length"
        call.send(call.append_event("ok", bytes(FRAME)))
        await call.wait_until(lambda: call.of("ok", "input_ack")[-1].input_ack.seq == 4, what="ack of seq 4")
        # A name whose lane ended is free again.
        call.send(("bad", open_event()))
        await call.wait_kind("bad", "opened")
        call.send(("ok", CLOSE), ("bad", CLOSE))
        await call.wait_until(lambda: len(call.ended.get("ok", [])) == 1 and len(call.ended["bad"]) == 2)
        call.half_close()
        await call.wait_done()
    assert call.status == grpc.StatusCode.OK
    assert [e.status for e in call.ended["bad"]] == [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    assert len(stack.session.manager) == 0
    # Every client event is counted once, whether a runner took it or the stream answered it:
    # five appends (one refused on "ghost"), three opens (the unusable names are not events).
    assert (_events_in("append") - appends_before, _events_in("open") - opens_before) == (5, 3)


async def test_a_stream_that_never_opens_a_lane_is_ended(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        for i in range(calls.MAX_REFUSED_BEFORE_OPEN + 1):
            call.send(call.append_event(f"l{i}", bytes(FRAME)))
        await call.wait_done()
    assert call.status == grpc.StatusCode.INVALID_ARGUMENT
    assert call.error is not None and call.error.code == "session_not_open"
    # Refused events are answered (the last ones may be cut short by the end of the call).
    assert 0 < len(call.events) <= calls.MAX_REFUSED_BEFORE_OPEN
    assert all(e.error.code == "session_not_open" for evs in call.events.values() for e in evs)


async def test_a_stream_holds_at_most_max_lanes(
    stack: InProcessStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lanes, "MAX_LANES", 2)
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        call.send(("a", open_event()), ("b", open_event()), ("c", open_event()))
        c = await call.wait_ended("c")
        assert (c.status, c.code) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "capacity_exhausted")
        await call.wait_kind("a", "opened")
        await call.wait_kind("b", "opened")
        assert len(stack.session.manager) == 2
        call.send(("a", CLOSE))
        await call.wait_ended("a")
        call.send(("c", open_event()))
        await call.wait_kind("c", "opened")
        call.cancel()
        await call.wait_done()


@pytest.mark.stack(clock_speed=4.0)  # the reply is paced by silence continuation: at 4x
async def test_barge_in_on_one_lane_leaves_no_cancelled_audio_on_it(stack: InProcessStack) -> None:
    voice = utterance_pcm(speech(1), PCM16K_MONO, tail_s=1.8)
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        call.send(("talker", open_event(extra_body={"silence_ms": 1500})), ("other", open_event()))
        await call.wait_kind("talker", "opened")
        await call.wait_kind("other", "opened")
        await _stream_lanes(call, {"talker": voice, "other": voice}, speedup=16)
        await call.wait_kind("talker", "audio_delta", within=30)
        call.send(("talker", session_pb2.ClientEvent(event_id="barge", barge_in=session_pb2.BargeIn())))
        cancelled = (await call.wait_kind("talker", "audio_cancelled")).audio_cancelled
        await call.wait_kind("other", "response_done", within=30)
        # A further turn on the talker, in the new epoch (seq restarts), to let anything of the
        # cancelled epoch that was in flight arrive.
        call.seq["talker"] = 0
        await _stream_lanes(call, {"talker": voice}, speedup=16)
        await call.wait_kind("talker", "response_done", within=30, count=2)
        call.half_close()
        await call.wait_done()
    talker = call.events["talker"]
    i = next(k for k, e in enumerate(talker) if e.HasField("audio_cancelled"))
    stale = [
        e
        for e in talker[i + 1 :]
        if e.HasField("audio_delta") and e.audio_delta.epoch <= cancelled.cancelled_epoch
    ]
    assert stale == []
    assert [e.response_done.status for e in call.of("talker", "response_done")] == [
        session_pb2.RESPONSE_STATUS_CANCELLED,
        session_pb2.RESPONSE_STATUS_COMPLETED,
    ]
    # The other lane's turn was not touched.
    assert call.of("other", "audio_cancelled") == []
    assert call.of("other", "response_done")[0].response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED


async def test_a_dropped_stream_leaves_its_sessions_to_resume(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        lanes_before = sample("duplex_session_lanes")
        first = LaneCall(ch).start()
        first.send(("x", open_event()), ("y", open_event()))
        x = (await first.wait_kind("x", "opened")).opened
        y = (await first.wait_kind("y", "opened")).opened
        first.cancel()
        await first.wait_done()
        async with asyncio.timeout(5):
            while sample("duplex_session_lanes") != lanes_before:  # noqa: ASYNC110  (the server sees the cancel)
                await asyncio.sleep(0.02)
        # One resumes on a Converse call, the other on a lane of another stream.
        conv = Conversation(ch).start(
            session_pb2.ClientEvent(
                resume=session_pb2.SessionResume(session_id=x.session_id, resume_token=x.resume_token)
            )
        )
        assert (await conv.wait_kind("opened")).opened.session_id == x.session_id
        second = LaneCall(ch).start()
        resume_y = session_pb2.SessionResume(session_id=y.session_id, resume_token=y.resume_token)
        second.send(("again", session_pb2.ClientEvent(resume=resume_y)))
        assert (await second.wait_kind("again", "opened")).opened.session_id == y.session_id
        # Resumed once more elsewhere: the lane is told so, and ends OK (it was displaced).
        third = LaneCall(ch).start()
        third.send(("z", session_pb2.ClientEvent(resume=resume_y)))
        await third.wait_kind("z", "opened")
        assert (await second.wait_ended("again")).status == 0
        assert second.of("again", "closed")[-1].closed.reason == "resumed_elsewhere"
        third.send(("z", CLOSE))
        await third.wait_ended("z")
        conv.send(CLOSE)
        await conv.wait_done()
        for c in (second, third):
            c.half_close()
            await c.wait_done()
    assert len(stack.session.manager) == 0


#: An ``update`` answered with ``updated{config}``, these 4 KB instructions in it.
BIG_UPDATE = session_pb2.ClientEvent(
    update=session_pb2.SessionUpdate(config=session_pb2.SessionConfig(instructions="x" * 4000))
)
#: An event for a lane that is not open: answered ``session_not_open``, its id echoed (at most
#: 256 characters of it are).
GHOST = session_pb2.ClientEvent(event_id="x" * 256)


async def _flood_unread(stack: InProcessStack, opened: list[str], junk_lanes: list[str]) -> None:
    """Open ``opened`` lanes on one stream, then send ``junk_lanes`` events, never reading: an
    open lane ``update``s, each answered with a 4 KB ``updated`` (5.8 MB: more than a session's
    4 MiB queue), a lane not open events each answered ``session_not_open`` (more than the
    stream's 1 MiB of answers); return once the stream is cut off (counted once) and every
    session it held is gone (closed, or released after the detached grace)."""
    cut_before = sample("duplex_session_errors_total", {"code": "slow_consumer"})
    options = [("grpc.http2.bdp_probe", 0)]  # else the client grows its window and buffers it all
    async with grpc.aio.insecure_channel(stack.target, options=options) as ch:
        call = session_pb2_grpc.DuplexSessionStub(ch).ConverseMany(timeout=30)
        first = session_pb2.ClientBatch()
        for lane in opened:
            first.events.add(lane=lane, event=open_event())
        await call.write(first)
        junk = session_pb2.ClientBatch()
        while junk.ByteSize() < 240_000:  # a message stays under the service's receive limit
            lane = junk_lanes[len(junk.events) % len(junk_lanes)]
            junk.events.add(lane=lane, event=BIG_UPDATE if lane in opened else GHOST)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            for _ in range(24):  # 5.8 MB: more than a session's queue or the stream's answers
                await asyncio.wait_for(call.write(junk), 5)  # (the cut may stop the reading first)
        async with asyncio.timeout(10):
            while (  # noqa: ASYNC110  (two conditions kept by other components)
                len(stack.session.manager)
                or sample("duplex_session_errors_total", {"code": "slow_consumer"}) == cut_before
            ):
                await asyncio.sleep(0.05)
        call.cancel()
    assert sample("duplex_session_errors_total", {"code": "slow_consumer"}) == cut_before + 1


@pytest.mark.stack(runner={"detached_grace_s": 0.5})
async def test_a_stream_whose_client_stops_reading_is_cut_off(stack: InProcessStack) -> None:
    """4 KB ``updated`` answers in an open lane, never read: the transport takes its 64 KiB
    window, the rest piles up in the session's queue until it overflows. The stream is cut
    off, though its last message cannot be sent: the noisy session is closed, the quiet one let
    go (it is released after the detached grace)."""
    await _flood_unread(stack, ["noisy", "quiet"], ["noisy"])


async def test_an_error_on_a_lane_echoes_at_most_256_characters_of_an_event_id(
    stack: InProcessStack,
) -> None:
    """Issue 25: the ``event_id`` an error echoes is bounded on lanes too: an event for a lane
    that is not open, one for a name that cannot be a lane, one in an open lane's session."""
    long_id = "".join(chr(ord("a") + i % 26) for i in range(100_000))
    junk = session_pb2.ClientEvent(event_id=long_id)
    async with grpc.aio.insecure_channel(stack.target) as ch:
        call = LaneCall(ch).start()
        call.send(("a", open_event()))
        await call.wait_kind("a", "opened")
        call.send(("ghost", junk), ("bad\n", junk), ("a", junk))
        for lane in ("ghost", "", "a"):
            await call.wait_kind(lane, "error")
        call.half_close()
        await call.wait_done()
    errors = [call.of(lane, "error")[0].error for lane in ("ghost", "", "a")]
    assert [e.code for e in errors] == ["session_not_open", "invalid_event", "invalid_event"]
    assert [len(e.event_id) for e in errors] == [256, 256, 256]  # (not the 100 KB in a failure)
    assert [e.event_id for e in errors] == [long_id[:256]] * 3


async def test_lanes_are_authenticated_and_belong_to_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice", CAROL_TOKEN: "carol"})
    async with service(auth_tokens=tokens) as stack, grpc.aio.insecure_channel(stack.target) as ch:
        seen = Principals(stack.session, monkeypatch)
        for metadata in ([], bearer("wrong-token")):
            refused = LaneCall(ch, metadata=metadata).start()
            refused.send(("a", open_event()))
            await refused.wait_done()
            assert refused.status == grpc.StatusCode.UNAUTHENTICATED
            assert refused.error is not None and refused.error.code == "unauthenticated"
        assert seen.seen == [] and len(stack.session.manager) == 0
        alice = LaneCall(ch, metadata=bearer(ALICE_TOKEN)).start()
        alice.send(("a", open_event()))
        opened = (await alice.wait_kind("a", "opened")).opened
        # Another caller cannot take alice's session over with its token, on a lane of its own.
        carol = LaneCall(ch, metadata=bearer(CAROL_TOKEN)).start()
        resume = session_pb2.SessionResume(session_id=opened.session_id, resume_token=opened.resume_token)
        carol.send(("mine", session_pb2.ClientEvent(resume=resume)))
        refused_resume = await carol.wait_ended("mine")
        assert (refused_resume.status, refused_resume.code) == (
            grpc.StatusCode.PERMISSION_DENIED.value[0],
            "not_session_owner",
        )
        assert "a" not in alice.ended  # alice's lane goes on
        assert seen.seen == [("open", "alice"), ("resume", "carol")]
        for c in (alice, carol):
            c.half_close()
            await c.wait_done()
        assert alice.status == carol.status == grpc.StatusCode.OK


async def test_the_load_generator_holds_its_sessions_as_lanes(stack: InProcessStack) -> None:
    """``benchmarks.loadgen --lanes`` (what ``tiers --compare-lanes`` measures): its sessions on
    one stream, every flush one message with the events of every session then due, each
    session's acks and replies its own."""
    args = loadgen.parser().parse_args(
        [
            *("--target", stack.target, "--sessions", "4", "--mode", "duplex", "--append-ms", "32"),
            *("--cycle", "8", "--lanes", "--flush-ms", "16", "--out", "unused"),
        ]
    )
    args.total = args.sessions
    gen = loadgen.Generator(args)
    async with grpc.aio.insecure_channel(stack.target) as ch:
        await gen.open_all(session_pb2_grpc.DuplexSessionStub(ch))
        call = gen.lane_call
        sizes: list[int] = []
        write = call.write

        async def counting(batch: session_pb2.ClientBatch) -> None:
            sizes.append(len({e.lane for e in batch.events}))
            await write(batch)

        call.write = counting
        t0 = time.monotonic() + 0.1
        await gen.run(loadgen.Window(start=t0, a=t0 + 0.5, b=t0 + 2.5, end=t0 + 3.0))
    result = gen.result()
    assert result["failed_sessions"] == 0 and result["errors"] == {}, result["failures"]
    assert all(s["sent"] > 0 and s["acked"] >= s["sent"] - 2 for s in result["per_session"]), result[
        "per_session"
    ]
    assert result["reply_frames"] > 0 and result["answered"] > 0
    # Four sessions staggered over 32 ms, flushed every 16 ms: two sessions' events per message,
    # more when a flush is late and the next one's are due too (so a mean, not a count of twos:
    # on a loaded machine late flushes are many), and all four only if they were not staggered.
    assert len(sizes) > 30 and 1.5 < sum(sizes) / len(sizes) < 3.5, sizes[:20]
    assert len(stack.session.manager) == 0  # the half-close closed every lane's session


def test_a_server_message_is_cut_near_max_message_bytes_keeping_order() -> None:
    audio = [
        (
            f"l{i % 3}",
            session_pb2.ServerEvent(
                event_id=f"se_{i}", audio_delta=session_pb2.AudioDelta(pcm=bytes(300_000))
            ),
        )
        for i in range(10)
    ]
    big = (
        "l0",
        session_pb2.ServerEvent(event_id="big", audio_delta=session_pb2.AudioDelta(pcm=bytes(1_500_000))),
    )
    end = ("l1", session_pb2.LaneEnded(status=0))
    pairs: list[tuple[str, session_pb2.ServerEvent | session_pb2.LaneEnded]] = [
        *audio[:5],
        big,
        *audio[5:],
        end,
    ]
    cut = list(lanes._batches([(lane, e, e.ByteSize()) for lane, e in pairs]))
    assert [n for _, n in cut] == [3, 5, 6, 9, 12]  # how many items the messages so far hold
    batches = [b for b, _ in cut]
    assert all(b.ByteSize() <= lanes.MAX_MESSAGE_BYTES for b in batches if len(b.outputs) > 1)
    assert [len(b.outputs) for b in batches] == [3, 2, 1, 3, 3]  # the big one alone
    got = [(o.lane, o.event.event_id if o.HasField("event") else "ended") for b in batches for o in b.outputs]
    assert got == [
        (lane, e.event_id if isinstance(e, session_pb2.ServerEvent) else "ended") for lane, e in pairs
    ]


@pytest.mark.stack(runner={"detached_grace_s": 0.5})
async def test_answers_a_client_does_not_read_are_bounded(stack: InProcessStack) -> None:
    """Events for lanes never opened, each answered ``session_not_open`` (its 256-character id
    echoed), never read: the answers are bounded like a session's queue, and the stream is cut
    off."""
    await _flood_unread(stack, ["open"], [f"ghost{i}" for i in range(5)])
