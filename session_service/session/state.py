"""One session's state and its synchronous transitions, with no I/O of its own.

``SessionState`` holds what a session is (settings, epoch, turn, the statuses of
``session_service.session.lifecycle``, the active response, the ack window, the replay log, the
worker it is bound to) and the transitions that run without awaiting anything: options becoming
pending, acks reset, the epoch advance (a cancel, a placement that granted a higher epoch), a
turn commit, a response begun and finished, the close. Each of these invariants is written once,
here. It queues events through ``emitter`` and tells its worker synchronously (``abort``,
``release``), but never awaits: the asyncio shell (``session_service.session.runner``) does the
I/O, through the hooks at the end of the class. The layers above it: ``failover`` (binding,
replay, restart, recover), ``client_events``, ``runner`` (the mailbox, the deadlines, dispatch).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from duplex.clock import Clock
from duplex.errors import BadEventError, DuplexError, ErrorCode
from duplex.fence import Fence
from duplex.v1 import session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.metrics import WORKER_SESSIONS
from session_service.plugin import Capabilities, DuplexModelPlugin, SessionSettings
from session_service.session.ack_window import AckWindow
from session_service.session.emitter import Emitter
from session_service.session.lifecycle import (
    ENDED_FOR_GOOD,
    CloseReason,
    InputStatus,
    OptionsStatus,
    SeqStatus,
    SessionStatus,
    TurnStatus,
)
from session_service.session.outbound import Outbound
from session_service.session.replay import Marker, ReplayLog
from session_service.session.response import ActiveResponse, InputTimeline
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import SessionProgress

if TYPE_CHECKING:
    import asyncio

COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
FAILED = session_pb2.RESPONSE_STATUS_FAILED
INTERRUPTED = session_pb2.RESPONSE_STATUS_INTERRUPTED
ACTIVE = session_pb2.RESPONSE_STATUS_UNSPECIFIED
"""A response that has not ended (in ``last_response``)."""
Status: TypeAlias = session_pb2.ResponseStatus.ValueType


class WorkerHandle(Protocol):
    """The runner's view of the worker its session is placed on (a ``WorkerLink``)."""

    address: str
    worker_id: str | None  # the worker's own id (Describe), named in resume tokens; None: unknown

    @property
    def healthy(self) -> bool: ...

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        """Queue submissions; the future resolves once they are written to the Run stream.
        ``prompt``: the client hears of them once written (an ``input_ack``): the link writes
        them at its next write point, not only once a tick."""
        ...

    def abort(self, abort: worker_pb2.Abort) -> None: ...

    def release(self, release: worker_pb2.Release) -> None: ...


#: (session_id, epoch, takeover) -> (worker, granted epoch); raises a DuplexError.
Placer = Callable[[str, int, bool], Awaitable[tuple[WorkerHandle, int]]]


@dataclass(slots=True)
class Restart:
    """A response to start again for its turn (its worker or replica was lost mid-reply)."""

    turn_id: int
    params: dict[str, Any] | None
    """Its per-response options (``response_create.extra_body``), if any."""
    mark: Marker | None
    """The commit point of the input it answers, in the replay log."""
    cause: str
    """"worker_lost" or "resumed" (the metric label)."""


