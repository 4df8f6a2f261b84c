"""The per-session outbound queue: FIFO, bounded, purged by epoch, re-checked on the way out."""

from __future__ import annotations

import asyncio

import pytest

from duplex.v1 import session_pb2
from session_service.session.ack_window import Ack
from session_service.session.emitter import Emitter
from session_service.session.outbound import Outbound
from tests.fakes import ManualClock


def _audio(epoch: int, n: int = 10) -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(audio_delta=session_pb2.AudioDelta(epoch=epoch, pcm=b"\x00" * n))


def _kind(ev: session_pb2.ServerEvent | None) -> str:
    return ev.WhichOneof("event") or "" if ev is not None else "none"


#: The last event a stream gets once another stream resumed its session.
_RESUMED_ELSEWHERE = session_pb2.ServerEvent(closed=session_pb2.SessionClosed(reason="resumed_elsewhere"))


class _Epoch:
    """The session's epoch as a queue reads it (a barge-in moves it on)."""

    def __init__(self) -> None:
        self.value = 1

    def __call__(self) -> int:
        return self.value


def _resumed_then_barged_in(out: Outbound, epoch: _Epoch) -> int:
    """A resume attaches a new stream (the displaced one gets ``resumed_elsewhere`` as its last
    event) and its client barges in: epoch 1 -> 2, ``audio_cancelled`` queued. The new
    stream's attachment."""
    new = out.attach(farewell=_RESUMED_ELSEWHERE)
    epoch.value = 2
    out.put(session_pb2.ServerEvent(audio_cancelled=session_pb2.AudioCancelled(cancelled_epoch=1, epoch=2)))
    return new


async def test_the_consumer_never_sees_audio_of_an_epoch_the_session_left() -> None:
    epoch = 1
    out = Outbound(lambda: epoch)
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    out.put(_audio(1), epoch=1)
    att = out.attach()
    assert _kind(await out.get(att)) == "committed"
    assert _kind(await out.get(att)) == "audio_delta"
    out.put(_audio(1), epoch=1)
    out.put(session_pb2.ServerEvent(closed=session_pb2.SessionClosed()))
    # The epoch moves without a purge (a cancel purges too, but the exit re-checks regardless).
    epoch = 2
    assert len(out) == 2
    assert _kind(await out.get(att)) == "closed"
    assert len(out) == 0


async def test_purge_drops_only_older_epoch_bound_output() -> None:
    out = Outbound(lambda: 2)
    out.put(_audio(1), epoch=1)
    out.put(session_pb2.ServerEvent(input_ack=session_pb2.InputAudioAck(seq=1, epoch=1)))
    out.put(_audio(2), epoch=2)
    assert out.purge_before(2) == 1
    assert [_kind(out.get_nowait()) for _ in range(3)] == ["input_ack", "audio_delta", "none"]


async def test_a_new_attachment_ends_the_previous_consumer() -> None:
    out = Outbound(lambda: 1)
    first = out.attach()
    waiting = asyncio.create_task(out.get(first))
    await asyncio.sleep(0)
    second = out.attach()
    assert await asyncio.wait_for(waiting, 1) is None
    out.put(session_pb2.ServerEvent(closed=session_pb2.SessionClosed()))
    assert _kind(await out.get(second)) == "closed"


async def test_put_front_goes_first_and_close_ends_after_what_is_queued() -> None:
    out = Outbound(lambda: 1)
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    out.put_front(session_pb2.ServerEvent(opened=session_pb2.SessionOpened()))
    out.close()
    att = out.attach()
    assert [_kind(await out.get(att)) for _ in range(3)] == ["opened", "committed", "none"]


def test_limits_by_count_and_by_bytes() -> None:
    by_count = Outbound(lambda: 1, limit=3)
    for _ in range(3):
        by_count.put(_audio(1), epoch=1)
    assert not by_count.overflowed
    by_count.put(_audio(1), epoch=1)
    assert by_count.overflowed and len(by_count) == 3  # a state the shell checks; nothing more queued
    by_bytes = Outbound(lambda: 1, limit_bytes=1000)
    by_bytes.put(_audio(1, 600), epoch=1)
    assert not by_bytes.overflowed
    by_bytes.put(_audio(1, 600), epoch=1)
    assert by_bytes.overflowed and len(by_bytes) == 1


