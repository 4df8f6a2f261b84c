"""A turn survives its worker, in process with fake links (no processes).

- ``ReplayLog`` (``session_service.session.replay``): what it keeps of a session's input, where commit
  markers go, what an answered response, a CLEAR, a new epoch and the bound drop, and how a
  replay is planned (merged APPENDs, ``replay`` flags, explicit COMMITs in place).
- ``SessionRunner``: a worker lost mid-response ends the response ``failed/worker_unavailable``
  and restarts it for the same turn on another worker after replaying the turn's input there;
  what the client sees, what the new worker gets and in which order; a cancel before the
  restart, no worker at all, and ``turn_failover=False``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from duplex.errors import ErrorCode, UnavailableError
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.session.replay import Chunk, Marker, ReplayAppend, ReplayLog
from session_service.session.runner import RECOVER_DELAYS_S, SessionRunner, WorkerHandle
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain, unit_runner

SID = "sess_replay"
FRAME = b"\x10\x00" * 512  # one worker frame (512 samples of 16 kHz s16le)
APPEND = worker_pb2.SUBMISSION_KIND_APPEND
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
FAILED = session_pb2.RESPONSE_STATUS_FAILED
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
PITCH = -3.0


def frames(tag: int, n: int = 1) -> bytes:
    """``n`` worker frames that say which chunk they are (``tag``)."""
    return bytes([tag, 0]) * 512 * n


def items(log: ReplayLog) -> list[str]:
    """The log, readably: ``c<seq>@<epoch>[r][c]`` for chunks (reported, consumed), ``M``/``m``
    for explicit/turn-detection markers."""
    out = []
    for item in log:
        if isinstance(item, Marker):
            out.append("M" if item.explicit else "m")
        else:
            flags = ("r" if item.reported else "") + ("c" if item.consumed else "")
            out.append(f"c{item.seq}@{item.epoch}{flags}")
    return out


def plan_view(plan: Sequence[ReplayAppend | Marker]) -> list[tuple[str, bool, int]]:
    """(kind, replay, frames) of each step of a plan."""
    out = []
    for step in plan:
        if isinstance(step, Marker):
            out.append(("COMMIT", False, 0))
        else:
            assert step.size == len(step.frames)
            out.append(("APPEND", step.replay, step.size // len(FRAME)))
    return out


# ---- ReplayLog ---------------------------------------------------------------------------------


def test_consumed_marks_only_that_epochs_chunks_up_to_the_seq() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    for seq in (1, 2, 3):
        log.appended(frames(seq), epoch=1, seq=seq)
    log.appended(b"", epoch=1, seq=4)  # nothing handed on: nothing kept
    log.consumed(epoch=2, seq=3)  # another epoch's report says nothing of these
    assert items(log) == ["c1@1", "c2@1", "c3@1"]
    log.consumed(epoch=1, seq=2)
    assert items(log) == ["c1@1rc", "c2@1rc", "c3@1"]
    log.consumed(epoch=1, seq=3)
    assert items(log) == ["c1@1rc", "c2@1rc", "c3@1rc"]
    assert log.size == 3 * len(FRAME) and len(log) == 3


def test_turn_detection_marker_goes_after_the_last_reported_chunk() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    for seq in (1, 2, 3, 4):
        log.appended(frames(seq), epoch=1, seq=seq)
    log.consumed(epoch=1, seq=2)
    auto = log.turn_ended()
    assert not auto.explicit and items(log) == ["c1@1rc", "c2@1rc", "m", "c3@1", "c4@1"]
    explicit = log.committed()
    assert explicit.explicit and items(log)[-1] == "M"
    assert log.last_marker() is explicit
    # Nothing reported at all: the turn end lies before everything kept.
    fresh = ReplayLog(max_bytes=1 << 20)
    fresh.appended(frames(1), epoch=1, seq=1)
    fresh.turn_ended()
    assert items(fresh) == ["m", "c1@1"]


def test_answered_drops_the_input_up_to_its_marker_and_nothing_else() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    log.appended(frames(1), epoch=1, seq=1)
    first = log.committed()
    log.appended(frames(2), epoch=1, seq=2)
    second = log.committed()
    log.appended(frames(3), epoch=1, seq=3)
    log.answered(None)
    log.answered(Marker(explicit=True))  # not in the log (trimmed away, or answered already)
    assert items(log) == ["c1@1", "M", "c2@1", "M", "c3@1"]
    log.answered(first)
    assert items(log) == ["c2@1", "M", "c3@1"] and log.size == 2 * len(FRAME)
    assert log.last_marker() is second
    log.answered(first)  # twice: nothing more goes
    assert items(log) == ["c2@1", "M", "c3@1"]
    log.answered(second)
    assert items(log) == ["c3@1"] and log.size == len(FRAME)
    assert log.last_marker() is None


def test_cleared_drops_only_the_input_after_the_last_marker() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    log.appended(frames(1), epoch=1, seq=1)
    log.committed()
    log.appended(frames(2), epoch=1, seq=2)
    log.appended(frames(3), epoch=1, seq=3)
    log.cleared()
    assert items(log) == ["c1@1", "M"] and log.size == len(FRAME)
    log.cleared()
    assert items(log) == ["c1@1", "M"]


def test_a_cancels_new_epoch_keeps_the_input_under_it() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    for seq in (1, 2, 3):
        log.appended(frames(seq), epoch=1, seq=seq)
    log.consumed(epoch=1, seq=1)
    marker = log.committed()
    log.new_epoch(2)
    log.appended(frames(9), epoch=2, seq=4)
    # The worker keeps the input it had not consumed and takes it under the new epoch, seqs
    # unchanged (``Abort.keep_input``): so does the log, and the worker's report of it counts.
    assert items(log) == ["c1@2rc", "c2@2", "c3@2", "M", "c4@2"] and log.size == 4 * len(FRAME)
    assert log.last_marker() is marker
    log.consumed(epoch=2, seq=3)
    assert items(log) == ["c1@2rc", "c2@2rc", "c3@2rc", "M", "c4@2"]


def test_the_log_is_bounded_in_two_parts_and_says_when_it_was_trimmed() -> None:
    """Committed input (what a response answers) and the input since are bounded apart: a long
    reply fed with silence never pushes out the utterance it answers."""
    log = ReplayLog(max_bytes=3 * len(FRAME))
    log.appended(frames(1), epoch=1, seq=1)
    log.appended(frames(2), epoch=1, seq=2)
    first = log.committed()
    log.appended(frames(3), epoch=1, seq=3)
    log.appended(frames(4), epoch=1, seq=4)
    log.appended(frames(5), epoch=1, seq=5)
    assert not log.trimmed and log.size == 5 * len(FRAME)
    log.appended(frames(6), epoch=1, seq=6)
    # The oldest input since the commit went; the committed input and its marker stay.
    assert log.trimmed and items(log) == ["c1@1", "c2@1", "M", "c4@1", "c5@1", "c6@1"]
    assert log.last_marker() is first and log.size == 5 * len(FRAME)
    for seq in range(7, 50):
        log.appended(frames(seq % 200), epoch=1, seq=seq)
    assert items(log) == ["c1@1", "c2@1", "M", "c47@1", "c48@1", "c49@1"]
    # A commit moves the input since into the committed part, which is then bounded itself.
    second = log.committed()
    log.appended(frames(50), epoch=1, seq=50)
    assert items(log)[-5:] == ["c47@1", "c48@1", "c49@1", "M", "c50@1"]
    assert log.size - len(FRAME) <= 3 * len(FRAME) + 2 * len(FRAME)
    log.answered(second)
    assert items(log) == ["c50@1"] and log.trimmed
    log.answered(log.committed())
    assert len(log) == 0 and log.size == 0 and not log.trimmed


def test_plan_merges_runs_of_one_kind_keeps_explicit_commits_and_skips_turn_ends() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    for seq in (1, 2, 3):
        log.appended(frames(seq), epoch=1, seq=seq)
    log.consumed(epoch=1, seq=3)
    log.turn_ended()  # the model finds it again in the same input: not replayed
    log.appended(frames(4), epoch=1, seq=4)  # reported too, after the turn end
    log.consumed(epoch=1, seq=4)
    log.appended(frames(5), epoch=1, seq=5)
    log.committed()
    log.appended(frames(6, 2), epoch=1, seq=6)
    log.appended(frames(7), epoch=1, seq=7)
    plan = log.plan(max_append_bytes=64 * len(FRAME))
    assert plan_view(plan) == [
        ("APPEND", True, 4),  # 1-4: reported, merged across the turn end
        ("APPEND", False, 1),  # 5: not reported
        ("COMMIT", False, 0),
        ("APPEND", False, 3),  # 6-7
    ]
    first = plan[0]
    assert isinstance(first, ReplayAppend)
    assert first.frames == frames(1) + frames(2) + frames(3) + frames(4)
    # An APPEND holds at most max_append_bytes (a chunk is never split).
    small = log.plan(max_append_bytes=2 * len(FRAME))
    assert plan_view(small) == [
        ("APPEND", True, 2),
        ("APPEND", True, 2),
        ("APPEND", False, 1),
        ("COMMIT", False, 0),
        ("APPEND", False, 2),
        ("APPEND", False, 1),
    ]
    assert ReplayLog(max_bytes=1024).plan(64 * len(FRAME)) == []


def test_a_chunk_reported_by_one_worker_stays_reported_on_the_next() -> None:
    log = ReplayLog(max_bytes=1 << 20)
    for seq in (1, 2, 3):
        log.appended(frames(seq), epoch=1, seq=seq)
    log.consumed(epoch=1, seq=2)
    plan = log.plan(64 * len(FRAME))
    replayed, fresh = plan
    assert isinstance(replayed, ReplayAppend) and isinstance(fresh, ReplayAppend)
    # Written to the next worker (epoch 3) under seqs 1 and 2.
    replayed.handed_on(epoch=3, seq=1)
    fresh.handed_on(epoch=3, seq=2)
    assert items(log) == ["c1@3r", "c1@3r", "c2@3"]  # reported, not yet consumed there
    # That worker is lost too before it reports anything: the news stay reported.
    assert plan_view(log.plan(64 * len(FRAME))) == [("APPEND", True, 2), ("APPEND", False, 1)]
    # Its reports count in its own numbering.
    log.consumed(epoch=1, seq=3)
    assert items(log) == ["c1@3r", "c1@3r", "c2@3"]
    log.consumed(epoch=3, seq=2)
    assert items(log) == ["c1@3rc", "c1@3rc", "c2@3rc"]
    assert all(isinstance(c, Chunk) and c.reported for c in log)


# ---- the runner ---------------------------------------------------------------------------------


class Placer:
    """Places the session on the next of ``links`` (granting ``epochs[i]``, or the asked epoch);
    with no link left, no worker is available."""

    def __init__(self, *links: FakeLink, epochs: Sequence[int | None] = ()) -> None:
        self.links = list(links)
        self.epochs = list(epochs)
        self.calls: list[tuple[str, int, bool]] = []

    async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        self.calls.append((session_id, epoch, takeover))
        if not self.links:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "no healthy worker")
        granted = self.epochs.pop(0) if self.epochs else None
        return self.links.pop(0), granted if granted is not None else epoch


def make_runner(
    link: FakeLink, placer: Placer, *, clock: ManualClock | None = None, **cfg: object
) -> SessionRunner:
    return unit_runner(link, session_id=SID, pitch=PITCH, placer=placer, clock=clock, **cfg)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def kinds(events: Sequence[session_pb2.ServerEvent]) -> list[str]:
    return [e.WhichOneof("event") or "" for e in events]


def append(seq: int, pcm: bytes = FRAME) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(event_id=f"a{seq}", append=session_pb2.InputAudioAppend(seq=seq, pcm=pcm))


COMMIT_EVENT = session_pb2.ClientEvent(event_id="c", commit=session_pb2.InputAudioCommit())
CREATE = session_pb2.ClientEvent(event_id="rc", response_create=session_pb2.ResponseCreate())
BARGE_IN = session_pb2.ClientEvent(event_id="b", barge_in=session_pb2.BargeIn())


def update(epoch: int, turn: int, **kw: object) -> worker_pb2.RequestUpdate:
    return worker_pb2.RequestUpdate(request_id=SID, fence=Fence(SID, epoch, turn).to_proto(), **kw)  # type: ignore[arg-type]


def lose(r: SessionRunner, link: FakeLink) -> None:
    """What the pool does when a link's stream is lost."""
    link.healthy = False
    r.on_worker_lost(link)  # type: ignore[arg-type]


