"""One runner per session: an ordered mailbox, the fence, the response lifecycle.

Client events are processed strictly in order by one asyncio task consuming a bounded
mailbox. Worker outputs arrive from the router synchronously (``on_output``): they are checked
against the fence and put on the session's single outbound queue without any await in between,
and a cancel (which also runs without awaiting) advances the epoch and purges that queue in one
go, so no audio of a cancelled epoch or an older turn can reach the client after
``audio_cancelled``.

An ``input_ack`` names the highest seq handed on to the worker, and is held back while more
than ``RunnerConfig.max_unconsumed_input_ms`` of handed-on audio is not yet consumed by it
(``RequestUpdate.input_seq``): a client that waits for acks never overruns the worker's input
queue. A new epoch, a lost or replaced worker, or a rejected submission releases held acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf import json_format, struct_pb2

from duplex.audio import PcmFormat
from duplex.errors import (
    BadEventError,
    DuplexError,
    ErrorCode,
    InternalError,
    UnavailableError,
)
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.metrics import (
    DROPPED,
    ERRORS_BY_CODE,
    EVENTS_IN,
    LATENCY_ACK,
    LATENCY_FIRST_AUDIO,
    MAILBOX_FULL,
    SILENCE_FRAMES,
    WORKER_SESSIONS,
)
from session_service.outbound import Outbound, OutboundOverflow
from session_service.plugin import (
    Capabilities,
    DuplexModelPlugin,
    Fence,
    FramePacketizer,
    OutputAction,
    ResponseProjection,
    SessionSettings,
    TurnDetection,
)

log = logging.getLogger(__name__)

APPEND = worker_pb2.SUBMISSION_KIND_APPEND
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
FAILED = session_pb2.RESPONSE_STATUS_FAILED
SPEECH_STARTED = worker_pb2.VadEvent.KIND_SPEECH_STARTED
SPEECH_STOPPED = worker_pb2.VadEvent.KIND_SPEECH_STOPPED

# Worker error codes a client may see as they are; anything else is a model error.
_PASS_THROUGH_CODES = {ErrorCode.NO_COMMITTED_INPUT.value, ErrorCode.MODEL_ERROR.value}


class WorkerHandle(Protocol):
    """The runner's view of the worker its session is placed on (a ``WorkerLink``)."""

    address: str

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
class ActiveResponse:
    response_id: str
    turn_id: int
    epoch: int
    proj: ResponseProjection
    started_at: float
    """Monotonic time of the commit / turn end it answers (first-audio latency)."""
    first_audio: bool = False
    played_ms: int = 0
    silence_task: asyncio.Task[None] | None = None


@dataclass(slots=True)
class _Inbound:
    event: session_pb2.ClientEvent
    received: float


@dataclass(slots=True)
class _Silence:
    response: ActiveResponse


@dataclass(slots=True)
class _Shutdown:
    reason: str


_MailItem = _Inbound | _Silence | _Shutdown


#: Bounds of ``turn_detection.silence_ms`` (checked here so a bad value fails the open or
#: update with a clear code instead of a worker rejection later).
MIN_SILENCE_MS = 100
MAX_SILENCE_MS = 10_000


def settings_from_proto(
    cfg: session_pb2.SessionConfig,
    base: SessionSettings | None,
    *,
    require_input: bool,
    default_turn: TurnDetection | None = None,
) -> SessionSettings:
    """Domain settings from a wire config; unset fields keep ``base`` (or, for a new session,
    ``default_turn``: the plugin's turn detection defaults). Raises BadEventError."""
    if cfg.HasField("input_format"):
        input_format = PcmFormat.from_proto(cfg.input_format)
    elif base is not None and not require_input:
        input_format = base.input_format
    else:
        raise BadEventError(ErrorCode.INVALID_CONFIG, "config.input_format is required")
    if cfg.HasField("output_format"):
        output_format = PcmFormat.from_proto(cfg.output_format)
    elif base is not None and not require_input:
        output_format = base.output_format
    else:
        # Default: the input's rate with the model's encoding (s16le), mono.
        output_format = PcmFormat(input_format.encoding, input_format.sample_rate_hz, 1)
    if cfg.HasField("turn_detection"):
        td = cfg.turn_detection
        if td.silence_ms and not MIN_SILENCE_MS <= td.silence_ms <= MAX_SILENCE_MS:
            raise BadEventError(
                ErrorCode.INVALID_CONFIG,
                "turn_detection.silence_ms must be 0 (the model's default) "
                f"or in [{MIN_SILENCE_MS}, {MAX_SILENCE_MS}]",
            )
        turn = TurnDetection(auto_respond=td.auto_respond, silence_ms=td.silence_ms, barge_in=td.barge_in)
    else:
        turn = base.turn_detection if base is not None else (default_turn or TurnDetection())
    for m in cfg.modalities:
        if m not in ("audio", "text"):
            raise BadEventError(ErrorCode.INVALID_CONFIG, f"unknown modality {m!r}")
    return SessionSettings(
        input_format=input_format,
        output_format=output_format,
        instructions=cfg.instructions or (base.instructions if base else ""),
        turn_detection=turn,
        modalities=tuple(cfg.modalities) or (base.modalities if base else ("audio",)),
        idle_timeout_s=cfg.idle_timeout_s or (base.idle_timeout_s if base else 0),
    )


