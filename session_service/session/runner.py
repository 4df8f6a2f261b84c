"""One runner per session: the ordered mailbox, the client's events, the fence, the worker binding.

Client events are processed strictly in order by one asyncio task consuming a bounded
mailbox. Worker outputs arrive from the router synchronously (``on_output``, applied by
``session_service.session.worker_output``) and are checked against the fence and queued for the client
without any await in between; a cancel (which also runs without awaiting) advances the epoch
and purges the session's one outbound queue in one go, so no audio of a cancelled epoch or an
older turn can reach the client after ``audio_cancelled``.

The parts it is built from, each in its own module: wire settings (``settings``), the input-ack
window (``ack_window``), the active response and its silence feeder (``response``), worker
output handling and the drop-reason table (``worker_output``), event numbering and queueing
(``emitter``), and the status enums (``lifecycle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from duplex.audio import F32LE, PcmFormat
from duplex.clock import MONOTONIC, Clock
from duplex.errors import BadEventError, DuplexError, ErrorCode, InternalError, UnavailableError
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.metrics import (
    DROPPED,
    EVENTS_IN,
    FAILOVERS,
    MAILBOX_FULL,
    REPLAYED_FRAMES,
    RESTARTED_RESPONSES,
    SILENCE_FRAMES,
    WORKER_SESSIONS,
)
from session_service.plugin import (
    Capabilities,
    DuplexModelPlugin,
    FramePacketizer,
    ReplayStep,
    SessionSettings,
)
from session_service.session.ack_window import Ack, AckWindow
from session_service.session.emitter import Emitter
from session_service.session.lifecycle import (
    InputStatus,
    OptionsStatus,
    SeqStatus,
    SessionStatus,
    TurnStatus,
)
from session_service.session.mailbox import Mailbox
from session_service.session.outbound import Outbound, OutboundOverflow
from session_service.session.replay import Marker, ReplayLog
from session_service.session.response import ActiveResponse, InputTimeline, SilenceFeeder
from session_service.session.settings import settings_from_proto, struct_to_dict
from session_service.session.worker_output import DropReason, WorkerOutput
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import SessionProgress

log = logging.getLogger(__name__)

RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
FAILED = session_pb2.RESPONSE_STATUS_FAILED
INTERRUPTED = session_pb2.RESPONSE_STATUS_INTERRUPTED
ACTIVE = session_pb2.RESPONSE_STATUS_UNSPECIFIED
"""A response that has not ended (in ``last_response``)."""
#: Frames per APPEND of a replay (a replay is many frames; one message per frame would be waste).
REPLAY_APPEND_FRAMES = 64
#: How long a session that lost its worker keeps trying to place itself on another before the
#: interrupted turn is given up (a few tries: links come back, the pool re-resolves).
RECOVER_DELAYS_S = (0.0, 0.2, 0.5, 1.0)
#: The longest the runner goes without looking at its deadlines (idle, detached, a submission's
#: write) when none falls due sooner. They are looked at by one task per session, not by a timer
#: armed for every event: a submission that is not written in ``submit_timeout_s`` fails within
#: this much more.
DEADLINE_LOOK_S = 1.0
#: How soon the runner looks again at a deadline that passed while a response kept it open.
DEADLINE_RELOOK_S = 0.05

#: Close reasons after which the session is over (its worker tombstones it; its token is dead).
#: A drained or fenced session lives on elsewhere.
ENDED_FOR_GOOD = frozenset({"client_close", "idle_timeout", "detached", "slow_consumer", "internal_error"})


class WorkerHandle(Protocol):
    """The runner's view of the worker its session is placed on (a ``WorkerLink``)."""

    address: str
    worker_id: str | None  # the worker's own id (Describe), named in resume tokens; None: unknown

    @property
    def healthy(self) -> bool: ...

    def submit(self, subs: Sequence[worker_pb2.Submission]) -> asyncio.Future[None]:
        """Queue submissions; the future resolves once they are written to the Run stream."""
        ...

    def abort(self, abort: worker_pb2.Abort) -> None: ...

    def release(self, release: worker_pb2.Release) -> None: ...


#: (session_id, epoch, takeover) -> (worker, granted epoch); raises a DuplexError.
Placer = Callable[[str, int, bool], Awaitable[tuple[WorkerHandle, int]]]


@dataclass(slots=True)
class _Inbound:
    """A client event, with when it was received."""

    event: session_pb2.ClientEvent
    received: float


@dataclass(slots=True)
class _Wake:
    """A deadline (idle, detached) fell due: the runner looks at them, in order, between events."""


@dataclass(slots=True)
class _Recover:
    """The session lost its worker: move to another one (replaying the turn's input there) and
    restart the interrupted response, unless a client event did it first."""


@dataclass(slots=True)
class _Silence:
    """The silence feeder asks for a frame for ``response``."""

    response: ActiveResponse


@dataclass(slots=True)
class _Restart:
    """A response to start again for its turn (its worker or replica was lost mid-reply)."""

    turn_id: int
    params: dict[str, Any] | None
    """Its per-response options (``response_create.extra_body``), if any."""
    mark: Marker | None
    """The commit point of the input it answers, in the replay log."""
    cause: str
    """"worker_lost" or "resumed" (the metric label)."""


@dataclass(slots=True)
class RunnerDeps:
    """What a runner is built with besides its own settings."""

    plugin: DuplexModelPlugin
    capabilities: Capabilities
    config: RunnerConfig
    placer: Placer
    on_closed: Callable[[SessionRunner], None] = field(default=lambda _r: None)
    clock: Clock = MONOTONIC
    issue_token: Callable[[SessionRunner], str] = field(default=lambda r: r.resume_token)
    """A fresh resume token for the runner as it is now (``response_started`` and
    ``response_done`` carry one, so a client always holds one that knows its last response)."""