def view(subs: Sequence[worker_pb2.Submission]) -> list[tuple[str, bool, bytes]]:
    """(kind, replay, pcm) of submissions."""
    names = {APPEND: "APPEND", COMMIT: "COMMIT", RESPOND: "RESPOND", CLEAR: "CLEAR"}
    return [(names.get(s.kind, str(s.kind)), s.replay, s.pcm) for s in subs]


def append_seqs(link: FakeLink, *, after: int = 0) -> list[int]:
    """The seqs of a link's APPENDs, checked to run on by one from above ``after`` (a worker's
    numbering of the session's input within an epoch never goes back)."""
    seqs = [s.seq for s in link.subs if s.kind == APPEND]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] > after, seqs
    assert all(s.seq == 0 for s in link.subs if s.kind != APPEND)
    return seqs


async def explicit_turn(r: SessionRunner, link: FakeLink) -> str:
    """Appends 1 and 2 (the worker reports them consumed), an explicit commit, a response for
    turn 1, then append 3 during it (not yet consumed); returns the response id."""
    await r.post(append(1, frames(1)))
    await r.post(append(2, frames(2)))
    await settle()
    r.on_output(None, None, [update(r.epoch, 0, input_seq=2)])
    await r.post(COMMIT_EVENT)
    await r.post(CREATE)
    await settle()
    await r.post(append(3, frames(3)))
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["input_ack", "input_ack", "committed", "response_started", "input_ack"], kinds(evs)
    started = evs[3].response_started
    assert started.turn_id == 1 and started.resume_token
    assert view(link.subs)[-1][0] == "APPEND" and link.subs[-1].fence.turn_id == 1
    return started.response_id