#: Largest ``extra_body`` accepted. Checked on the wire size (computed in C) before the
#: pure-Python conversion, which a huge Struct would otherwise run on the event loop.
MAX_EXTRA_BODY_BYTES = 16 * 1024


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, object]:
    """A client Struct as a dict; raises ``invalid_runtime_config`` when it is too large."""
    size = s.ByteSize()
    if size > MAX_EXTRA_BODY_BYTES:
        raise BadEventError(
            ErrorCode.INVALID_RUNTIME_CONFIG,
            f"extra_body is {size} bytes; the limit is {MAX_EXTRA_BODY_BYTES}",
        )
    out: dict[str, object] = json_format.MessageToDict(s)
    return out


@dataclass(slots=True)
class RunnerDeps:
    """What a runner is built with besides its own settings."""

    plugin: DuplexModelPlugin
    capabilities: Capabilities
    config: RunnerConfig
    placer: Placer
    on_closed: Callable[[SessionRunner], None] = field(default=lambda _r: None)


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
    ) -> None:
        self.session_id = session_id
        self.settings = settings
        self.runtime_config = runtime_config
        self.epoch = epoch
        self.turn_id = 0
        self.resume_token = resume_token
        self._plugin = deps.plugin
        self._caps = deps.capabilities
        self._cfg = deps.config
        self._placer = deps.placer
        self._on_closed = deps.on_closed
        self.state = self._plugin.create_session_state(settings)
        self._sampling = self._plugin.configure_sampling_params(
            runtime_config=runtime_config, defaults=self._plugin.sampling_defaults
        )
        self.link: WorkerHandle | None = None
        self._bind(link)
        self.outbound = Outbound(
            lambda: self.epoch, limit=self._cfg.outbound_limit, limit_bytes=self._cfg.outbound_limit_bytes
        )
        self._mailbox: asyncio.Queue[_MailItem] = asyncio.Queue(self._cfg.mailbox_size)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._event_no = 0
        self._response: ActiveResponse | None = None
        self._response_idle = asyncio.Event()
        self._response_idle.set()
        self._has_committed = False
        self._speech_open = False
        self._last_seq = 0
        self._seq_restart_pending = False
        self._worker_seq = 0
        self._input_abandoned = False
        self._params_dirty = True  # the first submission carries the session's model options
        self._last_client = time.monotonic()
        self._commit_at = self._last_client
        self._frame_bytes = deps.plugin.frame_samples * deps.plugin.worker_format.frame_bytes
        self._silence_frame = b"\x00" * self._frame_bytes
        self._frame_period = deps.plugin.frame_samples / deps.plugin.worker_format.sample_rate_hz
        self._fence_cache = Fence(session_id, epoch, 0)
        # Backpressure through acks (RunnerConfig.max_unconsumed_input_ms): the worker frames
        # handed on in this epoch on this link, and how many of them the worker has consumed.
        hold_ms = self._cfg.max_unconsumed_input_ms
        self._ack_bound = max(1, math.ceil(hold_ms / (1000.0 * self._frame_period))) if hold_ms > 0 else 0
        self._frames_sent = 0
        self._frames_consumed = 0
        self._inflight: deque[tuple[int, int]] = deque()
        """(worker seq, ``_frames_sent`` once it was handed on) of APPENDs not yet consumed."""
        self._held_acks: deque[tuple[int, int, float]] = deque()
        """(client seq, epoch, received) of appends handed on whose acks wait for the worker."""

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def response_active(self) -> bool:
        return self._response is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")

    async def post(self, event: session_pb2.ClientEvent, received: float | None = None) -> None:
        """Queue a client event (waits while the mailbox is full: backpressure to the client)."""
        if self._closed:
            return
        now = self._last_client = time.monotonic()
        item = _Inbound(event, received if received is not None else now)
        try:
            self._mailbox.put_nowait(item)
        except asyncio.QueueFull:
            await self._mailbox.put(item)

    def close(self, reason: str) -> None:
        """Close from outside the runner (drain, shutdown): answer ``closed`` and stop."""
        self._close(reason)

    async def wait_response_idle(self) -> None:
        """Returns once no response is active (for drain)."""
        while self._response is not None and not self._closed:
            await self._response_idle.wait()

    async def wait_closed(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def opened_event(self) -> session_pb2.ServerEvent:
        return self._event(
            "opened",
            session_pb2.SessionOpened(
                session_id=self.session_id,
                epoch=self.epoch,
                capabilities=self._caps.to_proto(),
                resume_token=self.resume_token,
                config=self.settings.to_proto(),
            ),
        )

    def greet(self) -> None:
        """Put ``opened`` at the head of the queue (a resumed stream sees it first)."""
        self.outbound.put_front(self.opened_event())

    def go_away(self, reason: str) -> None:
        self._safe_emit("go_away", session_pb2.GoAway(resume_token=self.resume_token, reason=reason))

    async def _run(self) -> None:
        try:
            while not self._closed:
                item = await self._next_item()
                if item is None:
                    continue
                event_id = item.event.event_id if isinstance(item, _Inbound) else ""
                try:
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
            if not self._closed:
                self._close("internal_error")

    async def _next_item(self) -> _MailItem | None:
        if not self._mailbox.empty():  # the common case under load: no timer, no suspension
            return self._mailbox.get_nowait()
        # A client may shorten the operator's idle timeout, never extend it: an abandoned
        # session must not pin capacity longer than the operator allows.
        idle = float(min(self.settings.idle_timeout_s or self._cfg.idle_timeout_s, self._cfg.idle_timeout_s))
        wait = max(0.05, self._last_client + idle - time.monotonic())
        try:
            async with asyncio.timeout(wait):
                return await self._mailbox.get()
        except TimeoutError:
            if self._response is None and time.monotonic() - self._last_client >= idle:
                self._close("idle_timeout")
            return None

    async def _dispatch(self, item: _MailItem) -> None:
        if isinstance(item, _Shutdown):
            self._close(item.reason)
            return
        if isinstance(item, _Silence):
            await self._on_silence(item)
            return
        ev = item.event
        kind = ev.WhichOneof("event")
        EVENTS_IN[kind or "none"].inc()
        if kind in ("open", "resume"):
            raise BadEventError(ErrorCode.ALREADY_OPEN, "the session is already open")
        if kind == "append":
            await self._on_append(ev.append, item.received)
        elif kind == "commit":
            await self._on_commit(item.received)
        elif kind == "clear":
            await self._on_clear()
        elif kind == "response_create":
            await self._on_response_create(ev.response_create, item.received)
        elif kind == "response_cancel":
            self._on_response_cancel(ev.response_cancel)
        elif kind == "barge_in":
            self._cancel("barge_in")
        elif kind == "update":
            self._on_update(ev.update)
        elif kind == "playback_ack":
            resp = self._response
            if resp is not None and ev.playback_ack.response_id in ("", resp.response_id):
                resp.played_ms = max(resp.played_ms, int(ev.playback_ack.played_ms))
        elif kind == "function_call_output":
            fco = ev.function_call_output
            patch = self._plugin.runtime_config_for_function_output(
                self.settings, self.runtime_config, fco.call_id, fco.output
            )
            if patch:
                self._apply_runtime(dict(self.runtime_config) | patch)
        elif kind == "close":
            self._close("client_close")
        else:
            raise BadEventError(ErrorCode.INVALID_EVENT, "empty client event")

    # ---- emitting --------------------------------------------------------------------------

    def _event(self, which: str, msg: Any) -> session_pb2.ServerEvent:
        self._event_no += 1
        return session_pb2.ServerEvent(event_id=f"se_{self._event_no}", **{which: msg})

    def _emit(self, which: str, msg: Any) -> None:
        self.outbound.put(self._event(which, msg))

    def _safe_emit(self, which: str, msg: Any) -> None:
        try:
            self._emit(which, msg)
        except OutboundOverflow:
            self._close("slow_consumer")

    def _error(self, err: DuplexError, event_id: str = "") -> None:
        ERRORS_BY_CODE[err.code].inc()
        self._safe_emit(
            "error",
            session_pb2.Error(code=err.code, message=err.message, event_id=event_id, retryable=err.retryable),
        )

    def _emit_response_output(self, event: session_pb2.ServerEvent, resp: ActiveResponse) -> bool:
        # The last-moment fence check: the response must still be the active one, of this epoch.
        if self._response is not resp or resp.epoch != self.epoch or self._closed:
            DROPPED["response_cancelled"].inc()
            return False
        self._event_no += 1
        event.event_id = f"se_{self._event_no}"
        self.outbound.put(event, epoch=resp.epoch)
        return True

    # ---- worker binding --------------------------------------------------------------------

    def _bind(self, link: WorkerHandle | None) -> None:
        if self.link is not None:
            WORKER_SESSIONS.labels(worker=self.link.address).dec()
        self.link = link
        if link is not None:
            WORKER_SESSIONS.labels(worker=link.address).inc()

    async def _bound_link(self) -> WorkerHandle:
        link = self.link
        if link is not None and link.healthy:
            return link
        try:
            link, granted = await self._placer(self.session_id, self.epoch, False)
        except DuplexError as err:
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"no worker for the session: {err.message}"
            ) from err
        if granted > self.epoch:
            self.epoch = granted
            self._worker_seq = 0
        self._bind(link)
        self._params_dirty = True
        # Bound first: emitting held acks may overflow the outbound queue and close the session,
        # which must then release the new placement too.
        self._reset_input_tracking()  # nothing is in flight on the new placement
        return link

    def _fence(self) -> Fence:
        f = self._fence_cache
        if f.epoch != self.epoch or f.turn_id != self.turn_id:
            f = self._fence_cache = Fence(self.session_id, self.epoch, self.turn_id)
        return f

    # ---- input acks with backpressure ------------------------------------------------------

    @property
    def unconsumed_frames(self) -> int:
        """Worker frames handed on in this epoch that the worker has not reported consumed."""
        return self._frames_sent - self._frames_consumed

    def _handed_on(self, link: WorkerHandle, wseq: int, frames: int) -> None:
        """An APPEND of ``frames`` worker frames was written under worker seq ``wseq``."""
        if self.link is not link:
            return  # its worker is gone (and with it the input): nothing to wait for
        self._frames_sent += frames
        self._inflight.append((wseq, self._frames_sent))

    def _consumed(self, wseq: int) -> None:
        """The worker consumed every APPEND up to worker seq ``wseq`` of the current epoch."""
        inflight = self._inflight
        while inflight and inflight[0][0] <= wseq:
            self._frames_consumed = inflight.popleft()[1]
        if self._held_acks and self._frames_sent - self._frames_consumed <= self._ack_bound:
            self._release_acks()

    def _reset_input_tracking(self) -> None:
        """The worker's input position starts over (new epoch, worker lost or replaced, input
        rejected): nothing handed on is awaited any more, and held acks go out (their appends
        were handed on; what became of them the client learns from the event that caused this)."""
        self._inflight.clear()
        self._frames_sent = self._frames_consumed = 0
        self._release_acks()

    def _ack(self, seq: int, epoch: int, received: float) -> None:
        """Acknowledge an append that was handed on, or hold the ack while the worker is behind."""
        if self._held_acks or (
            self._ack_bound and self._frames_sent - self._frames_consumed > self._ack_bound
        ):
            self._held_acks.append((seq, epoch, received))
            return
        now = time.monotonic()
        self._emit_ack(seq, epoch)
        LATENCY_ACK.observe(now - received)

    def _release_acks(self) -> None:
        """Send the held acks: one per epoch, carrying the highest seq handed on."""
        held = self._held_acks
        if not held:
            return
        now = time.monotonic()
        last_seq, last_epoch = 0, held[0][1]
        for seq, epoch, received in held:
            if epoch != last_epoch:
                self._emit_ack(last_seq, last_epoch)
            last_seq, last_epoch = seq, epoch
            LATENCY_ACK.observe(now - received)
        held.clear()
        self._emit_ack(last_seq, last_epoch)

    def _emit_ack(self, seq: int, epoch: int) -> None:
        # Built in place: no intermediate message to copy (this runs once per client chunk).
        self._event_no += 1
        ev = session_pb2.ServerEvent(event_id=f"se_{self._event_no}")
        ack = ev.input_ack
        ack.seq = seq
        ack.epoch = epoch
        self.outbound.put(ev)

    def _take_params(self) -> dict[str, Any] | None:
        if not self._params_dirty:
            return None
        self._params_dirty = False
        return self._plugin.worker_params(
            settings=self.settings, runtime_config=self.runtime_config, sampling=self._sampling
        )

    async def _submit(self, link: WorkerHandle, subs: Sequence[worker_pb2.Submission]) -> None:
        try:
            async with asyncio.timeout(self._cfg.submit_timeout_s):
                await link.submit(subs)
        except DuplexError:
            raise
        except (TimeoutError, ConnectionError) as exc:
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"worker did not take the input: {exc}"
            ) from exc

    def on_worker_lost(self, link: WorkerHandle) -> None:
        """The worker went away: its model state is gone; fail what depended on it."""
        if self.link is not link or self._closed:
            return
        self._bind(None)
        # The worker's model state went with it: uncommitted input (so no hole to protect) and
        # any committed utterance. The next submission starts over on a healthy worker.
        self._input_abandoned = False
        self._has_committed = False
        self.state.input_since_commit_samples = 0
        try:
            self._reset_input_tracking()  # what it held will never be consumed: no ack waits on it
            if self._speech_open:
                # The VAD that heard the speech is gone: close the span so events stay paired.
                self._speech_open = False
                self._emit("speech_stopped", session_pb2.SpeechStopped(audio_ms=0))
            if self._response is not None:
                self._finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
            self._error(UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker went away"))
        except OutboundOverflow:
            self._close("slow_consumer")

    # ---- client events ---------------------------------------------------------------------

    async def _on_append(self, ap: session_pb2.InputAudioAppend, received: float) -> None:
        fmt = self.settings.input_format
        if ap.HasField("format"):
            declared = PcmFormat.from_proto(ap.format)  # unsupported_audio_format
            if declared != fmt:
                raise BadEventError(
                    ErrorCode.AUDIO_FORMAT_MISMATCH, f"append declares {declared}, the session input is {fmt}"
                )
        if len(ap.pcm) > self._caps.max_append_bytes:
            raise BadEventError(
                ErrorCode.CHUNK_TOO_LARGE,
                f"{len(ap.pcm)} bytes > max_append_bytes {self._caps.max_append_bytes}",
            )
        if not ap.pcm or len(ap.pcm) % fmt.frame_bytes:
            raise BadEventError(
                ErrorCode.INVALID_PCM_LENGTH,
                f"{len(ap.pcm)} bytes is not a positive whole number of {fmt.frame_bytes}-byte frames "
                f"for {fmt}",
            )
        if self._seq_restart_pending and ap.seq == 1:
            # The client saw audio_cancelled and restarted; appends it sent before are behind us.
            self._seq_restart_pending = False
            self._last_seq = 0
        if ap.seq <= self._last_seq:
            raise BadEventError(ErrorCode.SEQ_OUT_OF_ORDER, f"seq {ap.seq} after {self._last_seq}")
        if self._input_abandoned:
            raise BadEventError(
                ErrorCode.INPUT_ABANDONED,
                "an earlier append failed; input is abandoned until commit, clear or cancel",
                retryable=True,
            )
        self._last_seq = ap.seq
        link = self.link
        if link is None or not link.healthy:
            link = await self._bound_link()
        fence = self._fence()
        res = self.state.audio_buffer.reserve_append(ap.pcm)
        frames = res.frames
        try:
            if frames:
                wseq = self._worker_seq + 1
                params = self._take_params()
                subs = self._plugin.plan_append(
                    request_id=self.session_id, fence=fence, seq=wseq, frames=frames, params=params
                )
                try:
                    await self._submit(link, subs)
                except BaseException:
                    self._params_dirty = self._params_dirty or params is not None
                    raise
                if self.epoch == fence.epoch:
                    self._worker_seq = wseq
                    self._handed_on(link, wseq, len(frames) // self._frame_bytes)
        except BaseException:
            res.rollback()
            if self.link is link:  # a write lost with its worker leaves no hole: that input is gone too
                self._input_abandoned = True
            raise
        res.commit()
        self.state.input_since_commit_samples += len(frames) // self._plugin.worker_format.frame_bytes
        self.state.last_native_submit_monotonic = time.monotonic()
        if self.epoch == fence.epoch:
            self._ack(ap.seq, fence.epoch, received)
        else:  # cancelled meanwhile: the ack of an older epoch holds nothing back
            self._emit_ack(ap.seq, fence.epoch)
            LATENCY_ACK.observe(time.monotonic() - received)

    async def _on_commit(self, received: float) -> None:
        link = await self._bound_link()
        fence = self._fence()
        res = self.state.audio_buffer.reserve_flush()
        if not res.frames and self.state.input_since_commit_samples == 0:
            res.rollback()
            raise BadEventError(ErrorCode.NO_COMMITTED_INPUT, "no input to commit")
        frames = res.frames
        try:
            params = self._take_params()
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
            self._params_dirty = True
            raise
        res.commit()
        if frames and self.epoch == fence.epoch:
            self._worker_seq += 1
            self._handed_on(link, self._worker_seq, len(frames) // self._frame_bytes)
        samples = (
            self.state.input_since_commit_samples + len(frames) // self._plugin.worker_format.frame_bytes
        )
        self.state.input_since_commit_samples = 0
        self._input_abandoned = False
        self._has_committed = True
        self._commit_at = received
        audio_ms = samples * 1000 // self._plugin.worker_format.sample_rate_hz
        self._emit("committed", session_pb2.InputCommitted(turn_id=self.turn_id + 1, audio_ms=audio_ms))

    async def _on_clear(self) -> None:
        link = await self._bound_link()
        self.state.audio_buffer.clear()
        sub = self._plugin.plan_control(
            request_id=self.session_id, fence=self._fence(), kind=CLEAR, params=self._take_params()
        )
        await self._submit(link, [sub])
        self.state.input_since_commit_samples = 0
        self._input_abandoned = False
        self._emit("cleared", session_pb2.InputCleared())

    async def _on_response_create(self, rc: session_pb2.ResponseCreate, received: float) -> None:
        if self._response is not None:
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        if not self._has_committed:
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
            self._params_dirty = True  # the session's own options return after this response
        await self._bound_link()
        self._start_response(self._commit_at, params)

    def _on_response_cancel(self, rc: session_pb2.ResponseCancel) -> None:
        resp = self._response
        if resp is None or rc.response_id not in ("", resp.response_id):
            raise BadEventError(ErrorCode.NO_ACTIVE_RESPONSE, "no such active response")
        self._cancel("response_cancel")

    def _check_model_key(self, extra: dict[str, object]) -> None:
        model = extra.pop("model", None)
        if model is not None and model != self._plugin.plugin_id:
            raise BadEventError(ErrorCode.MODEL_CHANGE_REFUSED, "the model of a session cannot change")

    def _on_update(self, up: session_pb2.SessionUpdate) -> None:
        extra = struct_to_dict(up.extra_body)
        self._check_model_key(extra)
        new = settings_from_proto(up.config, self.settings, require_input=False)
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
        self.settings = new
        self._apply_runtime(runtime)
        self._emit("updated", session_pb2.SessionUpdated(config=new.to_proto()))

    def _apply_runtime(self, runtime: dict[str, object]) -> None:
        self.runtime_config = runtime
        self._sampling = self._plugin.configure_sampling_params(
            runtime_config=runtime, defaults=self._plugin.sampling_defaults
        )
        self._params_dirty = True

    # ---- responses -------------------------------------------------------------------------

    def _start_response(self, started_at: float, params: dict[str, Any] | None = None) -> None:
        link = self.link
        if link is None or not link.healthy:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker is unavailable")
        self.turn_id += 1
        resp = ActiveResponse(
            response_id=f"resp_{uuid.uuid4().hex[:16]}",
            turn_id=self.turn_id,
            epoch=self.epoch,
            proj=self._plugin.data_plane.begin_response(
                response_id="",
                turn_id=self.turn_id,
                epoch=self.epoch,
                worker_format=self._plugin.worker_format,
                output_format=self.settings.output_format,
            ),
            started_at=started_at,
        )
        resp.proj.response_id = resp.response_id
        self._response = resp
        self._response_idle.clear()
        self._has_committed = False
        self.state.context_locked = True
        self.state.clear_continuation()
        self._emit(
            "response_started",
            session_pb2.ResponseStarted(response_id=resp.response_id, turn_id=resp.turn_id, epoch=resp.epoch),
        )
        sub = self._plugin.plan_control(
            request_id=self.session_id,
            fence=self._fence(),
            kind=RESPOND,
            params=params if params is not None else self._take_params(),
        )
        fut = link.submit([sub])
        fut.add_done_callback(lambda f: self._on_respond_written(resp, f))
        # A lockstep model advances its reply one frame per input frame: without client audio the
        # turn would stall, so silence is fed at real-time deadlines while the response is active.
        if (
            self._plugin.silence_continuation
            and self._cfg.silence_continuation
            and self._cfg.max_silence_frames > 0
        ):
            resp.silence_task = asyncio.create_task(self._silence_loop(resp))

    def _on_respond_written(self, resp: ActiveResponse, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            return
        if self._response is resp and not self._closed:
            try:
                self._finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
                self._error(UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the response could not be sent"))
            except OutboundOverflow:
                self._close("slow_consumer")

    def _end_response(self) -> ActiveResponse | None:
        resp = self._response
        self._response = None
        self._response_idle.set()
        if resp is not None and resp.silence_task is not None:
            resp.silence_task.cancel()
        return resp

    def _finish_response(self, status: int, reason: str) -> None:
        resp = self._end_response()
        if resp is None:
            return
        self._emit(
            "response_done",
            session_pb2.ResponseDone(
                response_id=resp.response_id,
                turn_id=resp.turn_id,
                status=status,  # type: ignore[arg-type]
                reason=reason,
                audio_ms=resp.proj.audio_ms,
            ),
        )
        if status == COMPLETED:
            self._plugin.commit_model_context(
                session_id=self.session_id, assistant_text="".join(resp.proj.text)
            )
            self.state.committed_turns += 1
            if self._has_committed and self.settings.turn_detection.auto_respond:
                # The user finished another turn while we replied: answer it now.
                self._start_response(time.monotonic())

    def _cancel(self, reason: str) -> None:
        """Advance the epoch: nothing of the old epoch reaches the client after this returns."""
        resp = self._end_response()
        # The fence moves first, before anything is emitted: even if emitting overflows the
        # outbound queue (the session then closes), no old-epoch audio can follow.
        old = self.epoch
        self.epoch += 1
        self._worker_seq = 0
        self._seq_restart_pending = True
        self._input_abandoned = False
        self.outbound.purge_before(self.epoch)
        if self.link is not None:
            self.link.abort(
                worker_pb2.Abort(request_id=self.session_id, fence=self._fence().to_proto(), reason=reason)
            )
        # Worker seqs restart with the epoch and the worker drops the old epoch's input: acks
        # held for it go out now (they carry the old epoch), before ``audio_cancelled``.
        self._reset_input_tracking()
        self._emit(
            "audio_cancelled",
            session_pb2.AudioCancelled(
                response_id=resp.response_id if resp else "",
                cancelled_epoch=old,
                epoch=self.epoch,
                reason=reason,
            ),
        )
        if resp is not None:
            self._emit(
                "response_done",
                session_pb2.ResponseDone(
                    response_id=resp.response_id,
                    turn_id=resp.turn_id,
                    status=CANCELLED,
                    reason=reason,
                    audio_ms=resp.proj.audio_ms,
                ),
            )

    # ---- silence continuation --------------------------------------------------------------

    async def _silence_loop(self, resp: ActiveResponse) -> None:
        period = self._frame_period
        deadline = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            if self._response is not resp or self._closed:
                return
            if self.state.continuation_units >= self._cfg.max_silence_frames:
                return
            now = time.monotonic()
            last = self.state.last_native_submit_monotonic
            if last is None or now - last >= period:
                try:
                    self._mailbox.put_nowait(_Silence(resp))
                except asyncio.QueueFull:
                    MAILBOX_FULL.inc()
            deadline += period
            if deadline < now:  # fell behind: re-align instead of bursting
                deadline = now + period

    async def _on_silence(self, item: _Silence) -> None:
        resp = item.response
        # Skipped when real input is waiting or the epoch/turn/response changed.
        if self._response is not resp or resp.epoch != self.epoch or resp.turn_id != self.turn_id:
            return
        if not self._mailbox.empty():
            return
        link = self.link
        if link is None or not link.healthy:
            return
        wseq = self._worker_seq + 1
        subs = self._plugin.plan_append(
            request_id=self.session_id, fence=self._fence(), seq=wseq, frames=self._silence_frame, params=None
        )
        await self._submit(link, subs)
        if self.epoch == resp.epoch:
            self._worker_seq = wseq
            self._handed_on(link, wseq, 1)
        self.state.continuation_units += 1
        SILENCE_FRAMES.inc()

    # ---- worker outputs (called synchronously by the router) --------------------------------

    def on_output(
        self,
        fence: common_pb2.Fence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
    ) -> None:
        """One step's news for this session: updates first, then audio, then completions."""
        if self._closed:
            DROPPED["unknown_request"].inc()
            return
        try:
            live = [u for u in updates if self._on_news(u)]
            if payload is not None:
                self._on_audio(fence, payload)
            for u in live:
                self._on_terminal(u)
        except OutboundOverflow:
            self._close("slow_consumer")
        except DuplexError as err:
            self._error(err)
        except Exception:
            log.exception("session %s: worker output failed", self.session_id)
            self._error(InternalError(ErrorCode.INTERNAL, "internal error"))

    def _on_news(self, u: worker_pb2.RequestUpdate) -> bool:
        """Non-terminal news; returns whether the update is current (not fenced off)."""
        if u.HasField("error"):
            self._on_worker_error(u)
            return False
        if u.fence.epoch < self.epoch:
            DROPPED["stale_epoch"].inc()
            return False
        if u.input_seq and u.fence.epoch == self.epoch:
            self._consumed(u.input_seq)
        rate = self._plugin.worker_format.sample_rate_hz
        for vad in u.vad:
            if vad.kind == SPEECH_STARTED:
                self._speech_open = True
                self._emit(
                    "speech_started", session_pb2.SpeechStarted(audio_ms=vad.sample_offset * 1000 // rate)
                )
                # Only speech in input appended after the response began interrupts it: speech the
                # worker finds in older, still-queued input (a fast client's commit) is the turn
                # being answered, not a barge-in. The APPEND's fence tells which.
                resp = self._response
                if (
                    resp is not None
                    and self.settings.turn_detection.barge_in
                    and u.fence.turn_id >= resp.turn_id
                ):
                    self._cancel("barge_in")
            elif vad.kind == SPEECH_STOPPED and self._speech_open:
                self._speech_open = False
                self._emit(
                    "speech_stopped", session_pb2.SpeechStopped(audio_ms=vad.sample_offset * 1000 // rate)
                )
        if u.text:
            resp = self._response
            if resp is not None and u.fence.turn_id == resp.turn_id:
                for ev in self._plugin.data_plane.project_text(resp.proj, u.text):
                    self._emit_response_output(ev, resp)
            else:
                DROPPED["stale_turn"].inc()
        if u.turn_ended:
            self._on_turn_ended(u)
        patch = self._plugin.runtime_config_after_model_output(self.runtime_config, u)
        if patch:
            self._apply_runtime(dict(self.runtime_config) | patch)
        return True

    def _on_turn_ended(self, u: worker_pb2.RequestUpdate) -> None:
        rate = self._plugin.worker_format.sample_rate_hz
        if self._speech_open:
            self._speech_open = False
            self._emit("speech_stopped", session_pb2.SpeechStopped(audio_ms=0))
        self._has_committed = True
        self.state.input_since_commit_samples = 0
        self._commit_at = time.monotonic()
        self._emit(
            "committed",
            session_pb2.InputCommitted(turn_id=self.turn_id + 1, audio_ms=u.committed_samples * 1000 // rate),
        )
        if self.settings.turn_detection.auto_respond and self._response is None:
            self._start_response(self._commit_at)

    def _on_audio(self, fence: common_pb2.Fence | None, payload: common_pb2.AudioPayload) -> None:
        resp = self._response
        if fence is None:
            DROPPED["unknown_request"].inc()
            return
        if fence.epoch != self.epoch:
            DROPPED["stale_epoch"].inc()
            return
        if fence.session_id != self.session_id:
            # A worker that mislabelled a step: never play another session's audio.
            DROPPED["wrong_session"].inc()
            return
        if resp is None or fence.turn_id != resp.turn_id:
            stale = fence.turn_id < self.turn_id
            DROPPED["stale_turn" if stale else "response_cancelled"].inc()
            return
        events = self._plugin.data_plane.project_audio(resp.proj, payload)
        sent = False
        for ev in events:
            sent = self._emit_response_output(ev, resp) or sent
        if sent and not resp.first_audio:
            resp.first_audio = True
            LATENCY_FIRST_AUDIO.observe(time.monotonic() - resp.started_at)

    def _on_terminal(self, u: worker_pb2.RequestUpdate) -> None:
        resp = self._response
        if resp is None or u.fence.turn_id != resp.turn_id or u.fence.epoch != resp.epoch:
            if u.response_finished:
                DROPPED["stale_turn"].inc()
            return
        decision = self._plugin.decide_output(u)
        if decision is not None and decision.action == OutputAction.COMPLETE:
            self._finish_response(COMPLETED, "")
        elif decision is not None and decision.action == OutputAction.FAIL:
            self._finish_response(FAILED, decision.reason)

    def _on_worker_error(self, u: worker_pb2.RequestUpdate) -> None:
        code = u.error.code
        if u.fence.epoch < self.epoch:
            DROPPED["stale_epoch"].inc()
            return
        if code in (ErrorCode.NOT_OWNER.value, ErrorCode.STALE_EPOCH.value):
            # Our current epoch was refused: another replica took the session over. Fail closed.
            DROPPED["stale_epoch"].inc()
            self._error(BadEventError(ErrorCode.FENCED, "the session was taken over elsewhere"))
            self._close("fenced")
            return
        # A rejected submission (an APPEND refused for capacity, say) is never consumed: stop
        # waiting for it rather than hold acks for ever.
        self._reset_input_tracking()
        resp = self._response
        if resp is not None and u.fence.turn_id == resp.turn_id:
            self._finish_response(FAILED, code or ErrorCode.MODEL_ERROR.value)
        shown = code if code in _PASS_THROUGH_CODES else ErrorCode.MODEL_ERROR.value
        if code == "capacity":
            shown = ErrorCode.CAPACITY_EXHAUSTED.value
        self._error(BadEventError(shown, u.error.message or code))

    # ---- closing ---------------------------------------------------------------------------

    def _close(self, reason: str) -> None:
        if self._closed:
            return
        try:
            resp = self._end_response()
            if resp is not None:
                self._emit(
                    "response_done",
                    session_pb2.ResponseDone(
                        response_id=resp.response_id,
                        turn_id=resp.turn_id,
                        status=CANCELLED,
                        reason="session_closed",
                        audio_ms=resp.proj.audio_ms,
                    ),
                )
            self._emit("closed", session_pb2.SessionClosed(reason=reason))
        except OutboundOverflow:
            pass
        self._closed = True
        if self.link is not None:
            self.link.release(worker_pb2.Release(request_id=self.session_id, fence=self._fence().to_proto()))
            self._bind(None)
        self.outbound.close()
        self._on_closed(self)
        # Closed from the router, a timer or the server: stop the mailbox task too.
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