class SessionRunner:
    """Owns one session: its settings, fence, model state, mailbox and outbound queue."""

    def __init__(
        self,
        *,
        session_id: str,
        settings: SessionSettings,
        runtime_config: dict[str, object],
        link: WorkerHandle | None,
        epoch: int,
        resume_token: str,
        deps: RunnerDeps,
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
        self._plugin = plugin = deps.plugin
        self._caps = deps.capabilities
        self._cfg = cfg = deps.config
        self._placer = deps.placer
        self._on_closed = deps.on_closed
        self._clock = deps.clock
        self.state = plugin.create_session_state(settings)
        self._sampling = plugin.configure_sampling_params(
            runtime_config=runtime_config, defaults=plugin.sampling_defaults
        )
        self.status = SessionStatus.OPEN
        self.close_reason = ""
        """Why the session closed ("" while open)."""
        self.input_status = InputStatus.OPEN
        self.turn_status = TurnStatus.LISTENING
        self.seq_status = SeqStatus.IN_EPOCH
        self._seq_epoch = epoch
        """The epoch the client's append numbering belongs to: it restarts at 1 only once the
        client has seen ``audio_cancelled``, so appends it sent before carry on the old one (and
        are acked in that epoch: acks never go backwards within an epoch)."""
        self.options_status = OptionsStatus.PENDING  # the first submission carries them
        self.response: ActiveResponse | None = None
        self._response_idle = asyncio.Event()
        self._response_idle.set()
        self.link: WorkerHandle | None = None
        self._bind(link)
        self.outbound = Outbound(
            lambda: self.epoch, limit=cfg.outbound_limit, limit_bytes=cfg.max_buffer_bytes
        )
        self.emitter = Emitter(self.outbound, self._clock, coalesce_acks=cfg.coalesce_acks)
        self._output = WorkerOutput(self, plugin, self._clock)
        self._mailbox: Mailbox[_Inbound | _Silence | _Recover | _Wake] = Mailbox(
            max_items=cfg.mailbox_size, max_bytes=cfg.max_buffer_bytes
        )
        self._detached_at: float | None = None
        """When the client's stream ended without close (None while a stream is attached)."""
        self._on_slow_consumer: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._deadlines: asyncio.Task[None] | None = None
        self._wake_queued = False
        self._submit_wait: tuple[asyncio.Future[None], float] | None = None
        """The submission the runner awaits the write of, and when it is overdue."""
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
        self._issue_token = deps.issue_token
        self._replayable = plugin.replayable and cfg.turn_failover
        wfmt = plugin.worker_format
        window = int(plugin.replay_window_s * wfmt.sample_rate_hz) * wfmt.frame_bytes
        self.replay = ReplayLog(max_bytes=max(self._frame_bytes, min(window, cfg.max_buffer_bytes)))
        """The current turn's input, kept to rebuild it on another worker (``session.replay``)."""
        self._restart: _Restart | None = None
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
            self.emitter.count = progress.events
            if progress.last_response_id:
                status = progress.last_response_status
                if status == ACTIVE:
                    # It had not ended when the replica streaming it was lost.
                    status = INTERRUPTED
                    if self._replayable and restart_interrupted:
                        # The worker still holds the committed input (the token named it).
                        self._restart = _Restart(progress.turn_id, None, None, "resumed")
                self.last_response = (progress.last_response_id, progress.turn_id, status)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.status is SessionStatus.CLOSED

    @property
    def unconsumed_frames(self) -> int:
        """Worker frames handed on in this epoch that the worker has not reported consumed."""
        return self.acks.unconsumed

    def start(self) -> None:
        if self._restart is not None:  # taken over mid-reply: restart it first
            self._mailbox.put_control(_Recover())
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")
        self._deadlines = asyncio.create_task(
            self._watch_deadlines(), name=f"session-{self.session_id}-deadlines"
        )

    async def post(self, event: session_pb2.ClientEvent, received: float | None = None) -> None:
        """Queue a client event (waits while the mailbox is full: backpressure to the client)."""
        if self.status is SessionStatus.CLOSED:
            return
        now = self._last_client = self._clock.now()
        item = _Inbound(event, received if received is not None else now)
        size = event.ByteSize()
        if not self._mailbox.put_nowait(item, size):
            await self._mailbox.put(item, size)

    def close(self, reason: str) -> None:
        """Close from outside the runner (drain, shutdown): answer ``closed`` and stop."""
        self._close(reason)

    async def wait_response_idle(self) -> None:
        """Returns once no response is active (for drain)."""
        while self.response is not None and not self.closed:
            await self._response_idle.wait()

    async def wait_closed(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def greet(self) -> None:
        """Put ``opened`` at the head of the queue (a resumed stream sees it first)."""
        self.outbound.put_front(
            self.emitter.event(
                "opened",
                session_pb2.SessionOpened(
                    session_id=self.session_id,
                    epoch=self.epoch,
                    capabilities=self._caps.to_proto(),
                    resume_token=self.resume_token,
                    config=self.settings.to_proto(),
                    last_response=self._last_response_proto(),
                    turn_id=self.turn_id,
                ),
            )
        )

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
            # +1: a token goes out in an event numbered after it was made.
            events=self.emitter.count + 1,
            last_response_id=response_id,
            last_response_status=int(status),
        )

    def attach_stream(
        self,
        *,
        on_slow_consumer: Callable[[], None] | None = None,
        cut_off: Callable[[], None] | None = None,
        acks_on_output: bool = False,
    ) -> int:
        """A client stream takes over the session's output (an open, or a resume); a stream it
        displaces is told ``closed{reason="resumed_elsewhere"}`` before it ends, and the new one
        gets nothing until the displaced one's last write is done (``Outbound``).
        ``on_slow_consumer`` is called if this stream's client stops reading and the session is
        closed for it; ``cut_off`` if, displaced in turn, it does not finish a write in time
        (the servicer ends the call in both cases). ``acks_on_output``: the stream's client reads
        acks carried on other events (each append acked once the worker consumed it)."""
        self._detached_at = None
        self._on_slow_consumer = on_slow_consumer  # before anything below may overflow
        self._acks_on_output(acks_on_output)
        farewell = None
        if self.outbound.current_attachment:
            farewell = self.emitter.event("closed", session_pb2.SessionClosed(reason="resumed_elsewhere"))
        return self.outbound.attach(farewell=farewell, cut_off=cut_off)

    def _acks_on_output(self, on: bool) -> None:
        if on == self.emitter.acks_on_output:
            return
        if on:
            self._safely(self.emitter.flush_acks)
            self.emitter.acks_on_output = True
        else:
            self._safely(self.emitter.stop_carrying)
        released = self.acks.hold_until_consumed(on)
        self._safely(lambda: self.emitter.acks(released))

    def detach(self) -> None:
        """The client's stream ended without ``close``: the session waits ``detached_grace_s``
        for a resume, then closes for good (a dropped stream must not hold capacity)."""
        if self.closed:
            return
        self._detached_at = self._clock.now()
        self._rewatch()  # the detached grace may fall due before the deadline it watches

    def go_away(self, reason: str) -> None:
        self._safely(
            lambda: self.emitter.emit(
                "go_away", session_pb2.GoAway(resume_token=self.resume_token, reason=reason)
            )
        )

    # ---- the mailbox -----------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while not self.closed:
                item = await self._next_item()
                if item is None:
                    continue
                event_id = item.event.event_id if isinstance(item, _Inbound) else ""
                try:
                    if isinstance(item, _Silence):
                        await self._on_silence(item.response)
                    elif isinstance(item, _Recover):
                        await self._recover()
                    else:
                        await self._dispatch(item)
                except DuplexError as err:
                    self._error(err, event_id)
                except OutboundOverflow:
                    self._close("slow_consumer")
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # Nothing a client sends may crash the runner: log, answer, go on.
                    log.exception("session %s: event failed", self.session_id)
                    self._error(InternalError(ErrorCode.INTERNAL, "internal error"), event_id)
        except asyncio.CancelledError:
            pass
        except OutboundOverflow:
            self._close("slow_consumer")
        finally:
            if not self.closed:
                self._close("internal_error")

    async def _next_item(self) -> _Inbound | _Silence | _Recover | None:
        item = self._mailbox.get_nowait()
        if item is None:
            item = await self._mailbox.get()
        if isinstance(item, _Wake):
            self._wake_queued = False
            self._look_at_deadlines()
            return None
        return item

    def _idle_timeout_s(self) -> float:
        # A client may shorten the operator's idle timeout, never extend it: an abandoned
        # session must not pin capacity longer than the operator allows.
        return float(min(self.settings.idle_timeout_s or self._cfg.idle_timeout_s, self._cfg.idle_timeout_s))

    def _deadline(self) -> float:
        """When the session falls idle (or its detached grace ends), unless the client speaks."""
        deadline = self._last_client + self._idle_timeout_s()
        if self._detached_at is not None:
            deadline = min(deadline, self._detached_at + self._cfg.detached_grace_s)
        return deadline

    def _look_at_deadlines(self) -> None:
        """In the runner, between events: close a session whose detached grace ended, or that
        was idle (no client event, no response) for its idle timeout."""
        now = self._clock.now()
        if self._detached_at is not None and now - self._detached_at >= self._cfg.detached_grace_s:
            self._close("detached")
        elif self.response is None and now - self._last_client >= self._idle_timeout_s():
            self._close("idle_timeout")

    async def _watch_deadlines(self) -> None:
        """Sleeps until the next deadline (at most ``DEADLINE_LOOK_S``): one wake-up a second
        per session instead of a timer armed and cancelled for every event. A due idle or
        detached deadline is handed to the runner (it closes in order, between events); a
        submission not written in time is failed here (the runner awaits it)."""
        clock = self._clock
        while not self.closed:
            now = clock.now()
            waiting = self._submit_wait
            if waiting is not None and now >= waiting[1] and not waiting[0].done():
                waiting[0].set_exception(TimeoutError(f"not written within {self._cfg.submit_timeout_s} s"))
            due = self._deadline()
            if now >= due:
                if not self._wake_queued:
                    self._wake_queued = True
                    self._mailbox.put_control(_Wake())
                due = now + DEADLINE_RELOOK_S
            await clock.sleep(min(due - now, DEADLINE_LOOK_S))

    def _rewatch(self) -> None:
        """A deadline moved closer (the stream detached, the idle timeout shrank): the watch
        starts again from it."""
        if self._deadlines is not None and not self.closed:
            self._deadlines.cancel()
            self._deadlines = asyncio.create_task(
                self._watch_deadlines(), name=f"session-{self.session_id}-deadlines"
            )

    async def _dispatch(self, item: _Inbound) -> None:
        ev = item.event
        kind = ev.WhichOneof("event")
        EVENTS_IN[kind or "none"].inc()
        match kind:
            case "append":
                await self._on_append(ev.append, item.received)
            case "commit":
                await self._on_commit(item.received)
            case "clear":
                await self._on_clear()
            case "response_create":
                await self._on_response_create(ev.response_create)
            case "response_cancel":
                self._on_response_cancel(ev.response_cancel)
            case "barge_in":
                self.cancel("barge_in")
            case "update":
                self._on_update(ev.update)
            case "playback_ack":
                pass  # accepted: what the user heard is the client's to report; nothing depends on it yet
            case "function_call_output":
                fco = ev.function_call_output
                patch = self._plugin.runtime_config_for_function_output(
                    self.settings, self.runtime_config, fco.call_id, fco.output
                )
                if patch:
                    self.apply_runtime(dict(self.runtime_config) | patch)
            case "close":
                self._close("client_close")
            case "open" | "resume":
                raise BadEventError(ErrorCode.ALREADY_OPEN, "the session is already open")
            case _:
                raise BadEventError(ErrorCode.INVALID_EVENT, "empty or unreadable client event")

    def _error(self, err: DuplexError, event_id: str = "") -> None:
        self._safely(lambda: self.emitter.error(err, event_id))

    def _safely(self, emit: Callable[[], None]) -> None:
        """Emit; a client that stopped reading is closed instead."""
        try:
            emit()
        except OutboundOverflow:
            self._close("slow_consumer")

    # ---- client events ---------------------------------------------------------------------

    async def _on_append(self, ap: session_pb2.InputAudioAppend, received: float) -> None:
        pcm = ap.pcm  # read once: each read of a bytes field copies it
        self._check_append(ap, pcm)
        if self.seq_status is SeqStatus.RESTART_ALLOWED and ap.seq == 1:
            # The client saw audio_cancelled and restarted; appends it sent before are behind us.
            self.seq_status = SeqStatus.IN_EPOCH
            self._seq_epoch = self.epoch
            self._last_seq = 0
        if ap.seq <= self._last_seq:
            raise BadEventError(ErrorCode.SEQ_OUT_OF_ORDER, f"seq {ap.seq} after {self._last_seq}")
        if self.input_status is InputStatus.ABANDONED:
            raise BadEventError(
                ErrorCode.INPUT_ABANDONED,
                "an earlier append failed; input is abandoned until commit, clear or cancel",
                retryable=True,
            )
        self._last_seq = ap.seq
        seq_epoch = self._seq_epoch
        link = self.link
        if link is None or not link.healthy:
            link = await self._bound_link()
        fence = self._fence()
        res = self.state.audio_buffer.reserve_append(pcm)
        frames = res.frames
        try:
            if frames:
                try:
                    wseq = await self._append_frames(link, fence, frames)
                except UnavailableError:
                    if not (self._replayable and self.link is not link and self.epoch == fence.epoch):
                        raise
                    # Lost with its worker mid-write: the session moves (the turn's input is
                    # replayed there) and the append goes to the new worker.
                    link = await self._bound_link()
                    fence = self._fence()
                    wseq = await self._append_frames(link, fence, frames)
                if self.epoch == fence.epoch:
                    self._worker_seq = wseq
                    # Kept even when its worker was lost meanwhile: the move replays it.
                    self.replay.appended(frames, epoch=fence.epoch, seq=wseq, turn_id=fence.turn_id)
                    if self.link is link:  # else its worker is gone (the replay hands it on again)
                        self.acks.handed_on(wseq, len(frames) // self._frame_bytes)
        except BaseException:
            res.rollback()
            if self.link is link:  # a write lost with its worker leaves no hole: that input is gone too
                self.input_status = InputStatus.ABANDONED
            raise
        res.commit()
        self.state.input_since_commit_samples += len(frames) // self._plugin.worker_format.frame_bytes
        fmt = self.settings.input_format
        self._timeline.client(len(pcm) // fmt.frame_bytes / fmt.sample_rate_hz, received)
        # Acked in the epoch of the client's numbering (older than the fence's when the client
        # appended on before it saw audio_cancelled, or the session moved meanwhile).
        if self.epoch == fence.epoch:
            self.emitter.acks(self.acks.ack(ap.seq, seq_epoch, received))
        else:  # cancelled meanwhile: the ack of an older epoch holds nothing back
            self.emitter.acks((Ack(ap.seq, seq_epoch, (received,)),))

    async def _append_frames(self, link: WorkerHandle, fence: Fence, frames: bytes) -> int:
        """Write one APPEND of ``frames`` under the next worker seq; returns the seq."""
        wseq = self._worker_seq + 1
        params = self._take_options()
        subs = self._plugin.plan_append(
            request_id=self.session_id, fence=fence, seq=wseq, frames=frames, params=params
        )
        try:
            await self._submit(link, subs)
        except BaseException:
            if params is not None:
                self.options_status = OptionsStatus.PENDING
            raise
        return wseq

    def _check_append(self, ap: session_pb2.InputAudioAppend, pcm: bytes) -> None:
        fmt = self.settings.input_format
        if ap.HasField("format"):
            declared = PcmFormat.from_proto(ap.format)  # unsupported_audio_format
            if declared != fmt:
                raise BadEventError(
                    ErrorCode.AUDIO_FORMAT_MISMATCH, f"append declares {declared}, the session input is {fmt}"
                )
        n = len(pcm)
        if n > self._caps.max_append_bytes:
            raise BadEventError(
                ErrorCode.CHUNK_TOO_LARGE,
                f"{n} bytes > max_append_bytes {self._caps.max_append_bytes}",
            )
        if not n or n % fmt.frame_bytes:
            raise BadEventError(
                ErrorCode.INVALID_PCM_LENGTH,
                f"{n} bytes is not a positive whole number of {fmt.frame_bytes}-byte frames for {fmt}",
            )
        # Checked before the append takes its seq (the converter would refuse it only after).
        if fmt.encoding == F32LE and not np.isfinite(np.frombuffer(pcm, dtype="<f4")).all():
            raise BadEventError(ErrorCode.INVALID_EVENT, "float PCM contains NaN or infinity")

    async def _on_commit(self, received: float) -> None:
        link = await self._bound_link()
        fence = self._fence()
        res = self.state.audio_buffer.reserve_flush()
        if not res.frames and self.state.input_since_commit_samples == 0:
            res.rollback()
            raise BadEventError(ErrorCode.NO_COMMITTED_INPUT, "no input to commit")
        frames = res.frames
        try:
            params = self._take_options()
            subs = self._plugin.plan_append(
                request_id=self.session_id,
                fence=fence,
                seq=self._worker_seq + 1,
                frames=frames,
                params=params,
            )
            subs.append(
                self._plugin.plan_control(
                    request_id=self.session_id, fence=fence, kind=COMMIT, params=None if subs else params
                )
            )
            await self._submit(link, subs)
        except BaseException:
            res.rollback()
            self.options_status = OptionsStatus.PENDING
            raise
        res.commit()
        if frames and self.epoch == fence.epoch:
            self._worker_seq += 1
            self.replay.appended(frames, epoch=fence.epoch, seq=self._worker_seq, turn_id=fence.turn_id)
            self._handed_on(link, self._worker_seq, len(frames) // self._frame_bytes)
        if self.epoch == fence.epoch:
            self.replay.committed(fence.turn_id)
        samples = (
            self.state.input_since_commit_samples + len(frames) // self._plugin.worker_format.frame_bytes
        )
        self.state.input_since_commit_samples = 0
        self.input_status = InputStatus.OPEN
        self._committed(received, samples)

    async def _on_clear(self) -> None:
        link = await self._bound_link()
        self.state.audio_buffer.clear()
        sub = self._plugin.plan_control(
            request_id=self.session_id, fence=self._fence(), kind=CLEAR, params=self._take_options()
        )
        await self._submit(link, [sub])
        self.replay.cleared()
        self.state.input_since_commit_samples = 0
        self.input_status = InputStatus.OPEN
        self.emitter.emit("cleared", session_pb2.InputCleared())

    async def _on_response_create(self, rc: session_pb2.ResponseCreate) -> None:
        # Bound first: a move restarts an interrupted response, which this one must then not orphan.
        await self._bound_link()
        if self.response is not None:
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        if self.turn_status is not TurnStatus.COMMITTED:
            raise BadEventError(ErrorCode.NO_COMMITTED_INPUT, "commit input before creating a response")
        params: dict[str, Any] | None = None
        extra = struct_to_dict(rc.extra_body)
        if extra:
            self._check_model_key(extra)
            self._plugin.validate_client_extra_body(extra)
            cfg = self._plugin.runtime_config_for_update(self.settings, self.runtime_config, extra)
            sampling = self._plugin.configure_sampling_params(
                runtime_config=cfg, defaults=self._plugin.sampling_defaults
            )
            params = self._plugin.worker_params(settings=self.settings, runtime_config=cfg, sampling=sampling)
            self.options_status = OptionsStatus.PENDING  # the session's own options return after it
        link = await self._bound_link()
        if self.response is not None:  # (placing again may restart one)
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        del link
        self._start_response(self._commit_at, params)

    def _on_response_cancel(self, rc: session_pb2.ResponseCancel) -> None:
        resp = self.response
        if resp is None or rc.response_id not in ("", resp.response_id):
            raise BadEventError(ErrorCode.NO_ACTIVE_RESPONSE, "no such active response")
        self.cancel("response_cancel")

    def _check_model_key(self, extra: dict[str, object]) -> None:
        model = extra.pop("model", None)
        if model is not None and model != self._plugin.plugin_id:
            raise BadEventError(ErrorCode.MODEL_CHANGE_REFUSED, "the model of a session cannot change")

    def _on_update(self, up: session_pb2.SessionUpdate) -> None:
        extra = struct_to_dict(up.extra_body)
        self._check_model_key(extra)
        new = settings_from_proto(up.config, self.settings, require_input=False, capabilities=self._caps)
        if new.instructions != self.settings.instructions and self.state.context_locked:
            raise BadEventError(
                ErrorCode.CONTEXT_LOCKED, "instructions cannot change after the first response"
            )
        runtime = self.runtime_config
        if extra:
            self._plugin.validate_client_extra_body(extra)
            runtime = self._plugin.runtime_config_for_update(new, self.runtime_config, extra)
        # Everything validated: apply at once.
        if new.input_format != self.settings.input_format:
            self.state.audio_buffer = FramePacketizer(
                new.input_format, self._plugin.worker_format, self._plugin.frame_samples
            )
        shorter = (new.idle_timeout_s or self._cfg.idle_timeout_s) < self._idle_timeout_s()
        self.settings = new
        if shorter:
            self._rewatch()
        self.apply_runtime(runtime)
        self.emitter.emit("updated", session_pb2.SessionUpdated(config=new.to_proto()))

    def apply_runtime(self, runtime: dict[str, object]) -> None:
        """New runtime config: the worker gets the session's options with the next submission."""
        self.runtime_config = runtime
        self._sampling = self._plugin.configure_sampling_params(
            runtime_config=runtime, defaults=self._plugin.sampling_defaults
        )
        self.options_status = OptionsStatus.PENDING

    def _take_options(self) -> dict[str, Any] | None:
        """The session's model options, if the worker does not have them yet."""
        if self.options_status is OptionsStatus.CURRENT:
            return None
        self.options_status = OptionsStatus.CURRENT
        return self._plugin.worker_params(
            settings=self.settings, runtime_config=self.runtime_config, sampling=self._sampling
        )

    # ---- turns and responses ---------------------------------------------------------------

    def _committed(self, at: float, samples: int) -> None:
        self.turn_status = TurnStatus.COMMITTED
        self._commit_at = at
        audio_ms = samples * 1000 // self._plugin.worker_format.sample_rate_hz
        self.emitter.emit(
            "committed", session_pb2.InputCommitted(turn_id=self.turn_id + 1, audio_ms=audio_ms)
        )

    def turn_ended(self, committed_samples: int) -> None:
        """The worker's turn detection committed the input; answer it when auto-responding."""
        self.state.input_since_commit_samples = 0
        self.replay.turn_ended()
        self._committed(self._clock.now(), committed_samples)
        if self.settings.turn_detection.auto_respond and self.response is None:
            self._start_response(self._commit_at)

    def _start_response(
        self, started_at: float, params: dict[str, Any] | None = None, *, restart: _Restart | None = None
    ) -> None:
        """Start a response to the committed input: for a new turn, or (``restart``) again for
        the turn of one its worker or replica lost."""
        link = self.link
        if link is None or not link.healthy:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker is unavailable")
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
        )
        self.response = resp
        self._response_idle.clear()
        self.turn_status = TurnStatus.LISTENING
        self.state.context_locked = True
        self.last_response = (response_id, turn_id, ACTIVE)
        started = resp.started()
        started.resume_token = self._fresh_token()
        self.emitter.emit("response_started", started)
        sub = self._plugin.plan_control(
            request_id=self.session_id,
            fence=self._fence(),
            kind=RESPOND,
            params=params if params is not None else self._take_options(),
        )
        link.submit([sub]).add_done_callback(lambda f: self._on_respond_written(resp, f))
        # A lockstep model advances its reply one frame per input frame: without client audio the
        # turn would stall, so silence is fed at real-time deadlines while the response is active.
        if (
            self._plugin.silence_continuation
            and self._cfg.silence_continuation
            and self._cfg.max_silence_frames > 0
        ):
            resp.feeder = SilenceFeeder(
                period_s=self._frame_period,
                max_frames=self._cfg.max_silence_frames,
                clock=self._clock,
                due_in=lambda: self._timeline.silence_due_in(self._clock.now(), self._frame_period),
                request=lambda: self._request_silence(resp),
            )
            resp.feeder.start()

    def _on_respond_written(self, resp: ActiveResponse, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            return
        if self.response is resp and not self.closed:
            try:
                self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
                self._error(UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the response could not be sent"))
            except OutboundOverflow:
                self._close("slow_consumer")

    def _end_response(self) -> ActiveResponse | None:
        resp = self.response
        self.response = None
        self._response_idle.set()
        if resp is not None:
            resp.stop()
        return resp

    def _fresh_token(self) -> str:
        """A resume token that knows the session as it is now (kept as the current one)."""
        self.resume_token = self._issue_token(self)
        return self.resume_token

    def _response_done(
        self, resp: ActiveResponse, status: session_pb2.ResponseStatus.ValueType, reason: str
    ) -> None:
        """Emit ``response_done`` for ``resp``, with a token that knows how it ended."""
        self.last_response = (resp.response_id, resp.turn_id, status)
        done = resp.done(status, reason)
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
        old = self.epoch
        self.epoch += 1
        self._worker_seq = 0
        self.seq_status = SeqStatus.RESTART_ALLOWED
        self.input_status = InputStatus.OPEN
        self.outbound.purge_before(self.epoch)
        if resp is not None:
            self.replay.answered(resp.mark)
        elif self._restart is not None:  # cancelled before its restart: it stays cancelled
            self.replay.answered(self._restart.mark)
            self._restart = None
        self.replay.new_epoch(self.epoch)
        if self.link is not None:
            self.link.abort(
                worker_pb2.Abort(request_id=self.session_id, fence=self._fence().to_proto(), reason=reason)
            )
        # Worker seqs restart with the epoch and the worker drops the old epoch's input: acks
        # held for it go out now (they carry the old epoch), before ``audio_cancelled``.
        self.emitter.acks(self.acks.reset())
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

    # ---- silence continuation --------------------------------------------------------------

    def _request_silence(self, resp: ActiveResponse) -> bool:
        if not self._mailbox.put_nowait(_Silence(resp)):
            MAILBOX_FULL.inc()
            return False
        return True

    async def _on_silence(self, resp: ActiveResponse) -> None:
        # Skipped when real input is waiting, the client caught up meanwhile, or the
        # epoch/turn/response changed.
        if self.response is not resp or resp.epoch != self.epoch or resp.turn_id != self.turn_id:
            return
        if not self._mailbox.empty() or not self._timeline.silence_due(self._clock.now(), self._frame_period):
            return
        link = self.link
        if link is None or not link.healthy:
            return
        wseq = self._worker_seq + 1
        subs = self._plugin.plan_append(
            request_id=self.session_id, fence=self._fence(), seq=wseq, frames=self._silence_frame, params=None
        )
        try:
            await self._submit(link, subs)
        except UnavailableError:
            if self.link is not link:
                return  # lost with its worker: the session was told of the loss already
            raise
        if self.epoch == resp.epoch:
            self._worker_seq = wseq
            self.replay.appended(self._silence_frame, epoch=resp.epoch, seq=wseq, turn_id=resp.turn_id)
            self._handed_on(link, wseq, 1)
        self._timeline.silence(self._clock.now(), self._frame_period)
        if resp.feeder is not None:
            resp.feeder.fed()
        SILENCE_FRAMES.inc()

    # ---- worker outputs (called synchronously by the router) --------------------------------

    def on_output(
        self,
        fence: common_pb2.Fence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
    ) -> None:
        """One step's news for this session (see ``session_service.session.worker_output``)."""
        if self.closed:
            DROPPED[DropReason.UNKNOWN_REQUEST].inc()
            return
        try:
            self._output.handle(fence, payload, updates)
        except OutboundOverflow:
            self._close("slow_consumer")
        except DuplexError as err:
            self._error(err)
        except Exception:
            log.exception("session %s: worker output failed", self.session_id)
            self._error(InternalError(ErrorCode.INTERNAL, "internal error"))

    def fenced(self) -> None:
        """The session's worker says another owner took the session over (a resume on another
        replica): this replica's stream is told ``closed{resumed_elsewhere}`` at once, as a
        stream displaced on this replica is, and the runner ends. A resume here later takes the
        session over again at the worker, where a session closed since is refused."""
        self._close("resumed_elsewhere")

    def on_worker_lost(self, link: WorkerHandle) -> None:
        """The worker went away (or hung), and the session's model state with it.

        With turn failover the session keeps its turn: the interrupted response ends
        ``failed/worker_unavailable``, and the session moves to another worker at once, replays
        the turn's input there and restarts the response for the same turn (``_recover``). The
        speech status stays as it is: the speech goes on on the new worker. Without it, what
        depended on the worker fails."""
        if self.link is not link or self.closed:
            return
        self._bind(None)
        if self._replayable:
            if all(left is not link for left in self._left):
                self._left.append(link)
            try:
                self.emitter.acks(self.acks.reset())  # the input is the session's to replay now
                resp = self._end_response()
                if resp is not None:
                    self._restart = _Restart(resp.turn_id, resp.params, resp.mark, "worker_lost")
                    self._response_done(resp, FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
            except OutboundOverflow:
                self._close("slow_consumer")
                return
            self._mailbox.put_control(_Recover())
            return
        FAILOVERS.labels(result="not_replayable").inc()
        try:
            # The worker's model state went with it: uncommitted input (so no hole to protect)
            # and any committed utterance. The next submission starts over on a healthy worker.
            self._give_up_turn([link])
            if self.response is not None:
                self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
            self.emitter.error(
                UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker went away")
            )
        except OutboundOverflow:
            self._close("slow_consumer")

    # ---- the worker binding ----------------------------------------------------------------

    def _bind(self, link: WorkerHandle | None) -> None:
        if self.link is not None:
            WORKER_SESSIONS.labels(worker=self.link.address).dec()
        self.link = link
        if link is not None:
            WORKER_SESSIONS.labels(worker=link.address).inc()

    async def _recover(self) -> None:
        """After a worker loss (or a takeover mid-reply): move to a healthy worker, replaying the
        turn's input there, and restart the interrupted response. A few tries (links come back,
        the pool re-resolves); then the turn is given up with ``worker_unavailable``."""
        for delay in RECOVER_DELAYS_S:
            if self.closed or (self._restart is None and self.link is not None and self.link.healthy):
                return  # a client event got there first
            if delay:
                await self._clock.sleep(delay)
            try:
                await self._bound_link()
                return
            except UnavailableError as err:
                last = err
        FAILOVERS.labels(result="unavailable").inc()
        # The turn is given up, all of it, as when the model cannot be replayed: the input kept
        # for it goes, not only what the interrupted response answered but what came after (fed
        # silence, what the user said while the worker hung), and the workers it was lost from
        # release what they hold of it. Either, kept, would start the next turn: speech the
        # model never reported on, heard on the next worker (replayed, or still in the old one's
        # state), committed and answered there, and that answer barged in on by what the user
        # says next.
        self._restart = None
        left, self._left = self._left, []
        self._give_up_turn(left)
        self._error(
            UnavailableError(ErrorCode.WORKER_UNAVAILABLE, f"the session's worker went away: {last.message}")
        )

    def _give_up_turn(self, lost: Sequence[WorkerHandle]) -> None:
        """The turn in progress is lost with the model state of the session's worker (``lost``:
        the workers it was lost from), all of it, so that the next input starts a new turn as on
        a fresh session: the input kept for the turn goes (uncommitted, and committed input no
        response answered), held acks go out (that input will never be consumed), an open
        speech span is closed, and the lost workers are to release what they hold of the
        session before it is placed again (``_release_stale``). A running response is the
        caller's to end."""
        self._stale.extend(link for link in lost if all(link is not stale for stale in self._stale))
        self.replay.clear()
        self.input_status = InputStatus.OPEN
        self.turn_status = TurnStatus.LISTENING
        self.state.input_since_commit_samples = 0
        self.emitter.acks(self.acks.reset())
        self._output.end_speech()

    async def _release_stale(self) -> None:
        """Before the session is placed again: the workers that hold the model state of a turn
        given up release it (VAD state, input the user said meanwhile). The session may land on
        one of them, where a takeover keeps what the session holds there: that stale state
        would begin the next turn (speech heard in it committed and answered, then barged in
        on). The release goes first thing on a link that is down (kept for its next stream),
        and is written before anything else is asked of the worker on one that is up; a worker
        that no longer holds the session ignores it (reconciled when the link came back)."""
        stale, self._stale = self._stale, []
        fence = self._fence().to_proto()
        for link in stale:
            link.release(worker_pb2.Release(request_id=self.session_id, fence=fence, closed=False))
            if link.healthy:
                with contextlib.suppress(UnavailableError):  # lost again: kept for its next stream
                    await self._submit(link, ())

    async def _bound_link(self) -> WorkerHandle:
        """The session's worker, placing the session again when it has none (or a dead one):
        the turn's input is replayed there first, and an interrupted response restarts."""
        link = self.link
        if link is not None and link.healthy:
            if self._restart is not None:
                self._restart_response(link)
            return link
        if self._stale:
            await self._release_stale()
        try:
            # With takeover: this runner holds the session, so whoever still holds it on the new
            # worker (an owner that lost it, a hung replica) is fenced out rather than refusing
            # us; under mutual TLS a higher epoch alone would not move it.
            link, granted = await self._placer(self.session_id, self.epoch, True)
        except DuplexError as err:
            if err.code == ErrorCode.SESSION_CLOSED:
                # Taken over and closed for good by another replica while this one was cut off
                # from the worker: closed here too (a resume here must not find it open).
                self._close("resumed_elsewhere")
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"no worker for the session: {err.message}"
            ) from err
        self._bind(link)
        self.options_status = OptionsStatus.PENDING
        # Bound first: emitting held acks may overflow the outbound queue and close the session,
        # which must then release the new placement too.
        self.emitter.acks(self.acks.reset())  # nothing is in flight on the new placement
        if granted > self.epoch:
            self._moved_to_epoch(granted)
        if self._replayable:
            try:
                await self._replay_on(link)
            except BaseException:
                # Not on the new worker after all (a restart there would answer nothing): the
                # next try places the session again and replays from the start.
                if self.link is link:
                    self._unbind_after_failed_replay(link)
                raise
        self._left.clear()  # placed: what the workers it left hold is reconciled when they return
        if self._restart is not None:
            self._restart_response(link)
        return link

    def _unbind_after_failed_replay(self, link: WorkerHandle) -> None:
        link.release(
            worker_pb2.Release(request_id=self.session_id, fence=self._fence().to_proto(), closed=False)
        )
        self._bind(None)
        self.emitter.acks(self.acks.reset())

    def _moved_to_epoch(self, granted: int) -> None:
        """The new worker granted a higher epoch (it had fenced the session before): the client
        is told as after a cancel (appends restart at seq 1), though nothing of its was cut."""
        old = self.epoch
        self.epoch = granted
        self._worker_seq = 0
        self.seq_status = SeqStatus.RESTART_ALLOWED
        self.outbound.purge_before(self.epoch)
        self.emitter.emit(
            "audio_cancelled",
            session_pb2.AudioCancelled(cancelled_epoch=old, epoch=granted, reason="worker_moved"),
        )

    async def _replay_on(self, link: WorkerHandle) -> None:
        """Hand the kept input of the turn to the session's new worker, before anything else."""
        plan = self.replay.plan(REPLAY_APPEND_FRAMES * self._frame_bytes)
        if not plan:
            FAILOVERS.labels(result="replayed").inc()
            return
        steps = [
            ReplayStep(frames=None, turn_id=item.turn_id)
            if isinstance(item, Marker)
            else ReplayStep(item.frames, item.replay, item.turn_id)
            for item in plan
        ]
        first = self._worker_seq + 1
        fence = self._fence()
        subs = self._plugin.plan_replay(
            request_id=self.session_id, fence=fence, first_seq=first, steps=steps, params=self._take_options()
        )
        try:
            await self._submit(link, subs)
        except BaseException:
            self.options_status = OptionsStatus.PENDING
            raise
        seq = first
        frames = 0
        for item in plan:
            if isinstance(item, Marker):
                continue
            item.handed_on(epoch=fence.epoch, seq=seq)
            n = item.size // self._frame_bytes
            self._handed_on(link, seq, n)
            frames += n
            seq += 1
        self._worker_seq = seq - 1
        REPLAYED_FRAMES.inc(frames)
        FAILOVERS.labels(result="replayed").inc()

    def _restart_response(self, link: WorkerHandle) -> None:
        restart, self._restart = self._restart, None
        if restart is None or self.response is not None or self.closed:
            return
        del link
        RESTARTED_RESPONSES.labels(cause=restart.cause).inc()
        self._start_response(self._clock.now(), restart.params, restart=restart)

    def _fence(self) -> Fence:
        f = self._fence_cache
        if f.epoch != self.epoch or f.turn_id != self.turn_id:
            f = self._fence_cache = Fence(self.session_id, self.epoch, self.turn_id)
        return f

    def _handed_on(self, link: WorkerHandle, wseq: int, frames: int) -> None:
        """An APPEND of ``frames`` worker frames was written under worker seq ``wseq``."""
        if self.link is link:  # else its worker is gone (and with it the input): nothing to wait for
            self.acks.handed_on(wseq, frames)

    async def _submit(self, link: WorkerHandle, subs: Sequence[worker_pb2.Submission]) -> None:
        """Hand submissions to the link and wait until they are written; one not written in
        ``submit_timeout_s`` fails (``_watch_deadlines`` fails it: no timer per submission)."""
        written = link.submit(subs)
        self._submit_wait = (written, self._clock.now() + self._cfg.submit_timeout_s)
        try:
            await written
        except DuplexError:
            raise
        except (TimeoutError, ConnectionError) as exc:
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"worker did not take the input: {exc}"
            ) from exc
        finally:
            self._submit_wait = None

    # ---- closing ---------------------------------------------------------------------------

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        try:
            resp = self._end_response()
            if resp is not None:
                self.last_response = (resp.response_id, resp.turn_id, CANCELLED)
                self.emitter.emit("response_done", resp.done(CANCELLED, "session_closed"))
            self.emitter.emit("closed", session_pb2.SessionClosed(reason=reason))
        except OutboundOverflow:
            pass
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
        self.outbound.close(drop=reason == "slow_consumer")
        if reason == "slow_consumer" and self._on_slow_consumer is not None:
            self._on_slow_consumer()
        self._on_closed(self)
        # Closed from the router, a timer or the server: stop the mailbox task too.
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._deadlines is not None and self._deadlines is not asyncio.current_task():
            self._deadlines.cancel()