async def test_a_worker_lost_mid_response_replays_the_turn_and_restarts_it() -> None:
    old, new = FakeLink(), FakeLink()
    placer = Placer(new)
    r = make_runner(old, placer)
    try:
        first_id = await explicit_turn(r, old)
        lose(r, old)
        await settle()
        evs = drain(r)
        # The client: the interrupted response failed, then the same turn starts again; no error.
        assert kinds(evs) == ["response_done", "response_started"], evs
        done, started = evs[0].response_done, evs[1].response_started
        assert (done.response_id, done.status, done.reason) == (first_id, FAILED, "worker_unavailable")
        assert done.restarting  # the client waits for the restarted response's own end
        assert done.resume_token
        assert started.turn_id == 1 and started.response_id not in ("", first_id)
        assert started.epoch == 1
        assert placer.calls == [(SID, 1, True)]  # a takeover: whoever holds it there is fenced out
        # The new worker: the input reported consumed (replay, its news not repeated), the
        # explicit commit in its place, the rest as new input, then the restarted response.
        # (A CLEAR first: should the worker still hold input of the session, it is not doubled.)
        assert view(new.subs) == [
            ("CLEAR", False, b""),
            ("APPEND", True, frames(1) + frames(2)),
            ("COMMIT", False, b""),
            ("APPEND", False, frames(3)),
            ("RESPOND", False, b""),
        ]
        assert all(s.fence.epoch == 1 and s.fence.session_id == SID for s in new.subs)
        # Each part under the turn it was first handed on under: the utterance before the
        # response (its speech must not barge in on the restart), append 3 during it.
        assert [s.fence.turn_id for s in new.subs] == [1, 0, 0, 1, 1]
        # Same epoch: the worker seqs go on past what the old worker was given.
        assert len(append_seqs(new, after=append_seqs(old)[-1])) == 2
        # The session's options (the pitch) with the first submission, and only there.
        assert new.subs[0].params["pitch_semitones"] == PITCH
        assert [s.HasField("params") for s in new.subs] == [True, False, False, False, False]
        assert r.response is not None and r.response.response_id == started.response_id

        # The next append continues the new worker's numbering.
        await r.post(append(4, frames(4)))
        await settle()
        assert view(new.subs)[-1] == ("APPEND", False, frames(4))
        assert kinds(drain(r)) == ["input_ack"]
        seqs = append_seqs(new)
        assert len(seqs) == 3

        # The restarted response completes: its input (up to its commit) is no longer kept; the
        # input appended after the commit is.
        r.on_output(None, None, [update(1, 1, input_seq=seqs[-1], response_finished=True)])
        evs = drain(r)
        assert kinds(evs) == ["response_done"]
        assert (evs[0].response_done.status, evs[0].response_done.response_id) == (
            COMPLETED,
            started.response_id,
        )
        assert not evs[0].response_done.restarting
        assert items(r.replay) == [f"c{seqs[1]}@1rc", f"c{seqs[2]}@1rc"]
        assert r.replay.size == 2 * len(FRAME)
    finally:
        r.close("test")
        await r.wait_closed()


