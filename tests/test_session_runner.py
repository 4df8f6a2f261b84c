"""Unit tests of one SessionRunner with a fake worker link (no processes): fencing, purging,
append validation, the response lifecycle, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from duplex.audio import F32LE, S16LE
from duplex.errors import ErrorCode
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.session.response import InputTimeline, SilenceFeeder
from session_service.session.runner import DEADLINE_LOOK_S, SessionRunner
from session_service.workers.step_routing import Router, SessionRegistry
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain, sample, unit_runner

FRAME = b"\x10\x00" * 512
SID = "sess_unit"


async def _placer(session_id: str, epoch: int, takeover: bool):  # type: ignore[no-untyped-def]
    raise AssertionError("not expected")


def make_runner(link: FakeLink, *, clock: ManualClock | None = None, **cfg: object) -> SessionRunner:
    return unit_runner(link, session_id=SID, pitch=4.0, placer=_placer, clock=clock, **cfg)


def kinds(events: list[session_pb2.ServerEvent]) -> list[str]:
    return [e.WhichOneof("event") or "" for e in events]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def append(
    seq: int, pcm: bytes = FRAME, fmt: common_pb2.AudioFormat | None = None, eid: str = ""
) -> session_pb2.ClientEvent:
    ap = session_pb2.InputAudioAppend(seq=seq, pcm=pcm)
    if fmt is not None:
        ap.format.CopyFrom(fmt)
    return session_pb2.ClientEvent(event_id=eid or f"a{seq}", append=ap)


def step_update(epoch: int, turn: int, **kw: object) -> worker_pb2.RequestUpdate:
    return worker_pb2.RequestUpdate(request_id=SID, fence=Fence(SID, epoch, turn).to_proto(), **kw)  # type: ignore[arg-type]


def audio(r: SessionRunner, epoch: int, turn: int, pcm: bytes = FRAME) -> None:
    r.on_output(Fence(SID, epoch, turn).to_proto(), common_pb2.AudioPayload(pcm=pcm), [])


async def start_response(r: SessionRunner) -> None:
    r.on_output(None, None, [step_update(r.epoch, r.turn_id, turn_ended=True, committed_samples=8000)])
    await settle()


async def test_append_is_acked_after_the_worker_write_with_params_first() -> None:
    link = FakeLink()
    r = make_runner(link)
    await r.post(append(1))
    await r.post(append(2, FRAME[:200]))
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["input_ack", "input_ack"]
    assert [e.input_ack.seq for e in evs] == [1, 2] and evs[0].input_ack.epoch == 1
    assert link.kinds() == [worker_pb2.SUBMISSION_KIND_APPEND]  # seq 2 is still a partial frame
    sub = link.subs[0]
    assert sub.fence.epoch == 1 and sub.seq == 1 and sub.pcm == FRAME
    assert dict(sub.params)["auto_commit"] is True


async def test_an_append_is_handed_to_the_worker_in_the_posting_task_and_acked_once_written() -> None:
    """Issue 22, item 4: an append wakes no task but the stream's reader. With nothing ahead of
    it, it reaches the link before ``post`` returns (the runner's task never ran), and its ack
    waits for the write; anything else still goes through the runner, in order."""
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    class WritesLater(FakeLink):
        def submit(
            self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False
        ) -> asyncio.Future[None]:
            self.subs.extend(subs)
            return never

    link = WritesLater()
    r = make_runner(link)
    await r.post(append(1))
    assert [s.seq for s in link.subs] == [1]  # no await between: the runner's task did not run
    await settle()
    assert kinds(drain(r)) == []  # not written yet: no ack
    never.set_result(None)
    await settle()
    assert [e.input_ack.seq for e in drain(r)] == [1]
    await r.post(session_pb2.ClientEvent(event_id="c", clear=session_pb2.InputAudioClear()))
    assert [s.kind for s in link.subs] == [worker_pb2.SUBMISSION_KIND_APPEND]  # queued for the runner
    await settle()
    assert link.kinds()[-1] == worker_pb2.SUBMISSION_KIND_CLEAR
    r.close("test")
    await r.wait_closed()


class WritesOnTick(FakeLink):
    """A link whose writes are all done together when the test says (a worker tick's command)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[asyncio.Future[None]] = []

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        self.subs.extend(subs)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        return fut

    def tick(self) -> None:
        for fut in self.waiting:
            fut.set_result(None)
        self.waiting.clear()


async def test_a_commit_and_the_appends_behind_it_join_the_earlier_appends_command() -> None:
    """A commit does not wait for the writes of the appends before it, nor do the appends queued
    behind the commit wait for its write: all of them reach the link before one write is done
    (one command per worker tick, not a tick each). Answers still come in the events' order."""
    link = WritesOnTick()
    r = make_runner(link)
    await r.post(append(1))  # at once: its write waits for the tick
    await r.post(session_pb2.ClientEvent(event_id="c", commit=session_pb2.InputAudioCommit()))
    await r.post(append(2))  # queued behind the commit (the runner is in it)
    await r.post(append(2, eid="dup"))  # refused (seq must increase): answered in its place
    await settle()
    assert link.kinds() == [
        worker_pb2.SUBMISSION_KIND_APPEND,
        worker_pb2.SUBMISSION_KIND_COMMIT,
        worker_pb2.SUBMISSION_KIND_APPEND,
    ]
    assert kinds(drain(r)) == []  # nothing written yet: nothing answered, the refusal included
    link.tick()
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["input_ack", "committed", "input_ack", "error"], evs
    assert [e.input_ack.seq for e in evs if e.HasField("input_ack")] == [1, 2]
    assert evs[3].error.event_id == "dup"
    r.close("test")
    await r.wait_closed()


@pytest.mark.parametrize(
    ("event", "code"),
    [
        (
            append(1, FRAME, common_pb2.AudioFormat(encoding=F32LE, sample_rate_hz=16000, channels=1)),
            ErrorCode.AUDIO_FORMAT_MISMATCH,
        ),
        (
            append(1, FRAME, common_pb2.AudioFormat(encoding=S16LE, sample_rate_hz=12345, channels=1)),
            ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        ),
        (
            append(1, FRAME, common_pb2.AudioFormat(encoding=0, sample_rate_hz=16000, channels=1)),
            ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        ),
        (append(1, b"\x00" * 1023), ErrorCode.INVALID_PCM_LENGTH),
        (append(1, b""), ErrorCode.INVALID_PCM_LENGTH),
        (append(1, b"\x00" * (256 * 1024 + 2)), ErrorCode.CHUNK_TOO_LARGE),
        (session_pb2.ClientEvent(event_id="x", open=session_pb2.SessionOpen()), ErrorCode.ALREADY_OPEN),
        (
            session_pb2.ClientEvent(event_id="x", response_create=session_pb2.ResponseCreate()),
            ErrorCode.NO_COMMITTED_INPUT,
        ),
        (
            session_pb2.ClientEvent(event_id="x", response_cancel=session_pb2.ResponseCancel()),
            ErrorCode.NO_ACTIVE_RESPONSE,
        ),
        (
            session_pb2.ClientEvent(event_id="x", commit=session_pb2.InputAudioCommit()),
            ErrorCode.NO_COMMITTED_INPUT,
        ),
        (session_pb2.ClientEvent(event_id="x"), ErrorCode.INVALID_EVENT),
    ],
)
async def test_bad_events_get_their_code_and_the_session_goes_on(
    event: session_pb2.ClientEvent, code: str
) -> None:
    link = FakeLink()
    r = make_runner(link)
    await r.post(event)
    await r.post(append(5, eid="good"))
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["error", "input_ack"], evs
    assert evs[0].error.code == code and evs[0].error.event_id == event.event_id
    assert not r.closed


async def test_seq_must_increase() -> None:
    r = make_runner(FakeLink())
    await r.post(append(3))
    await r.post(append(3))
    await r.post(append(2))
    await settle()
    assert [e.error.code for e in drain(r) if e.HasField("error")] == ["seq_out_of_order"] * 2


async def test_failed_write_rolls_back_and_abandons_later_appends() -> None:
    link = FakeLink()
    r = make_runner(link)
    link.fail_next = 1
    await r.post(append(1))
    await r.post(append(2))
    await r.post(session_pb2.ClientEvent(clear=session_pb2.InputAudioClear()))
    await r.post(append(3))
    await settle()
    evs = drain(r)
    assert [e.error.code for e in evs if e.HasField("error")] == ["worker_unavailable", "input_abandoned"]
    assert kinds(evs)[-2:] == ["cleared", "input_ack"]
    assert r.state.audio_buffer.pending_byte_count == 0 and not r.state.audio_buffer.has_reserved()


async def test_turn_end_starts_a_response_and_audio_flows_in_order() -> None:
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    assert link.kinds()[-1] == worker_pb2.SUBMISSION_KIND_RESPOND and link.subs[-1].fence.turn_id == 1
    audio(r, 1, 1)
    audio(r, 1, 1)
    r.on_output(None, None, [step_update(1, 1, response_finished=True)])
    evs = drain(r)
    assert kinds(evs) == ["committed", "response_started", "audio_delta", "audio_delta", "response_done"]
    assert evs[1].response_started.turn_id == 1
    assert (
        evs[3].audio_delta.offset_ms == 32
        and evs[4].response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
    )
    assert r.state.context_locked


async def test_cancel_fences_old_epoch_and_purges_queued_audio() -> None:
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    audio(r, 1, 1)
    audio(r, 1, 1)
    # The client has not read yet: the queued audio must not survive the cancel.
    await r.post(session_pb2.ClientEvent(barge_in=session_pb2.BargeIn()))
    await settle()
    audio(r, 1, 1)  # late audio of the cancelled epoch from the worker
    r.on_output(None, None, [step_update(1, 1, response_finished=True)])
    evs = drain(r)
    assert kinds(evs) == ["committed", "response_started", "audio_cancelled", "response_done"]
    ac = evs[2].audio_cancelled
    assert (ac.cancelled_epoch, ac.epoch, ac.reason) == (1, 2, "barge_in")
    assert evs[3].response_done.status == session_pb2.RESPONSE_STATUS_CANCELLED
    assert link.aborts[-1].fence.epoch == 2 and link.aborts[-1].reason == "barge_in"
    # Seq restarts at 1 in the new epoch (appends sent before the client saw the cancel still pass).
    await r.post(append(7))
    await r.post(append(1))
    await settle()
    assert [e.input_ack.seq for e in drain(r)] == [7, 1]
    assert link.subs[-1].fence.epoch == 2


async def test_vad_speech_during_response_barges_in() -> None:
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    started = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED, sample_offset=16000)
    # Speech start and audio of the same step: the audio must not get out.
    r.on_output(
        Fence(SID, 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [step_update(1, 1, vad=[started])]
    )
    evs = drain(r)
    assert kinds(evs) == [
        "committed",
        "response_started",
        "speech_started",
        "audio_cancelled",
        "response_done",
    ]
    assert evs[2].speech_started.audio_ms == 1000


async def test_a_barge_in_keeps_hearing_the_speech_that_caused_it() -> None:
    """The step that heard the user over the reply was followed, before the cancel reached the
    worker, by more of the same input: its news (the speech's end, the turn the model ended)
    comes stepped under the epoch the barge-in left and still counts, so the user's turn is
    answered; nothing of the reply of that epoch (its audio, text or end) does."""
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    vad = worker_pb2.VadEvent
    r.on_output(None, None, [step_update(1, 1, vad=[vad(kind=vad.KIND_SPEECH_STARTED, sample_offset=16000)])])
    assert kinds(drain(r)) == [
        "committed",
        "response_started",
        "speech_started",
        "audio_cancelled",
        "response_done",
    ]
    assert r.epoch == 2 and [a.keep_input for a in link.aborts] == [True]
    # Later steps of the old epoch: the reply's last frame, its end and text, and the speech's end.
    r.on_output(
        Fence(SID, 1, 1).to_proto(),
        common_pb2.AudioPayload(pcm=FRAME),
        [step_update(1, 1, text="no", response_finished=True)],
    )
    assert drain(r) == []
    r.on_output(
        None,
        None,
        [
            step_update(
                1,
                1,
                vad=[vad(kind=vad.KIND_SPEECH_STOPPED, sample_offset=32000)],
                turn_ended=True,
                committed_samples=16000,
            )
        ],
    )
    evs = drain(r)
    assert kinds(evs) == ["speech_stopped", "committed", "response_started"]
    assert evs[1].committed.audio_ms == 1000 and evs[2].response_started.turn_id == 2
    assert evs[2].response_started.epoch == 2
    # News of an epoch from before the session's placement still counts for nothing.
    r.on_output(None, None, [step_update(0, 1, vad=[vad(kind=vad.KIND_SPEECH_STARTED, sample_offset=0)])])
    assert drain(r) == []


async def test_speech_in_input_queued_before_the_response_does_not_barge_in() -> None:
    """A fast client commits while the worker still hears its pre-commit audio: that speech
    carries the old turn's fence and is the turn being answered, not an interruption."""
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    assert r.turn_id == 1
    started = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED, sample_offset=0)
    r.on_output(
        Fence(SID, 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [step_update(1, 0, vad=[started])]
    )
    evs = drain(r)
    assert kinds(evs) == ["committed", "response_started", "speech_started", "audio_delta"]
    assert r.epoch == 1


async def test_worker_loss_mid_speech_closes_the_speech_span() -> None:
    link = FakeLink()
    r = make_runner(link, turn_failover=False)
    started = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED, sample_offset=0)
    r.on_output(None, None, [step_update(1, 0, vad=[started])])
    r.on_worker_lost(link)  # type: ignore[arg-type]
    assert kinds(drain(r)) == ["speech_started", "speech_stopped", "error"]


async def test_stale_outputs_are_dropped() -> None:
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    drain(r)
    audio(r, 0, 1)  # older epoch
    audio(r, 1, 0)  # older turn
    audio(r, 1, 7)  # a turn that is not the active response
    r.on_output(None, None, [step_update(0, 1, turn_ended=True)])  # stale news
    r.on_output(None, common_pb2.AudioPayload(pcm=FRAME), [])  # no batch fence
    # Another session's fence, current epoch and turn: a mislabelled step is never played.
    r.on_output(Fence("sess_other", 1, 1).to_proto(), common_pb2.AudioPayload(pcm=FRAME), [])
    assert drain(r) == []
    audio(r, 1, 1)  # and the session's own current audio still flows
    assert kinds(drain(r)) == ["audio_delta"]


async def test_worker_errors_fail_the_response_or_fence_the_session() -> None:
    link = FakeLink()
    r = make_runner(link)
    await start_response(r)
    r.on_output(
        None, None, [step_update(1, 1, error=worker_pb2.WorkerError(code="model_error", message="boom"))]
    )
    evs = drain(r)
    assert kinds(evs)[-2:] == ["response_done", "error"]
    assert evs[-2].response_done.status == session_pb2.RESPONSE_STATUS_FAILED
    r.on_output(None, None, [step_update(1, 1, error=worker_pb2.WorkerError(code="not_owner"))])
    evs = drain(r)
    # Another replica took the session over: this stream is told so, as a displaced one is.
    assert kinds(evs) == ["closed"] and evs[0].closed.reason == "resumed_elsewhere" and r.closed
    assert link.releases


async def test_response_create_rules_and_context_lock() -> None:
    link = FakeLink()
    r = make_runner(link)
    up = session_pb2.ClientEvent(
        update=session_pb2.SessionUpdate(config=session_pb2.SessionConfig(instructions="hi"))
    )
    await r.post(up)
    await r.post(append(1))
    await r.post(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
    await r.post(session_pb2.ClientEvent(response_create=session_pb2.ResponseCreate()))
    await r.post(session_pb2.ClientEvent(response_create=session_pb2.ResponseCreate()))
    up2 = session_pb2.ClientEvent(
        update=session_pb2.SessionUpdate(config=session_pb2.SessionConfig(instructions="no"))
    )
    await r.post(up2)
    bad_model = session_pb2.ClientEvent(update=session_pb2.SessionUpdate())
    bad_model.update.extra_body.update({"model": "other"})
    await r.post(bad_model)
    private = session_pb2.ClientEvent(update=session_pb2.SessionUpdate())
    private.update.extra_body.update({"_worker_params": {"x": 1}})
    await r.post(private)
    await settle()
    evs = drain(r)
    assert kinds(evs)[:4] == ["updated", "input_ack", "committed", "response_started"]
    assert [e.error.code for e in evs if e.HasField("error")] == [
        "response_in_progress",
        "context_locked",
        "model_change_refused",
        "private_runtime_key",
    ]
    assert link.kinds()[-2:] == [worker_pb2.SUBMISSION_KIND_COMMIT, worker_pb2.SUBMISSION_KIND_RESPOND]


async def test_idle_session_closes_after_the_operators_timeout_and_not_before() -> None:
    clock = ManualClock()
    r = make_runner(FakeLink(), clock=clock, idle_timeout_s=300)
    await clock.advance(1)
    await r.post(append(1))
    await clock.advance(299.5)  # 299.5 s since the last client event: still open
    assert not r.closed
    await clock.advance(1)
    await asyncio.wait_for(r.wait_closed(), 5)
    evs = drain(r)
    assert kinds(evs) == ["input_ack", "closed"] and evs[-1].closed.reason == "idle_timeout"


async def test_a_client_may_shorten_the_idle_timeout_but_never_extend_it() -> None:
    import dataclasses

    clock = ManualClock()
    r = make_runner(FakeLink(), clock=clock, idle_timeout_s=300)
    r.settings = dataclasses.replace(r.settings, idle_timeout_s=4_000_000_000)
    await settle()  # the runner waits for its first event
    await clock.advance(301)
    await asyncio.wait_for(r.wait_closed(), 5)
    assert drain(r)[-1].closed.reason == "idle_timeout"

    r = make_runner(FakeLink(), clock=clock, idle_timeout_s=300)
    r.settings = dataclasses.replace(r.settings, idle_timeout_s=10)
    await settle()
    await clock.advance(9)
    assert not r.closed
    await clock.advance(2)
    await asyncio.wait_for(r.wait_closed(), 5)
    assert drain(r)[-1].closed.reason == "idle_timeout"


async def test_an_active_response_keeps_an_idle_session_open() -> None:
    clock = ManualClock()
    r = make_runner(FakeLink(), clock=clock, idle_timeout_s=10, silence_continuation=False)
    await start_response(r)
    await clock.advance(60)
    assert not r.closed
    r.on_output(None, None, [step_update(1, 1, response_finished=True)])
    await clock.advance(11)
    await asyncio.wait_for(r.wait_closed(), 5)
    assert drain(r)[-1].closed.reason == "idle_timeout"


class _CountingClock(ManualClock):
    """Counts the timers the runner asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0
        self.timeouts = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await super().sleep(seconds)

    def timeout(self, seconds: float) -> Any:
        self.timeouts += 1
        return super().timeout(seconds)


async def test_appends_arm_no_timer_each() -> None:
    """Idle, detached and submit deadlines are looked at about once a second, not armed and
    cancelled for every event (two timers per append before)."""
    clock = _CountingClock()
    link = FakeLink()
    # Nothing reports the input consumed here: acks must not wait for that.
    r = make_runner(link, clock=clock, idle_timeout_s=300, max_unconsumed_input_ms=60_000)
    await settle()
    for seq in range(1, 101):  # 3.2 s of real-time appends
        await r.post(append(seq))
        await clock.advance(0.032)
    evs = drain(r)
    assert [e.input_ack.seq for e in evs if e.HasField("input_ack")] == list(range(1, 101))
    assert clock.timeouts == 0
    assert clock.sleeps <= 3.2 / DEADLINE_LOOK_S + 2, clock.sleeps
    r.close("test")
    await r.wait_closed()


async def test_a_submission_not_written_in_time_fails_worker_unavailable() -> None:
    class NeverWrites(FakeLink):
        def submit(
            self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False
        ) -> asyncio.Future[None]:
            self.subs.extend(subs)
            return asyncio.get_running_loop().create_future()  # a worker that stopped reading

    clock = ManualClock()
    r = make_runner(NeverWrites(), clock=clock)
    await r.post(append(1))
    timeout = RunnerConfig().submit_timeout_s
    await clock.advance(timeout - 0.1, step=0.1)
    assert "error" not in kinds(drain(r))  # not yet
    await clock.advance(DEADLINE_LOOK_S + 0.2, step=0.1)
    evs = drain(r)
    errors = [e.error for e in evs if e.HasField("error")]
    assert [(e.code, e.event_id) for e in errors] == [(ErrorCode.WORKER_UNAVAILABLE.value, "a1")]
    assert not r.closed  # the session goes on: the input is abandoned until commit or clear
    r.close("test")
    await r.wait_closed()


async def test_a_detached_session_closes_after_its_grace_even_while_idle_is_far() -> None:
    clock = ManualClock()
    r = make_runner(FakeLink(), clock=clock, idle_timeout_s=300, detached_grace_s=5)
    await settle()
    r.detach()
    await clock.advance(4.5, step=0.25)
    assert not r.closed
    await clock.advance(1, step=0.25)
    await asyncio.wait_for(r.wait_closed(), 5)
    assert drain(r)[-1].closed.reason == "detached"


async def test_a_client_that_stops_reading_is_cut_off_by_bytes_not_only_by_count() -> None:
    r = make_runner(FakeLink(), max_buffer_bytes=64 * 1024)
    await start_response(r)
    for _ in range(20):  # 20 x 1 KiB frames fit
        audio(r, 1, 1, pcm=b"\x00" * 1024)
    assert not r.closed
    for _ in range(60):  # another 60 KiB does not: the session closes as a slow consumer
        audio(r, 1, 1, pcm=b"\x00" * 1024)
    assert r.closed


async def test_silence_is_fed_at_frame_deadlines_while_a_response_runs_without_input() -> None:
    clock = ManualClock()
    link = FakeLink()
    r = make_runner(link, clock=clock, max_silence_frames=3)
    await start_response(r)
    silence = lambda: [s for s in link.subs if s.kind == worker_pb2.SUBMISSION_KIND_APPEND]  # noqa: E731
    await clock.advance(0.020)  # less than one 32 ms frame: nothing yet
    assert silence() == []
    await clock.advance(0.032 * 5, step=0.004)  # five frame periods, but at most three frames
    fed = silence()
    assert len(fed) == 3 and all(not any(s.pcm) for s in fed)
    assert [s.seq for s in fed] == [1, 2, 3] and all(s.fence.turn_id == 1 for s in fed)


async def test_no_silence_while_the_client_streams_and_none_after_the_response() -> None:
    clock = ManualClock()
    link = FakeLink()
    r = make_runner(link, clock=clock)
    await start_response(r)
    for seq in range(1, 11):  # the client keeps sending a frame every frame period
        await r.post(append(seq))
        await clock.advance(0.032, step=0.004)
    assert all(any(s.pcm) for s in link.subs if s.kind == worker_pb2.SUBMISSION_KIND_APPEND)
    r.on_output(None, None, [step_update(1, 1, response_finished=True)])
    n = len(link.subs)
    await clock.advance(1.0, step=0.008)  # the client went quiet, but no response runs now
    assert len(link.subs) == n


# ---- router ---------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, link: object) -> None:
        self.link = link
        self.session_id = SID
        self.calls: list[tuple[object, object, list[str]]] = []
        self.acks: list[int] = []

    def on_output(self, fence, payload, updates, input_seq=0) -> None:  # type: ignore[no-untyped-def]
        self.calls.append((fence, payload, ["error" if u.HasField("error") else "news" for u in updates]))
        self.acks.append(input_seq)


def _step(req_ids: list[str], n_audio: int, *, sparse: bool = True) -> worker_pb2.StepOutput:
    step = worker_pb2.StepOutput(step=3)
    for rid in [SID, "other"]:
        step.batch.add(request_id=rid, fence=Fence(rid, 1, 1).to_proto())
    step.outputs.output_type = worker_pb2.OUTPUT_TYPE_AUDIO
    step.outputs.sparse_audio = sparse
    step.outputs.req_id.extend(req_ids)
    for _ in range(n_audio):
        step.outputs.audio.add(pcm=FRAME)
    step.updates.add(request_id=SID, fence=Fence(SID, 1, 1).to_proto(), text="t")
    return step


def _routed() -> tuple[FakeLink, _Recorder, Router]:
    """A router over one recording session (``SID``) placed on a fake link."""
    link = FakeLink()
    reg = SessionRegistry()
    rec = _Recorder(link)
    reg.add(rec)  # type: ignore[arg-type]
    return link, rec, Router(reg)


def test_router_routes_by_request_and_fails_closed() -> None:
    link, rec, router = _routed()
    router.on_step(link, _step([SID], 1))
    assert rec.calls[-1][1] is not None and rec.calls[-1][0].epoch == 1  # type: ignore[union-attr]
    # Length mismatch: no payload of the step is routed, but per-request news still is.
    router.on_step(link, _step([SID, "other"], 1))
    assert rec.calls[-1][1] is None and rec.calls[-1][2] == ["news"]
    # Dense with the wrong count fails closed too.
    router.on_step(link, _step([], 1, sparse=False))
    assert rec.calls[-1][1] is None
    # Output from a worker the session is not placed on is dropped.
    n = len(rec.calls)
    router.on_step(FakeLink(), _step([SID], 1))
    assert len(rec.calls) == n


def test_router_reads_a_step_in_columns_as_it_reads_one_in_rows() -> None:
    link, rec, router = _routed()
    rows = _step([SID], 1)
    rows.updates.add(request_id=SID, fence=Fence(SID, 1, 1).to_proto(), input_seq=7)
    cols = _step([SID], 1)
    del cols.batch[:]
    c = cols.columns
    c.request_id.extend([SID, "other"])
    c.session_id.extend([SID, "other"])
    c.epoch.extend([1, 1])
    c.turn_id.extend([1, 1])
    c.input_seq.extend([7, 0])
    router.on_step(link, rows)
    router.on_step(link, cols)
    (f_rows, p_rows, u_rows), (f_cols, p_cols, u_cols) = rec.calls
    # The same audio, fence and news reach the session; the ack comes as an argument, not an update.
    assert p_rows == p_cols and p_cols is not None
    assert (f_cols.session_id, f_cols.epoch, f_cols.turn_id) == (
        f_rows.session_id,
        f_rows.epoch,
        f_rows.turn_id,
    )  # type: ignore[attr-defined]
    assert u_rows == ["news", "news"] and u_cols == ["news"] and rec.acks == [0, 7]
    # An ack alone in the columns reaches its session; audio naming a request outside the
    # columns reaches no session, as audio outside a batch does.
    lone = worker_pb2.StepOutput(step=4)
    lone.columns.request_id.append(SID)
    lone.columns.session_id.append(SID)
    lone.columns.epoch.append(1)
    lone.columns.turn_id.append(1)
    lone.columns.input_seq.append(8)
    router.on_step(link, lone)
    assert rec.calls[-1] == (rec.calls[-1][0], None, []) and rec.acks[-1] == 8
    lone.outputs.output_type = worker_pb2.OUTPUT_TYPE_AUDIO
    lone.outputs.sparse_audio = True
    lone.outputs.req_id.append("other")
    lone.outputs.audio.add(pcm=FRAME)
    router.on_step(link, lone)
    assert rec.calls[-1][1] is None


async def test_worker_loss_fails_the_active_response() -> None:
    link = FakeLink()
    r = make_runner(link, turn_failover=False)
    await start_response(r)
    drain(r)
    r.on_worker_lost(link)  # type: ignore[arg-type]
    evs = drain(r)
    assert kinds(evs) == ["response_done", "error"]
    assert evs[0].response_done.status == session_pb2.RESPONSE_STATUS_FAILED
    assert evs[1].error.code == "worker_unavailable" and evs[1].error.retryable
    assert r.link is None


# ---- backpressure through input acks ------------------------------------------------------------

# 96 ms of unconsumed audio = 3 worker frames of 32 ms: acks are held beyond that.
HOLD = {"max_unconsumed_input_ms": 96}


def acks(events: list[session_pb2.ServerEvent]) -> list[tuple[int, int]]:
    return [(e.input_ack.seq, e.input_ack.epoch) for e in events if e.HasField("input_ack")]


async def _hand_on(r: SessionRunner, seqs: range) -> None:
    for seq in seqs:
        await r.post(append(seq))
    await settle()


async def test_acks_are_held_while_the_worker_is_behind_and_released_as_it_consumes() -> None:
    link = FakeLink()
    r = make_runner(link, **HOLD)
    await _hand_on(r, range(1, 7))
    # Every append was handed on at once, but only three frames may wait unconsumed.
    assert [s.seq for s in link.subs] == [1, 2, 3, 4, 5, 6]
    assert acks(drain(r)) == [(1, 1), (2, 1), (3, 1)]
    assert r.unconsumed_frames == 6
    r.on_output(None, None, [step_update(1, 0, input_seq=2)])
    assert acks(drain(r)) == []  # four still unconsumed
    r.on_output(None, None, [step_update(1, 0, input_seq=3)])
    # Caught up to the bound: the held acks go out as one, the highest seq handed on.
    assert acks(drain(r)) == [(6, 1)]
    assert r.unconsumed_frames == 3
    await _hand_on(r, range(7, 8))
    assert acks(drain(r)) == []
    r.on_output(None, None, [step_update(1, 0, input_seq=7)])
    assert acks(drain(r)) == [(7, 1)] and r.unconsumed_frames == 0
    # Client seqs and worker seqs are independent: a partial frame is acked without a worker seq.
    await r.post(append(8, FRAME[:200]))
    await settle()
    assert acks(drain(r)) == [(8, 1)] and len(link.subs) == 7


async def test_cancel_keeps_the_input_the_worker_holds_and_its_held_acks_wait_for_it() -> None:
    """A cancel aborts the reply, not the input (``Abort.keep_input``): what the worker had not
    consumed is consumed under the new epoch, so the acks held for it wait for that, and worker
    seqs go on."""
    link = FakeLink()
    r = make_runner(link, **HOLD)
    await _hand_on(r, range(1, 6))
    assert acks(drain(r)) == [(1, 1), (2, 1), (3, 1)]
    await r.post(session_pb2.ClientEvent(barge_in=session_pb2.BargeIn()))
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["audio_cancelled"]
    assert [(a.fence.epoch, a.keep_input) for a in link.aborts] == [(2, True)]
    assert r.unconsumed_frames == 5
    await _hand_on(r, range(1, 6))
    assert [s.seq for s in link.subs[-5:]] == [6, 7, 8, 9, 10]
    assert all(s.fence.epoch == 2 for s in link.subs[-5:])
    assert acks(drain(r)) == []  # behind the held acks of epoch 1
    # The worker goes on consuming the kept input, its report stepped under the old epoch or the
    # new: the held acks go out, in order, once it is within the bound again.
    r.on_output(None, None, [step_update(1, 0, input_seq=5)])
    assert acks(drain(r)) == []
    r.on_output(None, None, [step_update(2, 0, input_seq=8)])
    assert acks(drain(r)) == [(5, 1), (5, 2)]


async def test_an_ack_from_a_step_in_columns_counts_from_the_epoch_its_input_was_placed_in() -> None:
    from session_service.session.worker_output import ColumnFence

    link = FakeLink()
    r = make_runner(link, **HOLD)
    await _hand_on(r, range(1, 6))
    assert acks(drain(r)) == [(1, 1), (2, 1), (3, 1)]
    r.on_output(ColumnFence(SID, 1, 0), None, [], 5)
    assert acks(drain(r)) == [(5, 1)]  # the held acks go out once the worker caught up
    await r.post(session_pb2.ClientEvent(barge_in=session_pb2.BargeIn()))
    await settle()
    drain(r)
    await _hand_on(r, range(1, 6))
    assert acks(drain(r)) == [(1, 2), (2, 2), (3, 2)]
    # An ack stepped under the epoch a cancel left counts (the cancel kept the input; worker
    # seqs went on: 6..10 in epoch 2).
    r.on_output(ColumnFence(SID, 1, 0), None, [], 7)
    assert acks(drain(r)) == [(5, 2)]
    # One of an epoch from before the session's placement (epoch 1 here) releases nothing and
    # is counted as dropped.
    await _hand_on(r, range(6, 9))
    assert acks(drain(r)) == []
    stale = {"reason": "stale_epoch"}
    before = sample("duplex_session_dropped_outputs_total", stale)
    r.on_output(ColumnFence(SID, 0, 0), None, [], 13)
    assert acks(drain(r)) == []
    assert sample("duplex_session_dropped_outputs_total", stale) == before + 1
    r.on_output(ColumnFence(SID, 2, 0), None, [], 13)
    assert acks(drain(r)) == [(8, 2)]


async def test_appends_in_the_old_numbering_are_acked_in_the_epoch_they_belong_to() -> None:
    """Found by tests/test_session_fuzz.py: after the server's own barge-in a client appends on
    in its old numbering until it reads ``audio_cancelled``, then restarts at 1. Those appends
    were acked in the new epoch, so the new epoch's acks went 3, 4, 1, 2 (backwards), and a
    client keeping its acked seq per epoch took seq 1..4 of the new epoch for acked."""
    link = FakeLink()
    r = make_runner(link)
    await _hand_on(r, range(1, 3))
    r.cancel("barge_in")  # turn detection heard the user during a reply: 1 -> 2
    r.cancel("barge_in")  # and again before the client read either: 2 -> 3
    await _hand_on(r, range(3, 5))  # sent before the client saw audio_cancelled
    await _hand_on(r, range(1, 3))  # it restarted at 1
    evs = drain(r)
    assert acks(evs) == [(1, 1), (2, 1), (3, 1), (4, 1), (1, 3), (2, 3)]
    # All of it was input of the current epoch for the worker, its seqs going on.
    assert [(s.fence.epoch, s.seq) for s in link.subs[-4:]] == [(3, 3), (3, 4), (3, 5), (3, 6)]
    # Another cancel: seq 3 carries on the numbering the client started in epoch 3.
    r.cancel("response_cancel")
    await _hand_on(r, range(3, 4))
    assert acks(drain(r)) == [(3, 3)]


async def test_a_lost_worker_or_a_rejected_append_never_leaves_acks_held() -> None:
    link = FakeLink()
    r = make_runner(link, turn_failover=False, **HOLD)
    await _hand_on(r, range(1, 6))
    assert acks(drain(r)) == [(1, 1), (2, 1), (3, 1)]
    r.on_worker_lost(link)  # type: ignore[arg-type]
    evs = drain(r)
    assert acks(evs) == [(5, 1)] and kinds(evs)[-1] == "error" and r.unconsumed_frames == 0

    link2 = FakeLink()
    r2 = make_runner(link2, **HOLD)
    await _hand_on(r2, range(1, 6))
    drain(r2)
    # The worker refused an APPEND (it will never be consumed): stop waiting for it.
    err = worker_pb2.WorkerError(code="capacity", message="queue full")
    r2.on_output(None, None, [step_update(1, 0, error=err)])
    evs = drain(r2)
    assert acks(evs) == [(5, 1)]
    assert [e.error.code for e in evs if e.HasField("error")] == ["capacity_exhausted"]


async def test_acks_are_never_held_when_the_bound_is_off() -> None:
    link = FakeLink()
    r = make_runner(link, max_unconsumed_input_ms=0)
    await _hand_on(r, range(1, 41))
    assert acks(drain(r)) == [(s, 1) for s in range(1, 41)]


class _HoldingLink(FakeLink):
    """Writes stay in flight until the test fails them (a worker lost mid-write)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[asyncio.Future[None]] = []

    def submit(self, subs, *, prompt=False):  # type: ignore[no-untyped-def]
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.subs.extend(subs)
        self.in_flight.append(fut)
        return fut


async def test_a_silence_frame_lost_with_its_worker_reports_the_loss_once() -> None:
    clock = ManualClock()
    link = _HoldingLink()
    r = make_runner(link, clock=clock, turn_failover=False)
    r.on_output(None, None, [step_update(1, 0, turn_ended=True, committed_samples=8000)])
    await settle()
    await clock.advance(0.150, step=0.004)  # one silence frame is being written ...
    assert [s.kind for s in link.subs] == [
        worker_pb2.SUBMISSION_KIND_RESPOND,
        worker_pb2.SUBMISSION_KIND_APPEND,
    ]
    drain(r)
    # ... when the worker goes away: the link tells the sessions first, then fails the writes.
    link.healthy = False
    r.on_worker_lost(link)  # type: ignore[arg-type]
    for fut in link.in_flight:
        fut.set_exception(ConnectionError("worker went away"))
    await settle()
    evs = drain(r)
    assert kinds(evs) == ["response_done", "error"], kinds(evs)
    assert evs[0].response_done.status == session_pb2.RESPONSE_STATUS_FAILED
    assert evs[1].error.code == "worker_unavailable"


@pytest.mark.parametrize("append_ms", [10, 20, 40, 60])
async def test_no_silence_is_fed_while_the_client_keeps_real_time_in_any_append_size(append_ms: int) -> None:
    """A client streaming at real time, whatever its append size, gets no silence between its
    appends: the worker's input timeline is the client's own (no drift), and the reply is paced
    by the client's audio alone."""
    clock = ManualClock()
    link = FakeLink()
    r = make_runner(link, clock=clock)
    await start_response(r)
    pcm = b"\x10\x00" * (16 * append_ms)  # 16 kHz s16 mono
    sent_s = 0.0
    seq = 0
    while sent_s < 3.0:  # 3 s of audio, each append arriving when it has been spoken
        seq += 1
        await clock.advance(append_ms / 1000, step=0.002)
        await r.post(append(seq, pcm))
        sent_s += append_ms / 1000
    await settle()
    frames = [s for s in link.subs if s.kind == worker_pb2.SUBMISSION_KIND_APPEND]
    assert frames and all(any(s.pcm) for s in frames), "silence was fed between real-time appends"
    handed_on = sum(len(s.pcm) for s in frames) // 2
    assert abs(handed_on - round(sent_s * 16000)) < 512  # the worker's position is the client's


async def test_silence_keeps_a_reply_at_real_time_once_the_client_goes_quiet() -> None:
    clock = ManualClock()
    link = FakeLink()
    r = make_runner(link, clock=clock)
    await start_response(r)
    for seq in range(1, 26):  # 1 s of 40 ms appends at real time
        await clock.advance(0.040, step=0.004)
        await r.post(append(seq, b"\x10\x00" * 640))
    await settle()
    n = len(link.subs)
    await clock.advance(2.0, step=0.004)  # then nothing from the client for 2 s
    silence = [s for s in link.subs[n:] if s.kind == worker_pb2.SUBMISSION_KIND_APPEND]
    assert all(not any(s.pcm) for s in silence)
    # Real time, less the allowance it waits before feeding (100 ms, two 40 ms appends' worth).
    assert abs(len(silence) * 0.032 - (2.0 - 0.1)) <= 0.064, len(silence)


def _watched_feeder(
    clock: ManualClock, timeline: InputTimeline
) -> tuple[SilenceFeeder, list[float], list[float]]:
    """A started feeder of 32 ms frames on ``timeline`` whose every look (``due_in``) and every
    silence frame it asks for are recorded (a frame asked for is fed at once)."""
    looks: list[float] = []
    requests: list[float] = []

    def due_in() -> float:
        looks.append(clock.now())
        return timeline.silence_due_in(clock.now(), 0.032)

    def request() -> bool:
        requests.append(clock.now())
        timeline.silence(clock.now(), 0.032)
        feeder.fed()
        return True

    feeder = SilenceFeeder(period_s=0.032, max_frames=1000, clock=clock, due_in=due_in, request=request)
    feeder.start()
    return feeder, looks, requests


async def test_the_silence_feeder_does_not_wake_every_frame_while_the_client_keeps_up() -> None:
    """While appends keep the input timeline at real time the feeder sleeps until the moment
    silence would be due (each append moves it on): a few looks per second, not one per frame;
    once the client goes quiet it feeds a frame each period."""
    clock = ManualClock()
    timeline = InputTimeline(clock.now())
    feeder, looks, requests = _watched_feeder(clock, timeline)
    try:
        for _ in range(50):  # 1 s of 20 ms appends at real time
            await clock.advance(0.020, step=0.002)
            timeline.client(0.020, clock.now())
        assert requests == []
        assert len(looks) <= 15, len(looks)  # about one per 84 ms, where a per-frame tick is 31
        quiet_from = clock.now()
        await clock.advance(1.0, step=0.002)
        assert requests and requests[0] - quiet_from <= 0.1  # due after the 100 ms allowance
        assert abs(len(requests) - (1.0 - 0.1) / 0.032) <= 2, len(requests)
    finally:
        feeder.stop()


async def test_a_client_that_was_behind_is_current_again_with_its_next_append() -> None:
    """A client that starts streaming late (or pauses) gets silence while it is quiet; once it
    streams at real time again it gets none between its appends, and the feeder goes back to a
    few looks per second (a gap kept from before would leave the timeline at the allowance's
    edge: a look every frame, and silence slipped in between live appends on any jitter)."""
    clock = ManualClock()
    timeline = InputTimeline(clock.now())
    feeder, looks, requests = _watched_feeder(clock, timeline)
    try:
        await clock.advance(0.5, step=0.002)  # the client starts late: silence meanwhile
        assert requests
        timeline.client(0.020, clock.now())
        fed, looked = len(requests), len(looks)
        for i in range(50):  # then 1 s of 20 ms appends at real time (every other one seen 4 ms late)
            await clock.advance(0.020, step=0.002)
            timeline.client(0.020, clock.now() - 0.004 * (i % 2))
        assert len(requests) == fed, "silence between real-time appends"
        assert len(looks) - looked <= 15, len(looks) - looked
    finally:
        feeder.stop()


# ---- acks carried on output (acks_on_output) ----------------------------------------------------


def carried(events: list[session_pb2.ServerEvent]) -> list[tuple[str, int, int]]:
    """(event kind, seq, epoch) of every ack, standalone or carried."""
    out = []
    for e in events:
        if e.HasField("input_ack"):
            out.append(("input_ack", e.input_ack.seq, e.input_ack.epoch))
        elif e.HasField("carried_ack"):
            out.append((e.WhichOneof("event") or "", e.carried_ack.seq, e.carried_ack.epoch))
    return out


async def _replying_on_carried_acks(link: FakeLink, seqs: range) -> SessionRunner:
    """A runner replying on a stream that reads carried acks (its output so far drained), with the
    appends ``seqs`` handed on to ``link``."""
    r = make_runner(link)
    r.attach_stream(acks_on_output=True)
    await start_response(r)
    drain(r)
    await _hand_on(r, seqs)
    return r


async def test_on_a_stream_that_reads_carried_acks_an_append_is_acked_on_the_output_of_its_step() -> None:
    link = FakeLink()
    r = await _replying_on_carried_acks(link, range(1, 4))
    assert [s.seq for s in link.subs if s.kind == worker_pb2.SUBMISSION_KIND_APPEND] == [1, 2, 3]
    assert carried(drain(r)) == []  # handed on, not consumed yet: no ack
    # The step that consumed 1 and 2 made a reply frame: the ack (of 2, covering 1) rides on it.
    r.on_output(
        Fence(SID, 1, r.turn_id).to_proto(),
        common_pb2.AudioPayload(pcm=FRAME),
        [step_update(1, r.turn_id, input_seq=2)],
    )
    evs = drain(r)
    assert kinds(evs) == ["audio_delta"] and carried(evs) == [("audio_delta", 2, 1)]
    # A step that consumed 3 with no output of the session: the ack goes alone, at once.
    r.on_output(None, None, [step_update(1, r.turn_id, input_seq=3)])
    assert carried(drain(r)) == [("input_ack", 3, 1)]
    # A resumed stream that does not read carried acks gets held acks as events again, at hand-on.
    await _hand_on(r, range(4, 5))
    assert carried(drain(r)) == []
    r.attach_stream(acks_on_output=False)
    assert carried(drain(r)) == [("input_ack", 4, 1)]
    await _hand_on(r, range(5, 6))
    assert carried(drain(r)) == [("input_ack", 5, 1)]


async def test_a_carried_ack_never_rides_on_audio_of_another_epoch_and_is_not_lost() -> None:
    r = await _replying_on_carried_acks(FakeLink(), range(1, 3))
    turn = r.turn_id
    # The news of epoch 1 consumed 2; the step's audio is for a fence the session left (stale).
    r.on_output(
        Fence(SID, 0, turn).to_proto(),
        common_pb2.AudioPayload(pcm=FRAME),
        [step_update(1, turn, input_seq=2)],
    )
    evs = drain(r)
    assert carried(evs) == [("input_ack", 2, 1)]  # alone: the audio was dropped, the ack was not
    assert "audio_delta" not in kinds(evs)


async def test_the_silence_feeder_notices_the_allowance_shrink_after_a_large_append() -> None:
    """A large append widens the allowance; the small ones after it shrink it again, which brings
    the moment silence is due forward while the feeder sleeps: it must not oversleep it."""
    clock = ManualClock()
    timeline = InputTimeline(clock.now())
    requests: list[float] = []

    def request() -> bool:
        requests.append(clock.now())
        timeline.silence(clock.now(), 0.032)
        feeder.fed()
        return True

    feeder = SilenceFeeder(
        period_s=0.032,
        max_frames=1000,
        clock=clock,
        due_in=lambda: timeline.silence_due_in(clock.now(), 0.032),
        request=request,
    )
    feeder.start()
    try:
        for _ in range(10):
            await clock.advance(0.020, step=0.002)
            timeline.client(0.020, clock.now())
        timeline.client(0.300, clock.now())  # one 300 ms append, at once: allowance 600 ms
        await clock.advance(0.100, step=0.002)
        timeline.client(0.020, clock.now())  # a small one: allowance back to 100 ms
        due = timeline.covered + timeline.allowance - 0.016
        await clock.advance(2.0, step=0.002)
        assert requests, "no silence at all"
        assert due <= requests[0] <= due + 0.1 + 0.004, (requests[0], due)  # within one look of due
    finally:
        feeder.stop()


async def test_a_stream_that_stops_reading_carried_acks_gets_the_latest_one_again() -> None:
    r = await _replying_on_carried_acks(FakeLink(), range(1, 3))
    r.on_output(
        Fence(SID, 1, r.turn_id).to_proto(),
        common_pb2.AudioPayload(pcm=FRAME),
        [step_update(1, r.turn_id, input_seq=2)],
    )
    # Not read yet: the ack of 2 rides on that audio. A resumed stream that does not read
    # carried acks is attached: it must still learn of 2.
    r.attach_stream(acks_on_output=False)
    evs = drain(r)
    assert ("input_ack", 2, 1) in carried(evs), carried(evs)
    await _hand_on(r, range(3, 4))
    assert carried(drain(r)) == [("input_ack", 3, 1)]


class _PromptLink(FakeLink):
    """Records the ``prompt`` flag of each submission it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[tuple[int, bool]] = []

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        self.prompts.extend((s.kind, prompt) for s in subs)
        return super().submit(subs)


@pytest.mark.parametrize("acks_on_output", [False, True])
async def test_input_is_written_promptly_only_for_a_client_that_takes_its_acks_once_written(
    acks_on_output: bool,
) -> None:
    # A client reading plain input_acks hears of an append once it is written: the link is to
    # write it at its next write point. One reading acks carried on output hears of it only once
    # the model consumed it: its input waits for the tick's one command.
    link = _PromptLink()
    r = make_runner(link)
    r.attach_stream(acks_on_output=acks_on_output)
    await _hand_on(r, range(1, 3))
    await r.post(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
    await settle()
    kinds_sent = {kind for kind, _ in link.prompts}
    assert {worker_pb2.SUBMISSION_KIND_APPEND, worker_pb2.SUBMISSION_KIND_COMMIT} <= kinds_sent
    assert all(prompt is not acks_on_output for _, prompt in link.prompts), link.prompts
