"""Worker output meets the session: every epoch/turn comparison, and why output is dropped.

The router (``session_service.workers.step_routing``) hands each session its share of a worker step
synchronously; ``WorkerOutput.handle`` applies it to the session without awaiting anything, so
a cancel (which also runs without awaiting) and this never interleave. Updates are applied
first (VAD, consumption, turn ends, text), then audio, then completions: a barge-in heard in a
step stops that step's audio from getting out.

Every comparison that decides whether worker output is still the session's is one of the
functions below; every drop is counted in ``duplex_session_dropped_outputs_total{reason}``:

Every rule is written once, here (the outbound queue's last epoch check aside), and listed with
its site in ``docs/worker-protocol.md``:

- ``stale_epoch`` (here, and the outbound queue): output or news of an epoch the session has
  left (cancel, barge-in, takeover), but for news of input a cancel kept (its consumption, VAD
  and turn ends count: ``SessionState.input_epoch``); the rejection that tells a fenced-out
  owner.
- ``stale_turn`` (here): output of an older turn than the session's, or news for a response
  that is no longer active.
- ``response_cancelled`` (here): audio of a turn no response is streaming (yet or any more), or
  output that lost its response between projection and queueing.
- ``wrong_session`` (here): audio whose fence names another session (a mislabelled step is
  never played).
- ``unknown_request`` (here, the router): output for a session this replica does not hold, or
  audio without a batch fence.
- ``stale_worker`` (the router): output from a worker the session is no longer placed on.
- ``purged`` (the outbound queue): queued output of an epoch a cancel left, removed before the
  client read it.
- ``fail_closed`` (the router): payloads of a step whose sparse declaration was invalid (none of
  them routed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

from duplex.clock import Clock
from duplex.errors import BadEventError, ErrorCode, WorkerErrorCode
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.metrics import DROPPED, LATENCY_FIRST_AUDIO
from session_service.plugin import DuplexModelPlugin, OutputAction
from session_service.session.lifecycle import DropReason, SpeechStatus

if TYPE_CHECKING:
    from session_service.session.response import ActiveResponse
    from session_service.session.state import SessionState

log = logging.getLogger(__name__)

SPEECH_STARTED = worker_pb2.VadEvent.KIND_SPEECH_STARTED
SPEECH_STOPPED = worker_pb2.VadEvent.KIND_SPEECH_STOPPED
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
FAILED = session_pb2.RESPONSE_STATUS_FAILED


# Every drop reason (``lifecycle.DropReason``) exists from the start, so rate() alerts see a zero
# series.
for _reason in DropReason:
    DROPPED[_reason]


class StepFence(Protocol):
    """The fence a step's request was stepped under: a batch entry's ``common_pb2.Fence``, or a
    ``ColumnFence`` read from the step's columns (``StepOutput.columns``)."""

    @property
    def session_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def turn_id(self) -> int: ...


class ColumnFence(NamedTuple):
    """A fence read from a step's columns (a tuple: one is made per request per step)."""

    session_id: str
    epoch: int
    turn_id: int


# ---- the rules ----------------------------------------------------------------------------------


def audio_drop_reason(
    fence: StepFence | None,
    *,
    session_id: str,
    epoch: int,
    turn_id: int,
    response: ActiveResponse | None,
) -> DropReason | None:
    """Whether a step's audio for this session may be projected, given the fence it was
    stepped under (the batch entry's); None when it may."""
    if fence is None:
        return DropReason.UNKNOWN_REQUEST
    if fence.epoch != epoch:
        return DropReason.STALE_EPOCH
    if fence.session_id != session_id:
        return DropReason.WRONG_SESSION
    if response is None:
        return DropReason.STALE_TURN if fence.turn_id < turn_id else DropReason.RESPONSE_CANCELLED
    if fence.turn_id != response.turn_id and not response.native:
        return DropReason.STALE_TURN if fence.turn_id < turn_id else DropReason.RESPONSE_CANCELLED
    return None


def belongs_to(fence: StepFence, response: ActiveResponse | None) -> bool:
    """Text and rejections of the active response's turn are its own (a model-native span's
    output carries the fences of the input that clocked it: its epoch is what fences it)."""
    return response is not None and (response.native or fence.turn_id == response.turn_id)


def barges_in(fence: common_pb2.Fence, response: ActiveResponse | None, *, enabled: bool) -> bool:
    """Speech interrupts the active response only when it was heard in input appended under the
    response's turn (the APPEND's fence says which): speech the worker finds in older, still
    queued input (a fast client's commit) is the turn being answered, not a barge-in."""
    return enabled and response is not None and fence.turn_id >= response.turn_id