async def test_after_a_completed_response_a_loss_replays_only_later_input_and_restarts_nothing() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new))
    try:
        await explicit_turn(r, old)
        r.on_output(None, None, [update(1, 1, input_seq=3, response_finished=True)])
        assert kinds(drain(r)) == ["response_done"]
        assert items(r.replay) == ["c3@1rc"]
        lose(r, old)
        await settle()
        assert drain(r) == []  # nothing was interrupted: the client hears nothing of the move
        assert view(new.subs) == [("CLEAR", False, b""), ("APPEND", True, frames(3))]
        assert new.subs[0].params["pitch_semitones"] == PITCH
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_turn_detection_commit_is_not_replayed_and_the_response_restarts() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new))
    try:
        for seq in (1, 2, 3):
            await r.post(append(seq, frames(seq)))
        await settle()
        # The worker consumed 1-2 and its turn detection committed there: the response starts.
        r.on_output(None, None, [update(1, 0, input_seq=2, turn_ended=True, committed_samples=1024)])
        await settle()
        evs = drain(r)
        assert kinds(evs)[-2:] == ["committed", "response_started"]
        turn = evs[-1].response_started.turn_id
        assert items(r.replay) == ["c1@1rc", "c2@1rc", "m", "c3@1"]
        lose(r, old)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "response_started"]
        assert evs[0].response_done.reason == "worker_unavailable"
        assert evs[1].response_started.turn_id == turn
        assert view(new.subs) == [
            ("CLEAR", False, b""),
            ("APPEND", True, frames(1) + frames(2)),
            ("APPEND", False, frames(3)),
            ("RESPOND", False, b""),
        ]
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_chunk_reported_by_one_worker_stays_replayed_on_the_third() -> None:
    first, second, third = FakeLink(), FakeLink(), FakeLink()
    r = make_runner(first, Placer(second, third))
    try:
        await explicit_turn(r, first)
        lose(r, first)
        await settle()
        drain(r)
        lose(r, second)  # before it reported anything
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "response_started"]
        assert evs[1].response_started.turn_id == 1
        assert view(third.subs) == view(second.subs)
        assert [s.replay for s in third.subs] == [False, True, False, False, False]
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_higher_epoch_on_the_new_worker_is_told_as_worker_moved() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new, epochs=[4]))
    try:
        await explicit_turn(r, old)
        lose(r, old)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "audio_cancelled", "response_started"]
        cancelled = evs[1].audio_cancelled
        assert (cancelled.cancelled_epoch, cancelled.epoch, cancelled.reason) == (1, 4, "worker_moved")
        assert evs[2].response_started.epoch == 4 and evs[2].response_started.turn_id == 1
        # The replay is written in the new epoch, its seqs going on from the old worker's.
        assert [(s.fence.epoch, s.seq) for s in new.subs] == [(4, 0), (4, 4), (4, 0), (4, 5), (4, 0)]
        # The client restarts its numbering at 1, as after any audio_cancelled.
        await r.post(append(1, frames(4)))
        await settle()
        evs = drain(r)
        assert [(e.input_ack.seq, e.input_ack.epoch) for e in evs] == [(1, 4)]
        assert view(new.subs)[-1] == ("APPEND", False, frames(4))
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_barge_in_before_the_restart_keeps_the_response_cancelled() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new))
    try:
        await explicit_turn(r, old)
        # The barge-in is queued before the session hears of the loss; it is handled first.
        await r.post(BARGE_IN)
        lose(r, old)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "audio_cancelled"], kinds(evs)
        assert evs[0].response_done.status == FAILED
        assert (evs[1].audio_cancelled.reason, evs[1].audio_cancelled.epoch) == ("barge_in", 2)
        # The answered input went; what the user said during the reply (the barge-in's own
        # speech, not yet consumed) is kept under the new epoch and replayed, news and all; no
        # RESPOND anywhere.
        assert RESPOND not in new.kinds()
        assert r.response is None
        assert view(new.subs) == [("CLEAR", False, b""), ("APPEND", False, frames(3))]
        assert [s.fence.epoch for s in new.subs] == [2] * len(new.subs)
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_barge_in_during_the_restarted_response_ends_the_turn_for_good() -> None:
    first, second, third = FakeLink(), FakeLink(), FakeLink()
    r = make_runner(first, Placer(second, third))
    try:
        await explicit_turn(r, first)
        lose(r, first)
        await settle()
        restarted = drain(r)[1].response_started
        # The new worker consumed the replay; then the user barges in.
        seqs = append_seqs(second)
        r.on_output(None, None, [update(1, 1, input_seq=seqs[-1])])
        await r.post(BARGE_IN)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["audio_cancelled", "response_done"]
        assert evs[1].response_done.response_id == restarted.response_id
        assert evs[1].response_done.status == CANCELLED
        # Its audio, late from the worker, is not delivered.
        r.on_output(Fence(SID, 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [])
        assert drain(r) == []
        # The answered input is gone: another loss replays only what came after the commit,
        # and restarts nothing.
        assert items(r.replay) == [f"c{seqs[-1]}@2rc"]
        lose(r, second)
        await settle()
        assert drain(r) == []
        assert view(third.subs) == [("CLEAR", False, b""), ("APPEND", True, frames(3))]
        assert third.subs[0].fence.epoch == 2
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_restart_that_brings_no_audio_in_time_fails_its_turn() -> None:
    """The caller's patience is bounded: a restarted response that sent no audio within
    ``restart_timeout_s`` of its start ends ``FAILED/worker_unavailable`` for good (not
    ``restarting``), and audio of it the worker sends later is not delivered."""
    clock = ManualClock()
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new), clock=clock, restart_timeout_s=2.0)
    try:
        await explicit_turn(r, old)
        lose(r, old)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "response_started"]
        assert evs[0].response_done.restarting
        restarted = evs[1].response_started
        await clock.advance(1.5, step=0.05)
        await settle()
        assert drain(r) == []  # within its time
        await clock.advance(1.5, step=0.05)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done"], kinds(evs)
        done = evs[0].response_done
        assert (done.response_id, done.status, done.reason) == (
            restarted.response_id,
            FAILED,
            "worker_unavailable",
        )
        assert not done.restarting and r.response is None and not r.closed
        r.on_output(Fence(SID, 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [])
        assert drain(r) == []
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_restart_that_sends_audio_in_time_is_not_failed() -> None:
    clock = ManualClock()
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new), clock=clock, restart_timeout_s=2.0)
    try:
        await explicit_turn(r, old)
        lose(r, old)
        await settle()
        drain(r)
        await clock.advance(1.0, step=0.05)
        r.on_output(Fence(SID, 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [])
        await clock.advance(3.0, step=0.05)
        await settle()
        assert kinds(drain(r)) == ["audio_delta"] and r.response is not None
    finally:
        r.close("test")
        await r.wait_closed()


async def test_no_worker_to_move_to_fails_the_turn_after_the_retries() -> None:
    clock = ManualClock()
    old = FakeLink()
    placer = Placer()
    r = make_runner(old, placer, clock=clock)
    try:
        first_id = await explicit_turn(r, old)
        lose(r, old)
        await settle()
        assert kinds(drain(r)) == ["response_done"]
        await clock.advance(sum(RECOVER_DELAYS_S) + 0.5, step=0.05)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["error"], kinds(evs)
        assert evs[0].error.code == ErrorCode.WORKER_UNAVAILABLE
        assert len(placer.calls) == len(RECOVER_DELAYS_S)
        assert r.response is None and not r.closed
        # The interrupted turn was given up, all of it: the input it answered, and what came
        # after (append 3, which the lost worker never reported consumed), is not kept for a
        # later move.
        assert items(r.replay) == []
        # A worker comes back: the next event places the session, after the lost worker was told
        # to release what it holds of it (kept by its link for its next stream); nothing is
        # replayed and no response restarts: the worker hears the new input only.
        back = FakeLink()
        placer.links.append(back)
        assert old.releases == []
        await r.post(append(4, frames(4)))
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["input_ack"]
        assert [(rel.request_id, rel.fence.epoch, rel.closed) for rel in old.releases] == [(SID, 1, False)]
        assert view(back.subs) == [("APPEND", False, frames(4))]
        assert back.releases == [] and first_id
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_failed_failover_leaves_nothing_of_the_turn_for_the_next_one() -> None:
    """Server turn detection: the worker heard speech begin in input it then never reported
    consumed, and hangs mid-reply; no worker takes the session. The speech span is closed, and
    the next turn on the worker found later is the new input alone: nothing of the lost one is
    replayed there (its speech would be heard, committed and answered as a turn of its own),
    nor counted in a commit; the lost worker, back by then, releases what it holds of the
    session before the session is placed again (it could be placed there)."""
    clock = ManualClock()
    old = FakeLink()
    released_before_placing: list[int] = []

    class ReleasedFirst(Placer):
        async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
            released_before_placing.append(len(old.releases))
            return await super().__call__(session_id, epoch, takeover)

    placer = ReleasedFirst()
    r = make_runner(old, placer, clock=clock)
    try:
        await explicit_turn(r, old)
        started = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED, sample_offset=0)
        r.on_output(None, None, [update(r.epoch, 0, vad=[started])])  # older input: no barge-in
        await r.post(append(4, frames(4)))  # more of it, never reported consumed
        await settle()
        assert kinds(drain(r)) == ["speech_started", "input_ack"]
        lose(r, old)
        await settle()
        assert kinds(drain(r)) == ["response_done"]
        await clock.advance(sum(RECOVER_DELAYS_S) + 0.5, step=0.05)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["speech_stopped", "error"], kinds(evs)
        assert evs[1].error.code == ErrorCode.WORKER_UNAVAILABLE and evs[1].error.retryable
        assert len(r.replay) == 0 and r.replay.size == 0
        old.healthy = True  # its link is back
        released_before_placing.clear()
        back = FakeLink()
        placer.links.append(back)
        await r.post(append(5, frames(5)))
        await r.post(COMMIT_EVENT)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["input_ack", "committed"], kinds(evs)
        assert evs[1].committed.audio_ms == 32  # frame 5 alone
        assert view(back.subs) == [("APPEND", False, frames(5)), ("COMMIT", False, b"")]
        assert released_before_placing == [1]
        assert [(rel.request_id, rel.closed) for rel in old.releases] == [(SID, False)]
    finally:
        r.close("test")
        await r.wait_closed()


