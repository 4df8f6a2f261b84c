"""One runner per session: the asyncio shell over the session's layers.

``SessionRunner`` is built in layers, state at the bottom, each a module of its own:

- ``state`` (``SessionState``): the session's state and its synchronous transitions (options
  pending, acks reset, the epoch advance, turn commit, response begun/finished, close); no I/O.
- ``failover`` (``Failover``): the worker binding, replay, restart, recover.
- ``client_events`` (``ClientEvents``): the client's events.
- ``silence`` (``SilenceFeeding``): real-time silence for a model clocked by its input.
- ``staging`` (``Staging``): a plugin's later stages (``stages``: their workers, each reply's
  hand-offs).
- ``conversing`` (``Conversing``): the conversation a chat stage sees (``history``).
- here: the mailbox, the deadlines and dispatch (one asyncio task consumes the mailbox, one
  watches the deadlines), response start, worker output.

Client events are processed strictly in order by one asyncio task consuming a bounded
mailbox. Worker outputs arrive from the router synchronously (``on_output``, applied by
``session_service.session.worker_output``) and are checked against the fence and queued for the
client without any await in between; a cancel (which also runs without awaiting) advances the
epoch and purges the session's one outbound queue in one go, so no audio of a cancelled epoch or
an older turn can reach the client after ``audio_cancelled``.

The other parts it is built from: wire settings (``settings``), the input-ack window
(``ack_window``), the active response and its silence feeder (``response``), worker output
handling and the drop-reason table (``worker_output``), event numbering and queueing
(``emitter``), and the status and reason enums (``lifecycle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from duplex.clock import MONOTONIC, Clock
from duplex.errors import DuplexError, ErrorCode, InternalError, UnavailableError
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.metrics import DROPPED
from session_service.plugin import Capabilities, DuplexModelPlugin, SessionSettings
from session_service.session.answer_order import AnswerOrder
from session_service.session.conversing import Conversing
from session_service.session.failover import RECOVER_DELAYS_S, REPLAY_APPEND_FRAMES
from session_service.session.lifecycle import ENDED_FOR_GOOD, CloseReason, DropReason, SessionStatus
from session_service.session.mailbox import Mailbox
from session_service.session.pacing import OutputPacing
from session_service.session.response import ActiveResponse, SilenceFeeder
from session_service.session.silence import SilenceRequest
from session_service.session.stages import StagePipeline
from session_service.session.staging import PlaceStages
from session_service.session.state import FAILED, Restart
from session_service.session.worker_handle import Placer, WorkerHandle
from session_service.session.worker_output import StepFence, WorkerOutput
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import SessionProgress

__all__ = [
    "DEADLINE_LOOK_S",
    "DEADLINE_RELOOK_S",
    "ENDED_FOR_GOOD",
    "RECOVER_DELAYS_S",
    "REPLAY_APPEND_FRAMES",
    "Placer",
    "RunnerDeps",
    "SessionRunner",
    "WorkerHandle",
]

log = logging.getLogger(__name__)

RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
#: The longest the runner goes without looking at its deadlines (idle, detached, a submission's
#: write) when none falls due sooner. They are looked at by one task per session, not by a timer
#: armed for every event: a submission that is not written in ``submit_timeout_s`` fails within
#: this much more.
DEADLINE_LOOK_S = 1.0
#: How soon the runner looks again at a deadline that passed while a response kept it open.
DEADLINE_RELOOK_S = 0.05


@dataclass(slots=True)
class _Inbound:
    """A client event, with when it was received and its size (computed once: the mailbox's
    bound and the append's checks all read it)."""

    event: session_pb2.ClientEvent
    received: float
    size: int


@dataclass(slots=True)
class _Wake:
    """A deadline (idle, detached) fell due: the runner looks at them, in order, between events."""


@dataclass(slots=True)
class _Recover:
    """The session lost its worker: move to another one (replaying the turn's input there) and
    restart the interrupted response, unless a client event did it first."""


@dataclass(slots=True)
class RunnerDeps:
    """What a runner is built with besides its own settings."""

    plugin: DuplexModelPlugin
    capabilities: Capabilities
    config: RunnerConfig
    placer: Placer
    stage_placers: Mapping[str, Placer] = field(default_factory=dict)
    """A plugin served in stages: each later stage's placer, by stage name."""
    on_closed: Callable[[SessionRunner], None] = field(default=lambda _r: None)
    clock: Clock = MONOTONIC
    issue_token: Callable[[SessionRunner], str] = field(default=lambda r: r.resume_token)
    """A fresh resume token for the runner as it is now (``response_started`` and
    ``response_done`` carry one, so a client always holds one that knows its last response)."""


class SessionRunner(Conversing):
    """Owns one session: the asyncio shell (mailbox, deadlines, dispatch) over its layers."""

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
        self._response_idle = asyncio.Event()
        self._response_idle.set()
        super().__init__(
            session_id=session_id,
            settings=settings,
            runtime_config=runtime_config,
            link=link,
            epoch=epoch,
            resume_token=resume_token,
            plugin=deps.plugin,
            capabilities=deps.capabilities,
            config=deps.config,
            placer=deps.placer,
            clock=deps.clock,
            issue_token=lambda: deps.issue_token(self),
            principal=principal,
            progress=progress,
            restart_interrupted=restart_interrupted,
        )
        # Worker output is a layer above the state, working on it directly.
        self._output = WorkerOutput(self, deps.plugin, deps.clock)
        self._on_closed = deps.on_closed
        self._mailbox: Mailbox[_Inbound | SilenceRequest | _Recover | PlaceStages | _Wake] = Mailbox(
            max_items=self._cfg.mailbox_size, max_bytes=self._cfg.max_buffer_bytes
        )
        self._stages = None
        if deps.plugin.stages:
            self._stages = StagePipeline(
                self, deps.plugin, deps.stage_placers, lambda: self._mailbox.put_control(PlaceStages())
            )
        self._task: asyncio.Task[None] | None = None
        self._deadlines: asyncio.Task[None] | None = None
        self._wake_queued = False
        self._submit_wait = None
        self._busy = False
        """The runner task is inside an item (it may be awaiting in it)."""
        self._answers = AnswerOrder(closed=lambda: self.closed)
        self._native_feeder: SilenceFeeder | None = None
        """A model-native session's silence feeder (it hears every frame)."""
        pacing = OutputPacing(late_s=self._frame_period)

        def audio_out(delta: session_pb2.AudioDelta) -> None:
            pacing.taken(
                delta, self.settings.output_format.duration_ms(len(delta.pcm)) / 1000.0, self._clock.now()
            )
            self._audio_out(delta)

        self.outbound.on_audio = audio_out

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._restart is not None:  # taken over mid-reply: restart it first
            self._mailbox.put_control(_Recover())
        if self._stages is not None:  # placed now: the first reply does not wait for it
            self._stages.need_placement()
        if self._plugin.model_native and self._cfg.silence_continuation:
            # The model hears every frame, speaking or not: real-time silence whenever the client
            # falls behind, for the session's life (it ends with the session's tasks).
            self._native_feeder = self._feeder(None, max_frames=2**62)
            self._native_feeder.start()
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")
        self._deadlines = asyncio.create_task(
            self._watch_deadlines(), name=f"session-{self.session_id}-deadlines"
        )

    async def post(self, event: session_pb2.ClientEvent, received: float | None = None) -> None:
        """Queue a client event (waits while the mailbox is full: backpressure to the client)."""
        if self.status is SessionStatus.CLOSED:
            return
        now = self._last_client = self._clock.now()
        received = received if received is not None else now
        size = event.ByteSize()
        if self._append_at_once(event, received, size):
            return
        item = _Inbound(event, received, size)
        if not self._mailbox.put_nowait(item, size):
            await self._mailbox.put(item, size)

    def close(self, reason: CloseReason) -> None:
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
                    capabilities=self._caps.to_proto(auto_respond=self.settings.turn_detection.auto_respond),
                    resume_token=self.resume_token,
                    config=self.settings.to_proto(),
                    last_response=self._last_response_proto(),
                    turn_id=self.turn_id,
                ),
            )
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
            farewell = self.emitter.event(
                "closed", session_pb2.SessionClosed(reason=CloseReason.RESUMED_ELSEWHERE)
            )
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

    # ---- the mailbox and the deadlines ------------------------------------------------------

    async def _run(self) -> None:
        try:
            while not self.closed:
                item = await self._next_item()
                if item is None:
                    continue
                event_id = item.event.event_id if isinstance(item, _Inbound) else ""
                self._busy = True
                # An event that joins earlier appends' command goes to the link before their
                # writes are done; its answers still come after theirs (``_answers``).
                joins = isinstance(item, _Inbound) and self._joins_earlier_writes(item.event, item.size)
                try:
                    if not joins:
                        await self._answers.settled()  # appends applied at once come first
                    if isinstance(item, SilenceRequest):
                        await self._on_silence(item.response)
                    elif isinstance(item, _Recover):
                        await self._recover()
                    elif isinstance(item, PlaceStages):
                        assert self._stages is not None
                        await self._stages.place(RECOVER_DELAYS_S)
                    else:
                        await self._dispatch(item.event, item.received, item.size)
                except DuplexError as err:
                    self._answer_error(err, event_id, joins)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # Nothing a client sends may crash the runner: log, answer, go on.
                    log.exception("session %s: event failed", self.session_id)
                    self._answer_error(InternalError(ErrorCode.INTERNAL, "internal error"), event_id, joins)
                finally:
                    self._busy = False
                self._check_overflow()  # once per item: a client that stopped reading is closed
        except asyncio.CancelledError:
            pass
        finally:
            if not self.closed:
                self._close(CloseReason.INTERNAL_ERROR)

    async def _next_item(self) -> _Inbound | SilenceRequest | _Recover | PlaceStages | None:
        item = self._mailbox.get_nowait()
        if item is None:
            item = await self._mailbox.get()
        if isinstance(item, _Wake):
            self._wake_queued = False
            self._look_at_deadlines()
            return None
        return item

    def _deadline(self) -> float:
        """When the session falls idle (or its detached grace ends), unless the client speaks;
        or when a restarted response that sent no audio yet runs out of time."""
        deadline = self._last_client + self._idle_timeout_s()
        if self._detached_at is not None:
            deadline = min(deadline, self._detached_at + self._cfg.detached_grace_s)
        return min(deadline, self._restart_deadline())

    def _look_at_deadlines(self) -> None:
        """In the runner, between events: close a session whose detached grace ended, or that
        was idle (no client event, no response) for its idle timeout; fail a restarted response
        that sent no audio within ``restart_timeout_s``."""
        now = self._clock.now()
        if now >= self._restart_deadline():
            self._restart_overdue()
        if self._detached_at is not None and now - self._detached_at >= self._cfg.detached_grace_s:
            self._close(CloseReason.DETACHED)
        elif self.response is None and now - self._last_client >= self._idle_timeout_s():
            self._close(CloseReason.IDLE_TIMEOUT)

    async def _watch_deadlines(self) -> None:
        """Sleeps until the next deadline (at most ``DEADLINE_LOOK_S``): one wake-up a second
        per session instead of a timer armed and cancelled for every event. A due idle or
        detached deadline is handed to the runner (it closes in order, between events); a
        submission not written in time is failed here (the runner awaits it)."""
        clock = self._clock
        while not self.closed:
            # A client that stopped reading while the runner waits in a long item (a recovery's
            # retries) is closed now, not when the item ends.
            if self._check_overflow():
                return
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

    # ---- responses and silence continuation ------------------------------------------------

    def _start_response(
        self,
        started_at: float,
        params: dict[str, Any] | None = None,
        *,
        restart: Restart | None = None,
        event_id: str = "",
    ) -> None:
        """Start a response to the committed input: for a new turn (``event_id``: the
        ``response_create`` that asked for it), or (``restart``) again for the turn of one its
        worker or replica lost."""
        if self._stages is not None:
            self._start_staged(started_at, params, restart, event_id)
            return
        link = self.link
        if link is None or not link.healthy:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker is unavailable")
        resp = self._begin_response(started_at, params, restart, event_id)
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
            resp.feeder = self._feeder(resp, max_frames=self._cfg.max_silence_frames)
            resp.feeder.start()

    def _on_respond_written(self, resp: ActiveResponse, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            return
        if self.response is resp and not self.closed:
            self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
            self._error(UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the response could not be sent"))

    # ---- worker outputs (called synchronously by the router) --------------------------------

    def on_output(
        self,
        fence: StepFence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
        input_seq: int = 0,
    ) -> None:
        """One step's news for this session (see ``session_service.session.worker_output``)."""
        if self.closed:
            DROPPED[DropReason.UNKNOWN_REQUEST].inc()
            return
        try:
            self._output.handle(fence, payload, updates, input_seq)
        except DuplexError as err:
            self._error(err)
        except Exception:
            log.exception("session %s: worker output failed", self.session_id)
            self._error(InternalError(ErrorCode.INTERNAL, "internal error"))
        self._check_overflow()

    # ---- the shell's side of the layers below ------------------------------------------------

    def _close(self, reason: CloseReason) -> None:
        if self.closed:
            return
        super()._close(reason)
        self._on_closed(self)
        if self._native_feeder is not None:
            self._native_feeder.stop()
        # Closed from the router, a timer or the server: stop the mailbox task too.
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._deadlines is not None and self._deadlines is not asyncio.current_task():
            self._deadlines.cancel()

    def _response_active(self, active: bool) -> None:
        if active:
            self._response_idle.clear()
        else:
            self._response_idle.set()

    def _schedule_recover(self) -> None:
        self._mailbox.put_control(_Recover())