class SessionState:
    """One session's state and synchronous transitions (``SessionRunner`` is the shell)."""

    def __init__(
        self,
        *,
        session_id: str,
        settings: SessionSettings,
        runtime_config: dict[str, object],
        link: WorkerHandle | None,
        epoch: int,
        resume_token: str,
        plugin: DuplexModelPlugin,
        capabilities: Capabilities,
        config: RunnerConfig,
        placer: Placer,
        clock: Clock,
        issue_token: Callable[[], str],
        principal: str = ANONYMOUS,
        progress: SessionProgress | None = None,
        restart_interrupted: bool = False,
    ) -> None:
        """``progress``: where a session taken over from another replica had got (its token's),
        so turn and event numbering continue; ``restart_interrupted``: the worker it was placed
        on still holds its model state, so a response the token says was running restarts."""
        self.session_id = session_id
        self.principal = principal
        """Who opened the session: only they may resume it."""
        self.settings = settings
        self.runtime_config = runtime_config
        self.epoch = epoch
        self.turn_id = 0
        self.resume_token = resume_token
        self._plugin = plugin
        self._caps = capabilities
        self._cfg = cfg = config
        self._placer = placer
        self._clock = clock
        self._issue_token = issue_token
        self.state = plugin.create_session_state(settings)
        self._sampling = plugin.configure_sampling_params(
            runtime_config=runtime_config, defaults=plugin.sampling_defaults
        )
        self.status = SessionStatus.OPEN
        self.close_reason: CloseReason | None = None
        """Why the session closed (None while open)."""
        self.input_status = InputStatus.OPEN
        self.turn_status = TurnStatus.LISTENING
        self.seq_status = SeqStatus.IN_EPOCH
        self._seq_epoch = epoch
        """The epoch the client's append numbering belongs to: it restarts at 1 only once the
        client has seen ``audio_cancelled``, so appends it sent before carry on the old one (and
        are acked in that epoch: acks never go backwards within an epoch)."""
        self.options_status = OptionsStatus.PENDING  # the first submission carries them
        self.response: ActiveResponse | None = None
        self.link: WorkerHandle | None = None
        self.input_epoch = epoch
        """Where the worker's input began (its placement): news of it stepped under an epoch a
        cancel left since counts (a cancel aborts the reply, not the input: ``keep_input``)."""
        self._bind(link)
        self.outbound = Outbound(
            lambda: self.epoch, limit=cfg.outbound_limit, limit_bytes=cfg.max_buffer_bytes
        )
        self.emitter = Emitter(self.outbound, self._clock, coalesce_acks=cfg.coalesce_acks)
        self._detached_at: float | None = None
        """When the client's stream ended without close (None while a stream is attached)."""
        self._on_slow_consumer: Callable[[], None] | None = None
        self._last_seq = 0
        self._worker_seq = 0
        self._last_client = self._commit_at = self._clock.now()
        self._timeline = InputTimeline(self._clock.now())
        """How far the client's audio covers real time (silence is fed only once it falls behind)."""
        self._frame_bytes = plugin.frame_samples * plugin.worker_format.frame_bytes
        self._silence_frame = b"\x00" * self._frame_bytes
        self._frame_period = plugin.frame_samples / plugin.worker_format.sample_rate_hz
        self.acks = AckWindow(hold_ms=cfg.max_unconsumed_input_ms, frame_ms=1000.0 * self._frame_period)
        self._fence_cache = Fence(session_id, epoch, 0)
        self._replayable = plugin.replayable and cfg.turn_failover
        wfmt = plugin.worker_format
        window = int(plugin.replay_window_s * wfmt.sample_rate_hz) * wfmt.frame_bytes
        self.replay = ReplayLog(
            max_bytes=max(self._frame_bytes, min(window, cfg.max_buffer_bytes)) if self._replayable else 0
        )
        """The current turn's input, kept to rebuild it on another worker (``session.replay``)."""
        self._restart: Restart | None = None
        """A response interrupted by the loss of its worker (or replica), to restart for its turn."""
        self._left: list[WorkerHandle] = []
        """The workers the session was lost from since it was last placed (its turn's input is
        replayed elsewhere: what they hold of it is reconciled when they are back)."""
        self._stale: list[WorkerHandle] = []
        """Workers that hold model state of a turn given up (``_give_up_turn``): released before
        the session is placed again (``_release_stale``)."""
        self.last_response: tuple[str, int, int] | None = None
        """(response id, turn id, ``ResponseStatus``; ACTIVE while it runs) of the last response."""
        if progress is not None:
            self.turn_id = progress.turn_id
            self.outbound.numbered = progress.events
            if progress.last_response_id:
                status = progress.last_response_status
                if status == ACTIVE:
                    # It had not ended when the replica streaming it was lost.
                    status = INTERRUPTED
                    if self._replayable and restart_interrupted:
                        # The worker still holds the committed input (the token named it).
                        self._restart = Restart(progress.turn_id, None, None, "resumed")
                self.last_response = (progress.last_response_id, progress.turn_id, status)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.status is SessionStatus.CLOSED

    @property
    def unconsumed_frames(self) -> int:
        """Worker frames handed on in this epoch that the worker has not reported consumed."""
        return self.acks.unconsumed

    def _last_response_proto(self) -> session_pb2.LastResponse | None:
        if self.last_response is None:
            return None
        response_id, turn_id, status = self.last_response
        return session_pb2.LastResponse(
            response_id=response_id, turn_id=turn_id, status=session_pb2.ResponseStatus.ValueType(status)
        )

    def progress(self) -> SessionProgress:
        """How far the session has got (what its resume token records)."""
        response_id, _, status = self.last_response or ("", 0, ACTIVE)
        return SessionProgress(
            turn_id=self.turn_id,
            # A token goes out in an event numbered after it was made: at most this.
            events=self.outbound.next_ids_at_most(),
            last_response_id=response_id,
            last_response_status=int(status),
        )

    def _idle_timeout_s(self) -> float:
        # A client may shorten the operator's idle timeout, never extend it: an abandoned
        # session must not pin capacity longer than the operator allows.
        return float(min(self.settings.idle_timeout_s or self._cfg.idle_timeout_s, self._cfg.idle_timeout_s))

    def _error(self, err: DuplexError, event_id: str = "") -> None:
        self._safely(lambda: self.emitter.error(err, event_id))

    def _safely(self, emit: Callable[[], None]) -> None:
        """Emit; a client that stopped reading is closed then."""
        emit()
        self._check_overflow()

    def _check_overflow(self) -> bool:
        """Whether the client stopped reading (its queue overflowed): the session is closed
        then (``slow_consumer``). Checked once per item the session handles."""
        if self.outbound.overflowed and not self.closed:
            self._close(CloseReason.SLOW_CONSUMER)
        return self.closed

    # ---- options, acks, the epoch (each written once) ---------------------------------------

    def apply_runtime(self, runtime: dict[str, object]) -> None:
        """New runtime config: the worker gets the session's options with the next submission."""
        self.runtime_config = runtime
        self._sampling = self._plugin.configure_sampling_params(
            runtime_config=runtime, defaults=self._plugin.sampling_defaults
        )
        self._options_pending()

    def _options_pending(self) -> None:
        """The worker is to get the session's model options with the next submission (an update,
        a new placement, a write that may not have carried them, a response's own options)."""
        self.options_status = OptionsStatus.PENDING

    def reset_acks(self) -> None:
        """Nothing handed on is awaited any more (cancel, a new or lost placement, a refused
        submission): the acks held for it go out now."""
        self.emitter.acks(self.acks.reset())

    def _advance_epoch(self, epoch: int) -> int:
        """The one epoch transition (cancel, a placement that granted a higher epoch): the client
        may restart its appends at seq 1, output of older epochs still queued is purged; worker
        seqs go on (a cancel keeps the worker's input). Returns the epoch left."""
        old, self.epoch = self.epoch, epoch
        self.seq_status = SeqStatus.RESTART_ALLOWED
        self.outbound.purge_before(epoch)
        return old

    def _take_options(self) -> dict[str, Any] | None:
        """The session's model options, if the worker does not have them yet."""
        if self.options_status is OptionsStatus.CURRENT:
            return None
        self.options_status = OptionsStatus.CURRENT
        return self._plugin.worker_params(
            settings=self.settings, runtime_config=self.runtime_config, sampling=self._sampling
        )

    def _fence(self) -> Fence:
        f = self._fence_cache
        if f.epoch != self.epoch or f.turn_id != self.turn_id:
            f = self._fence_cache = Fence(self.session_id, self.epoch, self.turn_id)
        return f

    def _handed_on(self, link: WorkerHandle, wseq: int, frames: int) -> None:
        """An APPEND of ``frames`` worker frames was written under worker seq ``wseq``."""
        if self.link is link:  # else its worker is gone (and with it the input): nothing to wait for
            self.acks.handed_on(wseq, frames)

    def _bind(self, link: WorkerHandle | None) -> None:
        if self.link is not None:
            WORKER_SESSIONS.labels(worker=self.link.address).dec()
        self.link = link
        if link is not None:
            WORKER_SESSIONS.labels(worker=link.address).inc()
            self.input_epoch = self.epoch

    # ---- turns and responses ---------------------------------------------------------------

    def _committed(self, at: float, samples: int) -> None:
        self._emit_committed(self._turn_committed(at), samples)

    def _turn_committed(self, at: float) -> int:
        """The transition of a commit; returns the id the committed turn's response will have."""
        self.turn_status = TurnStatus.COMMITTED
        self._commit_at = at
        return self.turn_id + 1

    def _emit_committed(self, turn_id: int, samples: int) -> None:
        audio_ms = samples * 1000 // self._plugin.worker_format.sample_rate_hz
        self.emitter.emit("committed", session_pb2.InputCommitted(turn_id=turn_id, audio_ms=audio_ms))

    def turn_ended(self, committed_samples: int) -> None:
        """The worker's turn detection committed the input; answer it when auto-responding."""
        self.state.input_since_commit_samples = 0
        self.replay.turn_ended()
        self._committed(self._clock.now(), committed_samples)
        if self.settings.turn_detection.auto_respond and self.response is None:
            self._start_response(self._commit_at)

    def _begin_response(
        self, started_at: float, params: dict[str, Any] | None, restart: Restart | None, native: bool = False
    ) -> ActiveResponse:
        """A response starts (``_start_response`` hands it to the worker; a ``native`` one the
        model started itself): the turn is answered and ``response_started`` queued."""
        if self.response is not None:  # never two: one would be orphaned (no response_done)
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        if restart is None:
            self.turn_id += 1
        turn_id = restart.turn_id if restart is not None else self.turn_id
        response_id = f"resp_{uuid.uuid4().hex[:16]}"
        resp = ActiveResponse(
            response_id=response_id,
            turn_id=turn_id,
            epoch=self.epoch,
            proj=self._plugin.data_plane.begin_response(
                response_id=response_id,
                turn_id=turn_id,
                epoch=self.epoch,
                worker_format=self._plugin.worker_format,
                output_format=self.settings.output_format,
            ),
            started_at=started_at,
            params=params,
            mark=restart.mark if restart is not None else self.replay.last_marker(),
            restart=restart is not None,
            native=native,
        )
        self.response = resp
        self._response_active(True)
        self.turn_status = TurnStatus.LISTENING
        self.state.context_locked = True
        self.last_response = (response_id, turn_id, ACTIVE)
        started = resp.started()
        started.resume_token = self._fresh_token()
        self.emitter.emit("response_started", started)
        return resp

    def _end_response(self) -> ActiveResponse | None:
        resp = self.response
        self.response = None
        self._response_active(False)
        if resp is not None:
            resp.stop()
        return resp

    def _response_done(
        self, resp: ActiveResponse, status: Status, reason: str, *, restarting: bool = False
    ) -> None:
        """Emit ``response_done`` for ``resp`` with a fresh token (``restarting``: a restart follows)."""
        self.last_response = (resp.response_id, resp.turn_id, status)
        done = resp.done(status, reason, restarting=restarting)
        done.resume_token = self._fresh_token()
        self.emitter.emit("response_done", done)

    def finish_response(self, status: session_pb2.ResponseStatus.ValueType, reason: str) -> None:
        """End the active response with ``response_done``; a completed one commits the model
        context and, when the user finished another turn meanwhile, answers that one."""
        resp = self._end_response()
        if resp is None:
            return
        # However it ended, the input it answered is no longer needed for a replay.
        self.replay.answered(resp.mark)
        if status == COMPLETED:
            for ev in self._plugin.data_plane.end_response(resp.proj):
                self.emitter.emit_output(ev, resp.epoch)
        self._response_done(resp, status, reason)
        if status == COMPLETED:
            self._plugin.commit_model_context(
                session_id=self.session_id, assistant_text="".join(resp.proj.text)
            )
            if self.turn_status is TurnStatus.COMMITTED and self.settings.turn_detection.auto_respond:
                self._start_response(self._clock.now())

    def cancel(self, reason: str) -> None:
        """Advance the epoch: nothing of the old epoch reaches the client after this returns."""
        resp = self._end_response()
        # The fence moves first, before anything is emitted: even if emitting overflows the
        # outbound queue (the session then closes), no old-epoch audio can follow.
        old = self._advance_epoch(self.epoch + 1)
        self.input_status = InputStatus.OPEN
        if resp is not None:
            self.replay.answered(resp.mark)
        elif self._restart is not None:  # cancelled before its restart: it stays cancelled
            self.replay.answered(self._restart.mark)
            self._restart = None
        self.replay.new_epoch(self.epoch)
        if self.link is not None:
            # The reply goes, the input stays: what the user said that the worker has not heard
            # yet (seconds of it after a move) is heard under the new epoch, acked as it is.
            fence = self._fence().to_proto()
            self.link.abort(
                worker_pb2.Abort(request_id=self.session_id, fence=fence, reason=reason, keep_input=True)
            )
        else:
            self.reset_acks()
        self.emitter.emit(
            "audio_cancelled",
            session_pb2.AudioCancelled(
                response_id=resp.response_id if resp else "",
                cancelled_epoch=old,
                epoch=self.epoch,
                reason=reason,
            ),
        )
        if resp is not None:
            self._response_done(resp, CANCELLED, reason)

    def _moved_to_epoch(self, granted: int) -> None:
        """The new worker granted a higher epoch (it had fenced the session before): the client
        is told as after a cancel (appends restart at seq 1), though nothing of its was cut."""
        old = self._advance_epoch(granted)
        self.input_epoch = granted
        self.emitter.emit(
            "audio_cancelled",
            session_pb2.AudioCancelled(cancelled_epoch=old, epoch=granted, reason="worker_moved"),
        )

    def fenced(self) -> None:
        """Another owner took the session over at its worker (a resume on another replica): this
        replica's stream is told ``closed{resumed_elsewhere}`` at once and the runner ends."""
        self._close(CloseReason.RESUMED_ELSEWHERE)

    # ---- closing ---------------------------------------------------------------------------

    def _close(self, reason: CloseReason) -> None:
        """The session ends: an active response is cancelled, ``closed`` is queued, the worker
        releases the session. (The runner also stops its tasks.)"""
        if self.closed:
            return
        resp = self._end_response()
        if resp is not None:
            self.last_response = (resp.response_id, resp.turn_id, CANCELLED)
            self.emitter.emit("response_done", resp.done(CANCELLED, "session_closed"))
        self.emitter.emit("closed", session_pb2.SessionClosed(reason=reason))
        self.status = SessionStatus.CLOSED
        self.close_reason = reason
        if self.link is not None:
            self.link.release(
                worker_pb2.Release(
                    request_id=self.session_id,
                    fence=self._fence().to_proto(),
                    closed=reason in ENDED_FOR_GOOD,
                )
            )
            self._bind(None)
        # A client that stopped reading does not get its backlog: its memory goes now, and the
        # call ends with slow_consumer (the servicer aborts it).
        self.outbound.close(drop=reason == CloseReason.SLOW_CONSUMER)
        if reason == CloseReason.SLOW_CONSUMER and self._on_slow_consumer is not None:
            self._on_slow_consumer()

    # ---- what the shell does (overridden by ``SessionRunner``) -----------------------------

    def _start_response(
        self, started_at: float, params: dict[str, Any] | None = None, *, restart: Restart | None = None
    ) -> None:
        """Start a response: ``_begin_response``, then hand it to the worker (I/O: the shell's)."""
        raise NotImplementedError

    def _response_active(self, active: bool) -> None:
        """A response began (True) or ended (False)."""

    def _rewatch(self) -> None:
        """A deadline moved closer: the shell's deadline watch starts again from it."""

    def _fresh_token(self) -> str:
        """A resume token that knows the session as it is now (kept as the current one)."""
        self.resume_token = self._issue_token()
        return self.resume_token