async def test_without_turn_failover_a_lost_worker_fails_the_turn() -> None:
    old, new = FakeLink(), FakeLink()
    placer = Placer(new)
    r = make_runner(old, placer, turn_failover=False)
    try:
        first_id = await explicit_turn(r, old)
        lose(r, old)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "error"]
        assert (evs[0].response_done.response_id, evs[0].response_done.status) == (first_id, FAILED)
        assert evs[1].error.code == ErrorCode.WORKER_UNAVAILABLE
        assert len(r.replay) == 0 and r.replay.size == 0
        assert placer.calls == []  # nothing moves until the client sends something
        await r.post(append(4, frames(4)))
        await settle()
        assert kinds(drain(r)) == ["input_ack"]
        assert view(new.subs) == [("APPEND", False, frames(4))]  # no replay, no restart
    finally:
        r.close("test")
        await r.wait_closed()


# ---- found in review ------------------------------------------------------------------------------


async def test_a_response_create_queued_before_the_loss_does_not_orphan_the_restart() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new))
    try:
        await explicit_turn(r, old)
        await r.post(COMMIT_EVENT)  # the user's next turn, committed during the response
        await settle()
        assert kinds(drain(r)) == ["committed"]
        await r.post(CREATE)  # queued, not yet handled, when the worker is lost
        lose(r, old)
        await settle()
        evs = drain(r)
        started = [e.response_started.response_id for e in evs if e.HasField("response_started")]
        ended = {e.response_done.response_id for e in evs if e.HasField("response_done")}
        # At most one response is running, and it is the session's active one.
        running = [rid for rid in started if rid not in ended]
        assert len(running) <= 1, kinds(evs)
        assert new.kinds().count(RESPOND) == len(running)
    finally:
        r.close("test")
        await r.wait_closed()


