"""The client's events, each applied to the session in order (``SessionRunner`` dispatches).

Appends (checked, then handed to the worker under the next worker seq), commit, clear,
``response_create`` / ``response_cancel``, ``update``, ``barge_in``, ``function_call_output``,
``close``. An event that needs the worker binds the session first (``Failover._bound_link``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from duplex.audio import F32LE, PcmFormat
from duplex.errors import BadEventError, DuplexError, ErrorCode, InternalError, UnavailableError
from duplex.fence import Fence
from duplex.v1 import session_pb2, worker_pb2
from session_service.metrics import EVENTS_IN
from session_service.plugin import FramePacketizer
from session_service.session.ack_window import Ack
from session_service.session.answer_order import AnswerOrder
from session_service.session.failover import Failover
from session_service.session.lifecycle import CloseReason, InputStatus, SeqStatus, TurnStatus
from session_service.session.mailbox import Mailbox
from session_service.session.settings import settings_from_proto, struct_to_dict
from session_service.session.worker_handle import WorkerHandle

COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
#: Client events that presume turns: a model-native model (it decides when to speak) refuses them.
TURN_EVENTS = frozenset({"commit", "clear", "response_create", "barge_in"})

log = logging.getLogger("session_service.session.runner")


def _write_error(exc: BaseException) -> DuplexError:
    """A failure as the client hears of it (``Failover._submit``, the runner's catch-all)."""
    if isinstance(exc, DuplexError):
        return exc
    if isinstance(exc, (TimeoutError, ConnectionError, asyncio.CancelledError)):
        return UnavailableError(ErrorCode.WORKER_UNAVAILABLE, f"worker did not take the input: {exc}")
    return InternalError(ErrorCode.INTERNAL, "internal error")


class ClientEvents(Failover):
    """The handlers of client events (a layer of ``SessionRunner``)."""

    _mailbox: Mailbox[Any]
    _answers: AnswerOrder
    """Appends are answered (acked, or refused) in order, though some wait for their write."""
    _busy: bool
    """The runner's task is inside an item (it may be awaiting in it)."""

    async def _dispatch(self, ev: session_pb2.ClientEvent, received: float, size: int) -> None:
        """Handle one client event from the mailbox (``size``: its ``ByteSize()``)."""
        kind = ev.WhichOneof("event")
        EVENTS_IN[kind or "none"].inc()
        if kind in TURN_EVENTS and self._plugin.model_native:
            raise BadEventError(
                ErrorCode.UNSUPPORTED_BY_MODEL,
                f"{kind}: the model decides itself when to speak (model-native duplex): no turns to "
                "commit, clear, ask for or barge in on; response_cancel silences what it says",
            )
        match kind:
            case "append":
                link = self.link
                if link is not None and self._append_pipelined(size):
                    # Not awaiting its write: the next append finds the runner idle.
                    self._append_now(ev.append, received, link, ev.event_id, size)
                else:
                    await self._on_append(ev.append, received)
            case "commit":
                await self._on_commit(received, ev.event_id)
            case "clear":
                await self._on_clear()
            case "response_create":
                await self._on_response_create(ev.response_create, ev.event_id)
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
                self._close(CloseReason.CLIENT_CLOSE)
            case "open" | "resume":
                raise BadEventError(ErrorCode.ALREADY_OPEN, "the session is already open")
            case _:
                raise BadEventError(ErrorCode.INVALID_EVENT, "empty or unreadable client event")

    def _joins_earlier_writes(self, ev: session_pb2.ClientEvent, size: int) -> bool:
        """Whether the runner hands this event to the link without first waiting for the writes
        of earlier appends: an append applied at once (``_append_pipelined``), and a commit or a
        clear, which so joins those appends' command rather than waiting for the next (their
        handlers wait for the appends' answers before answering; see ``_answer_error``)."""
        kind = ev.WhichOneof("event")
        return kind in ("commit", "clear") or (kind == "append" and self._append_pipelined(size))

    def _answer_error(self, err: DuplexError, event_id: str, after_appends: bool) -> None:
        """Answer an event's failure; ``after_appends``: once earlier appends are answered."""
        if after_appends:
            self._answers.now(lambda: self._error(err, event_id))
        else:
            self._error(err, event_id)

    def _append_pipelined(self, size: int) -> bool:
        """Whether the runner applies an append of ``size`` bytes (the caller knows the event is
        one) without awaiting its write or the writes of earlier appends (its ack is ordered
        after theirs all the same): the session's link is healthy and the append's bytes fit the
        mailbox's bound. Appends queued behind a control event then go out together, in the
        worker's next command, not one per command (one per worker tick, where the link writes
        once a tick)."""
        link = self.link
        return link is not None and link.healthy and self._mailbox.has_room(size)

    async def _on_append(self, ap: session_pb2.InputAudioAppend, received: float) -> None:
        pcm = ap.pcm  # read once: each read of a bytes field copies it
        seq_epoch = self._accept_append(ap, pcm)
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
                    if not (self._goes_on_without(link) and self.epoch == fence.epoch):
                        raise
                    # Lost with its worker mid-write: the session moves (the turn's input is
                    # replayed there, or a model-native model starts afresh) and the append goes
                    # to the new worker.
                    link = await self._bound_link()
                    fence = self._fence()
                    wseq = await self._append_frames(link, fence, frames)
                if self.epoch == fence.epoch:
                    self._worker_seq = wseq
                    # Kept even when its worker was lost meanwhile: the move replays it.
                    self.replay.appended(frames, epoch=fence.epoch, seq=wseq, turn_id=fence.turn_id)
                    self._handed_on(link, wseq, len(frames) // self._frame_bytes)
        except BaseException:
            res.rollback()
            if self.link is link:  # a write lost with its worker leaves no hole: that input is gone too
                self.input_status = InputStatus.ABANDONED
            raise
        res.commit()
        self._took_input(len(frames), len(pcm), received)
        seq = ap.seq
        self._answers.now(lambda: self._ack_append(seq, seq_epoch, fence, received))

    def _append_at_once(self, event: session_pb2.ClientEvent, received: float, size: int) -> bool:
        """Apply an append in the caller's task (no task woken) when the runner is idle with an
        empty mailbox, the session's worker is healthy, and the appends awaiting their write fit
        the mailbox's byte bound with it (they count against it). Returns whether it did."""
        link = self.link
        if (
            self._busy
            or link is None
            or not link.healthy
            or event.WhichOneof("event") != "append"
            or not self._mailbox.takes_at_once(size)
        ):
            return False
        EVENTS_IN["append"].inc()
        try:
            self._append_now(event.append, received, link, event.event_id, size)
        except Exception as exc:
            if not isinstance(exc, DuplexError):
                log.exception("session %s: event failed", self.session_id)
            err = _write_error(exc)
            self._answers.now(lambda: self._error(err, event.event_id))  # after earlier appends' acks
        self._check_overflow()
        return True

    def _append_now(
        self,
        ap: session_pb2.InputAudioAppend,
        received: float,
        link: WorkerHandle,
        event_id: str,
        size: int,
    ) -> None:
        """An append applied in the caller's task (the client stream's reader) while the runner
        has nothing ahead of it and the session is bound: no task is woken for it. Its frames
        are queued on the link, and what ``_on_append`` does after awaiting the write is done
        now (the input is in the replay log, so a worker lost before the write replays it);
        its ack goes out once the write is done, after those of earlier appends
        (``_append_written``)."""
        pcm = ap.pcm
        seq_epoch = self._accept_append(ap, pcm)
        fence = self._fence()
        res = self.state.audio_buffer.reserve_append(pcm)
        frames = res.frames
        seq = ap.seq
        if not frames:  # a part of a frame: kept for the next append
            res.commit()
            self._took_input(0, len(pcm), received)
            self._answers.now(lambda: self._ack_append(seq, seq_epoch, fence, received))
            return
        wseq = self._worker_seq + 1
        params = self._take_options()
        subs = self._plugin.plan_append(
            request_id=self.session_id, fence=fence, seq=wseq, frames=frames, params=params
        )
        try:
            written = self._hand_on(link, subs)
            if written.done() and (written.cancelled() or written.exception() is not None):
                written.result()  # refused at once: failed here, as _on_append fails it
        except BaseException as exc:
            res.rollback()
            if params is not None:
                self._options_pending()
            if self.link is link:
                self.input_status = InputStatus.ABANDONED
            raise _write_error(exc) from exc
        self._worker_seq = wseq
        self.replay.appended(frames, epoch=fence.epoch, seq=wseq, turn_id=fence.turn_id)
        self._handed_on(link, wseq, len(frames) // self._frame_bytes)
        res.commit()
        self._took_input(len(frames), len(pcm), received)
        if written.done():
            self._answers.now(lambda: self._ack_append(seq, seq_epoch, fence, received))
            return
        self._mailbox.charge(size)
        self._submit_wait = (written, self._clock.now() + self._cfg.submit_timeout_s)
        ticket = self._answers.later()

        def on_written(f: asyncio.Future[None]) -> None:
            self._mailbox.discharge(size)  # at once: the bound is about bytes held, not answers
            self._answers.then(
                ticket, lambda: self._append_written(f, link, seq, seq_epoch, fence, received, event_id)
            )

        written.add_done_callback(on_written)

    def _append_written(
        self,
        written: asyncio.Future[None],
        link: WorkerHandle,
        seq: int,
        seq_epoch: int,
        fence: Fence,
        received: float,
        event_id: str,
    ) -> None:
        """The write of an append applied at once is done (and earlier appends answered): ack
        it, or fail it as ``_on_append`` fails an append whose write failed."""
        if self._submit_wait is not None and self._submit_wait[0] is written:
            self._submit_wait = None
        exc = asyncio.CancelledError() if written.cancelled() else written.exception()
        if exc is None or self._goes_on_without(link):
            # Written; or lost with its worker, and the move replays it from the log (or, for a
            # model-native model, lost with the context its client is told was reset).
            self._ack_append(seq, seq_epoch, fence, received)
            self._check_overflow()
            return
        if self.link is link:
            self.input_status = InputStatus.ABANDONED
        self._error(_write_error(exc), event_id)

    def _goes_on_without(self, link: WorkerHandle) -> bool:
        """The session left ``link`` (its worker was lost) and goes on elsewhere without what a
        write to it carried: replayed from the log, or, for a model-native model, whose context
        went with the worker (``context_reset``), not needed."""
        return self.link is not link and (self._replayable or self._plugin.model_native)

    def _accept_append(self, ap: session_pb2.InputAudioAppend, pcm: bytes) -> int:
        """An append's checks and its client seq; returns the epoch of the client's numbering."""
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
        return self._seq_epoch

    def _took_input(self, frames_bytes: int, pcm_bytes: int, received: float) -> None:
        self.state.input_since_commit_samples += frames_bytes // self._plugin.worker_format.frame_bytes
        fmt = self.settings.input_format
        self._timeline.client(pcm_bytes // fmt.frame_bytes / fmt.sample_rate_hz, received)

    def _ack_append(self, seq: int, seq_epoch: int, fence: Fence, received: float) -> None:
        # Acked in the epoch of the client's numbering (older than the fence's when the client
        # appended on before it saw audio_cancelled, or the session moved meanwhile).
        if self.epoch == fence.epoch:
            self.emitter.acks(self.acks.ack(seq, seq_epoch, received))
        else:  # cancelled meanwhile: the ack of an older epoch holds nothing back
            self.emitter.acks((Ack(seq, seq_epoch, (received,)),))

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
                self._options_pending()
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

    async def _on_commit(self, received: float, event_id: str) -> None:
        """Hand the commit to the link and go on: it is not awaited, so the appends queued
        behind it join its command (one per worker tick) instead of waiting a tick for its
        write. It is answered once written, after earlier appends (``_commit_written``)."""
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
            written = self._hand_on(link, subs)
            if written.done() and (written.cancelled() or written.exception() is not None):
                written.result()  # refused at once: failed here, as an awaited write would fail
        except BaseException as exc:
            res.rollback()
            self._options_pending()
            raise _write_error(exc) from exc
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
        # The turn is committed now (a response asked for next finds it so); the client hears
        # of it once the write is done.
        turn = self._turn_committed(received)
        self._submit_wait = (written, self._clock.now() + self._cfg.submit_timeout_s)
        ticket = self._answers.later()
        written.add_done_callback(
            lambda f: self._answers.then(
                ticket, lambda: self._commit_written(f, link, turn, samples, event_id)
            )
        )

    def _commit_written(
        self, written: asyncio.Future[None], link: WorkerHandle, turn: int, samples: int, event_id: str
    ) -> None:
        """The commit's write is done (and earlier appends answered): answer it ``committed``; a
        write that failed fails it, unless the session moved and the move replays it."""
        if self._submit_wait is not None and self._submit_wait[0] is written:
            self._submit_wait = None
        exc = asyncio.CancelledError() if written.cancelled() else written.exception()
        if exc is None or (self._replayable and self.link is not link):
            self._emit_committed(turn, samples)
            self._check_overflow()
            return
        if self.link is link:
            self.input_status = InputStatus.ABANDONED
        self._error(_write_error(exc), event_id)

    async def _on_clear(self) -> None:
        link = await self._bound_link()
        self.state.audio_buffer.clear()
        sub = self._plugin.plan_control(
            request_id=self.session_id, fence=self._fence(), kind=CLEAR, params=self._take_options()
        )
        await self._submit(link, [sub])
        await self._answers.settled()  # submitted with earlier appends: answered after them
        self.replay.cleared()
        self.state.input_since_commit_samples = 0
        self.input_status = InputStatus.OPEN
        self.emitter.emit("cleared", session_pb2.InputCleared())

    async def _on_response_create(self, rc: session_pb2.ResponseCreate, event_id: str) -> None:
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
            self._options_pending()  # the session's own options return after it
        link = await self._bound_link()
        if self.response is not None:  # (placing again may restart one)
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        del link
        self._start_response(self._commit_at, params, event_id=event_id)

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
        if (
            new.instructions != self.settings.instructions
            and self.state.context_locked
            and not self._plugin.instructions_anytime
        ):
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