#: Client codes of a worker's per-request error that trying again may cure.
RETRYABLE: Final = frozenset({ErrorCode.UPSTREAM_UNAVAILABLE.value})


def client_code(worker_code: str) -> str:
    """The code a client sees for a worker's per-request error (``WorkerErrorCode``): the ones a
    client can act on pass through, a full input queue is ``capacity_exhausted``, and anything
    else is the model's failure as far as the client is concerned."""
    if worker_code in (
        WorkerErrorCode.NO_COMMITTED_INPUT,
        WorkerErrorCode.MODEL_ERROR,
        WorkerErrorCode.UPSTREAM_UNAVAILABLE,
    ):
        return worker_code
    if worker_code == WorkerErrorCode.CAPACITY:
        return ErrorCode.CAPACITY_EXHAUSTED.value
    return ErrorCode.MODEL_ERROR.value


# ---- applying one step's news ---------------------------------------------------------------------


class WorkerOutput:
    """Applies worker steps to one session; owns what the client was told of its speech."""

    def __init__(self, session: SessionState, plugin: DuplexModelPlugin, clock: Clock) -> None:
        self._session = session
        self._plugin = plugin
        self._clock = clock
        self._rate = plugin.worker_format.sample_rate_hz
        self._frame_bytes = plugin.worker_format.frame_bytes
        self.speech = SpeechStatus.SILENT

    def handle(
        self,
        fence: StepFence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
        input_seq: int = 0,
    ) -> None:
        """One step's news for this session: its ack and updates first, then audio, then
        completions. ``input_seq``: the input the step consumed, from the step's columns (the
        row form carries it in an update). Acks ride on the first event queued after them (the
        step's audio, usually), on a stream that reads them there; else they go alone."""
        try:
            if input_seq and fence is not None:
                if fence.epoch < self._session.input_epoch and not updates:
                    DROPPED[DropReason.STALE_EPOCH].inc()  # with updates, ``_news`` counts them
                self._consumed(fence.epoch, input_seq)
            live = [u for u in updates if self._news(u)]
            if payload is not None:
                self._audio(fence, payload)
            for u in live:
                self._terminal(u)
        finally:
            self._session.emitter.flush_acks()

    def end_speech(self) -> None:
        """Close an open speech span (the VAD that heard it is gone, or the turn ended), so
        ``speech_started`` / ``speech_stopped`` stay paired."""
        if self.speech is SpeechStatus.SPEAKING:
            self.speech = SpeechStatus.SILENT
            self._session.emitter.emit("speech_stopped", session_pb2.SpeechStopped(audio_ms=0))

    def _news(self, u: worker_pb2.RequestUpdate) -> bool:
        """Non-terminal news; returns whether the update is current (not fenced off)."""
        s = self._session
        if u.HasField("error"):
            self._worker_error(u)
            return False
        # News of input stepped under an epoch a cancel left still counts (the cancel kept the
        # input: what the user said goes on being heard); nothing of a reply of that epoch does.
        input_only = u.fence.epoch < s.epoch
        if u.fence.epoch < s.input_epoch:  # news of an epoch the session has left
            DROPPED[DropReason.STALE_EPOCH].inc()
            return False
        if u.input_seq:
            self._consumed(u.fence.epoch, u.input_seq)
        for vad in u.vad:
            if vad.kind == SPEECH_STARTED:
                self.speech = SpeechStatus.SPEAKING
                s.emitter.emit(
                    "speech_started",
                    session_pb2.SpeechStarted(audio_ms=vad.sample_offset * 1000 // self._rate),
                )
                if (
                    barges_in(u.fence, s.response, enabled=s.settings.turn_detection.barge_in)
                    and not s.draining()
                ):
                    s.cancel("barge_in")
            elif vad.kind == SPEECH_STOPPED and self.speech is SpeechStatus.SPEAKING:
                self.speech = SpeechStatus.SILENT
                s.emitter.emit(
                    "speech_stopped",
                    session_pb2.SpeechStopped(audio_ms=vad.sample_offset * 1000 // self._rate),
                )
        if u.response_started and not input_only and self._plugin.model_native and s.response is None:
            # The model starts speaking on its own: its span is a response (before this step's text
            # and audio).
            s._begin_response(self._clock.now(), None, None, native=True)
        if u.text:
            resp = s.response
            if resp is not None and not input_only and belongs_to(u.fence, resp):
                for ev in self._plugin.data_plane.project_text(resp.proj, u.text):
                    self._queue(ev, resp)
            else:
                DROPPED[DropReason.STALE_TURN].inc()
        if u.user_text:  # the user's words as they are recognized (input news: a cancel keeps them)
            s.emitter.emit("transcript_delta", session_pb2.TranscriptDelta(role="user", text=u.user_text))
        transcript = u.user_transcript if u.HasField("user_transcript") else None
        if u.turn_ended:
            self.end_speech()
            s.turn_ended(u.committed_samples, transcript)
        elif transcript is not None:  # a COMMIT's answer
            s.transcribed(transcript)
        if input_only:
            if u.response_started or u.response_finished:
                DROPPED[DropReason.STALE_EPOCH].inc()
            return False
        patch = self._plugin.runtime_config_after_model_output(s.runtime_config, u)
        if patch:
            s.apply_runtime(dict(s.runtime_config) | patch)
        return True

    def _consumed(self, epoch: int, input_seq: int) -> None:
        """The worker consumed the input of ``epoch`` up to ``input_seq``: if that is input the
        session's worker holds now (its epoch, or one a cancel left: the cancel kept the input,
        whose seqs go on), acks, and the replay log trimmed (either form of a step, rows or
        columns, comes here)."""
        s = self._session
        if epoch >= s.input_epoch:
            s.replay.consumed(epoch=s.epoch, seq=input_seq)
            s.emitter.acks(s.acks.consumed(input_seq), ride=True)

    def _audio(self, fence: StepFence | None, payload: common_pb2.AudioPayload) -> None:
        s = self._session
        resp = s.response
        reason = audio_drop_reason(
            fence, session_id=s.session_id, epoch=s.epoch, turn_id=s.turn_id, response=resp
        )
        if reason is not None:
            DROPPED[reason].inc()
            return
        assert resp is not None  # audio_drop_reason checked it
        sent = False
        for ev in self._plugin.data_plane.project_audio(resp.proj, payload):
            sent = self._queue(ev, resp) or sent
        resp.audio_samples += len(payload.pcm) // self._frame_bytes
        if sent and not resp.first_audio:
            resp.first_audio = True
            LATENCY_FIRST_AUDIO.observe(self._clock.now() - resp.started_at)

    def _queue(self, event: session_pb2.ServerEvent, resp: ActiveResponse) -> bool:
        s = self._session
        # The last-moment check: still the active response, of the current epoch, of an open session.
        if s.response is not resp or resp.epoch != s.epoch or s.closed:
            DROPPED[DropReason.RESPONSE_CANCELLED].inc()
            return False
        s.emitter.emit_output(event, resp.epoch)
        return True

    def _terminal(self, u: worker_pb2.RequestUpdate) -> None:
        s = self._session
        resp = s.response
        # A completion or failure ends the active response only with its turn and epoch.
        if resp is None or not belongs_to(u.fence, resp) or u.fence.epoch != resp.epoch:
            if u.response_finished:
                DROPPED[DropReason.STALE_TURN].inc()
            return
        decision = self._plugin.decide_output(u)
        if decision is not None and decision.action == OutputAction.COMPLETE:
            s.finish_response(COMPLETED, "")
        elif decision is not None and decision.action == OutputAction.FAIL:
            s.finish_response(FAILED, decision.reason)

    def _worker_error(self, u: worker_pb2.RequestUpdate) -> None:
        s = self._session
        code = u.error.code
        if u.fence.epoch < s.epoch:
            DROPPED[DropReason.STALE_EPOCH].inc()
            return
        if code in (WorkerErrorCode.NOT_OWNER, WorkerErrorCode.STALE_EPOCH):
            # Our current epoch was refused: another replica took the session over. Fail closed:
            # the session ends here (closed{resumed_elsewhere}).
            DROPPED[DropReason.STALE_EPOCH].inc()
            s.fenced()
            return
        # A rejected submission (an APPEND refused for capacity, say) is never consumed: stop
        # waiting for it rather than hold acks for ever.
        s.reset_acks()
        if belongs_to(u.fence, s.response):
            s.finish_response(FAILED, code or ErrorCode.MODEL_ERROR.value)
        s.emitter.error(
            BadEventError(
                client_code(code), u.error.message or code, retryable=client_code(code) in RETRYABLE
            )
        )