async def test_a_resumed_stream_takes_nothing_until_the_displaced_one_finished_its_write() -> None:
    """The displaced stream took an audio event and is writing it when a resume attaches a new
    stream, whose client barges in: the new stream's ``audio_cancelled`` must not go out before
    that write is done (else old audio would follow it on the old stream)."""
    epoch = _Epoch()
    out = Outbound(epoch)
    out.put(_audio(1), epoch=1)
    old = out.attach()
    assert _kind(await out.get(old)) == "audio_delta"  # ... and now being written
    new = _resumed_then_barged_in(out, epoch)
    taken = asyncio.ensure_future(out.get(new))
    await asyncio.sleep(0.05)
    assert not taken.done(), "the new stream took an event while the old one was still writing"
    # The old stream's write is done: it asks for its next event and gets the farewell.
    assert _kind(await out.get(old)) == "closed"
    assert _kind(await asyncio.wait_for(taken, 1)) == "audio_cancelled"
    assert await out.get(old) is None


async def _displaced_while_writing(out: Outbound) -> tuple[int, list[int]]:
    """A stream takes an audio event (its client stopped reading: the write never finishes) and
    is displaced; a ``committed`` waits behind. The new stream's attachment, and the list the
    stuck stream's cut-off appends to."""
    cut: list[int] = []
    out.put(_audio(1), epoch=1)
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    old = out.attach(cut_off=lambda: cut.append(1))
    assert _kind(await out.get(old)) == "audio_delta"
    return out.attach(), cut


async def test_a_displaced_stream_stuck_in_a_write_is_cut_off_and_ending_releases_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("session_service.session.outbound.HANDOVER_TIMEOUT_S", 0.05)
    out = Outbound(lambda: 1)
    new, cut = await _displaced_while_writing(out)
    # Its client stopped reading: the write never finishes. The new stream goes on after the
    # timeout, and the stuck stream's call is cut off.
    assert _kind(await asyncio.wait_for(out.get(new), 1)) == "committed"
    assert cut == [1]
    # A displaced stream that simply ends (detached) lets the next one go at once.
    out.put(_audio(1), epoch=1)
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    assert _kind(await out.get(new)) == "audio_delta"
    newer = out.attach()
    out.detached(new)
    assert _kind(await asyncio.wait_for(out.get(newer), 0.02)) == "committed"


def _ack(seq: int, epoch: int) -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(input_ack=session_pb2.InputAudioAck(seq=seq, epoch=epoch))


async def test_an_ack_folds_only_into_a_queued_ack_of_its_epoch_at_the_tail() -> None:
    out = Outbound(lambda: 2)
    assert not out.merge_ack(1, 1)  # nothing queued
    out.put(_ack(1, 1))
    assert out.merge_ack(3, 1)  # cumulative: the queued ack now says 3
    assert not out.merge_ack(2, 1)  # never backwards
    assert not out.merge_ack(1, 2)  # another epoch: its own ack
    out.put(_ack(1, 2))
    out.put(_audio(2), epoch=2)
    assert not out.merge_ack(2, 2)  # an ack never moves ahead of what was queued after it
    taken = [out.get_nowait() for _ in range(4)]
    assert [(e.input_ack.seq, e.input_ack.epoch) for e in taken[:2] if e is not None] == [(3, 1), (1, 2)]
    assert [_kind(e) for e in taken[2:]] == ["audio_delta", "none"]
    assert not out.merge_ack(3, 2)  # taken already (being written): a new one


async def test_the_emitter_numbers_a_folded_ack_once_and_every_event_stays_consecutive() -> None:
    out = Outbound(lambda: 1)
    em = Emitter(out, ManualClock())
    em.acks([Ack(1, 1, (0.0,))])
    em.acks([Ack(2, 1, (0.0,))])  # the client has not read the first: folded
    em.emit("committed", session_pb2.InputCommitted())
    em.acks([Ack(3, 1, (0.0,))])
    got = [out.get_nowait() for _ in range(3)]
    assert [(e.event_id, _kind(e)) for e in got if e is not None] == [
        ("se_1", "input_ack"),
        ("se_2", "committed"),
        ("se_3", "input_ack"),
    ]
    assert [e.input_ack.seq for e in got if e is not None and e.HasField("input_ack")] == [2, 3]
    plain = Outbound(lambda: 1)
    per_append = Emitter(plain, ManualClock(), coalesce_acks=False)
    per_append.acks([Ack(1, 1, (0.0,))])
    per_append.acks([Ack(2, 1, (0.0,))])
    assert [e.input_ack.seq for e in (plain.get_nowait(), plain.get_nowait()) if e is not None] == [1, 2]