async def test_speech_in_the_replayed_utterance_does_not_barge_in_on_its_own_restart() -> None:
    old, new = FakeLink(), FakeLink()
    r = make_runner(old, Placer(new))
    try:
        # A fast client: utterance, commit and response before the worker consumed anything.
        await r.post(append(1, frames(1)))
        await r.post(COMMIT_EVENT)
        await r.post(CREATE)
        await settle()
        drain(r)
        lose(r, old)
        await settle()
        assert kinds(drain(r)) == ["response_done", "response_started"]
        assert new.subs[0].kind == CLEAR
        replayed = new.subs[1]
        assert replayed.kind == APPEND and not replayed.replay
        # The new worker hears the speech in it (first heard here: reported), fenced as written.
        started = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED, sample_offset=0)
        r.on_output(
            None,
            None,
            [worker_pb2.RequestUpdate(request_id=SID, fence=replayed.fence, vad=[started])],
        )
        evs = drain(r)
        assert "audio_cancelled" not in kinds(evs), kinds(evs)
        assert r.response is not None
    finally:
        r.close("test")
        await r.wait_closed()


async def test_an_append_retried_across_a_move_is_not_acked_in_the_new_epoch() -> None:
    class Holding(FakeLink):
        """Once ``hold`` is set, writes stay in flight until the link dies."""

        def __init__(self) -> None:
            super().__init__()
            self.hold = False
            self.in_flight: list[asyncio.Future[None]] = []

        def submit(
            self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False
        ) -> asyncio.Future[None]:
            if not self.hold:
                return super().submit(subs)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.subs.extend(subs)
            self.in_flight.append(fut)
            return fut

        def die(self) -> None:
            self.healthy = False
            for fut in self.in_flight:
                if not fut.done():
                    fut.set_exception(ConnectionError("gone"))

    old, new = Holding(), FakeLink()
    r = make_runner(old, Placer(new, epochs=[2]))
    try:
        await r.post(append(1, frames(1)))
        await r.post(append(2, frames(2)))
        await settle()
        assert [(e.input_ack.seq, e.input_ack.epoch) for e in drain(r)] == [(1, 1), (2, 1)]
        old.hold = True
        await r.post(append(3, frames(3)))
        await settle()
        assert len(old.in_flight) == 1 and not old.in_flight[0].done()
        old.die()
        r.on_worker_lost(old)  # type: ignore[arg-type]
        await settle()
        evs = drain(r)
        assert "error" not in kinds(evs)
        cancelled = next(i for i, e in enumerate(evs) if e.HasField("audio_cancelled"))
        assert evs[cancelled].audio_cancelled.epoch == 2
        # Acks after audio_cancelled{epoch 2} are of the client's new numbering: none of them
        # may name seq 3 of epoch 2, which the client has not sent.
        late = [(e.input_ack.seq, e.input_ack.epoch) for e in evs[cancelled:] if e.HasField("input_ack")]
        assert (3, 2) not in late, late
    finally:
        r.close("test")
        await r.wait_closed()