# ---- a stream that takes without waiting (ConverseMany's writer) ------------------------------


async def test_take_tells_its_listener_and_keeps_get_s_rules() -> None:
    """A listener is told of everything a ``take`` may find; a take stops at its limit, an
    epoch the session left is dropped on the way out, and a closed, drained queue ends."""
    epoch = 1
    out = Outbound(lambda: epoch)
    att = out.attach()
    told: list[int] = []
    out.listen(att, lambda: told.append(1))
    out.put(_audio(1), epoch=1)
    out.put(_audio(1), epoch=1)
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    assert len(told) == 3
    events, ends = out.take(att, 2)
    assert [_kind(e) for e, _ in events] == ["audio_delta", "audio_delta"] and not ends
    assert [size for _, size in events] == [e.ByteSize() for e, _ in events]  # as queued: not sized again
    out.wrote(att)
    out.put(_audio(1), epoch=1)
    epoch = 2  # left without a purge: the exit check drops it
    out.close()
    events, ends = out.take(att, 10)
    assert [_kind(e) for e, _ in events] == ["committed"] and ends
    out.detached(att)
    before = len(told)
    out.put_front(session_pb2.ServerEvent(opened=session_pb2.SessionOpened()))
    assert len(told) == before  # a detached stream hears nothing more


async def test_a_taking_stream_resumed_elsewhere_waits_for_the_displaced_one_s_write() -> None:
    """The handover between the two kinds of stream, both ways: a ``get`` stream waits until a
    displaced taking stream says it wrote what it took, and a taking stream takes nothing until
    a displaced ``get`` stream asks again (its listener is told when it does)."""
    epoch = _Epoch()
    out = Outbound(epoch)
    out.put(_audio(1), epoch=1)
    taker = out.attach()
    events, _ = out.take(taker, 10)
    assert len(events) == 1  # ... and now being written
    getter = _resumed_then_barged_in(out, epoch)
    got = asyncio.ensure_future(out.get(getter))
    await asyncio.sleep(0.05)
    assert not got.done(), "the new stream took an event while the displaced one was still writing"
    out.wrote(taker)
    assert _kind(await asyncio.wait_for(got, 1)) == "audio_cancelled"
    events, ends = out.take(taker, 10)
    assert [_kind(e) for e, _ in events] == ["closed"] and ends  # its farewell, then it ends
    out.detached(taker)

    # And back: the get stream is writing what it took when a taking stream resumes.
    out.put(_audio(2), epoch=2)
    assert _kind(await out.get(getter)) == "audio_delta"
    told: list[int] = []
    taker2 = out.attach(farewell=_RESUMED_ELSEWHERE)
    out.listen(taker2, lambda: told.append(1))
    out.put(session_pb2.ServerEvent(committed=session_pb2.InputCommitted()))
    assert out.take(taker2, 10) == ([], False)
    told.clear()
    assert _kind(await out.get(getter)) == "closed"  # it asks again: its write is done
    assert told, "the taking stream was not told that it may go"
    events, _ = out.take(taker2, 10)
    assert [_kind(e) for e, _ in events] == ["committed"]


async def test_a_displaced_stream_stuck_in_a_write_is_cut_off_for_a_taking_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("session_service.session.outbound.HANDOVER_TIMEOUT_S", 0.05)
    out = Outbound(lambda: 1)
    new, cut = await _displaced_while_writing(out)
    ready = asyncio.Event()
    out.listen(new, ready.set)
    ready.clear()
    assert out.take(new, 10) == ([], False)
    await asyncio.wait_for(ready.wait(), 1)  # told once the stuck stream is cut off
    assert cut == [1]
    events, _ = out.take(new, 10)
    assert [_kind(e) for e, _ in events] == ["committed"]