async def test_a_replay_that_was_not_written_is_not_answered_by_a_restart() -> None:
    class FirstWriteHangs(FakeLink):
        """Its first write never completes (a worker that stopped reading); the rest do."""

        def __init__(self) -> None:
            super().__init__()
            self.hung: asyncio.Future[None] | None = None
            self.written: list[worker_pb2.Submission] = []

        def submit(
            self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False
        ) -> asyncio.Future[None]:
            if self.hung is None:
                self.hung = asyncio.get_running_loop().create_future()
                self.subs.extend(subs)
                return self.hung
            self.written.extend(subs)
            return super().submit(subs)

    clock = ManualClock()
    old, slow, spare = FakeLink(), FirstWriteHangs(), FakeLink()
    r = make_runner(old, Placer(slow, spare), clock=clock)
    try:
        await explicit_turn(r, old)
        lose(r, old)
        await settle()
        assert slow.hung is not None and slow.subs[1].replay  # the replay is being written
        await clock.advance(RunnerConfig().submit_timeout_s + sum(RECOVER_DELAYS_S) + 1, step=0.1)
        await settle()
        # Wherever the response restarted, the turn's input was written there before it.
        for link, written in ((slow, slow.written), (spare, spare.subs)):
            if RESPOND in [s.kind for s in written]:
                before = written[: [s.kind for s in written].index(RESPOND)]
                assert b"".join(s.pcm for s in before if s.kind == APPEND).startswith(
                    frames(1) + frames(2)
                ), link
        assert RESPOND in [s.kind for s in slow.written + spare.subs]
    finally:
        r.close("test")
        await r.wait_closed()
