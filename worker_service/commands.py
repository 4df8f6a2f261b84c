"""What an owner asks of its sessions: an Attach, and each command of its Run stream.

Both run on the event loop: validated (ids bounded by ``MAX_ID_LENGTH``; a submission's kind,
params and PCM), fenced by the session table, then handed to the engine in order. An Attach
that moves a session tells the displaced owner at once. A rejected submission, abort or
release fails only itself: submissions and aborts are answered with an error update to the
owner, a release is ignored; a failure of the command as a whole (the worker stops serving)
raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from duplex.audio import decode
from duplex.errors import BadRequestError, CapacityError, DuplexError, ErrorCode, WorkerErrorCode
from duplex.fence import Fence
from duplex.v1 import common_pb2, worker_pb2
from worker_service.config import WorkerConfig
from worker_service.delivery import OutputHub
from worker_service.engine import Engine
from worker_service.engine_types import (
    APPEND,
    CLEAR,
    COMMIT,
    RESPOND,
    AbortOlder,
    CommandMark,
    EngineCommand,
    EngineDeadError,
    Enqueue,
    ReleaseSession,
    Update,
    Work,
)
from worker_service.fencing import MAX_ID_LENGTH, Admission
from worker_service.identity import IdentityPolicy
from worker_service.metrics import SESSIONS_REFUSED, SUBMISSIONS
from worker_service.model import FloatArray, StepModel, bad_submission, options_from_struct
from worker_service.serving_state import ServingState
from worker_service.sessions import SessionTable

logger = logging.getLogger(__name__)

SESSIONS_REFUSED_REAL_TIME = SESSIONS_REFUSED.labels(reason="real_time")

_KIND_LABELS = {APPEND: "append", COMMIT: "commit", RESPOND: "respond", CLEAR: "clear"}
_SUBMITTED: dict[int, Any] = {kind: SUBMISSIONS.labels(kind=label) for kind, label in _KIND_LABELS.items()}
_SUBMITTED_UNKNOWN = SUBMISSIONS.labels(kind="unknown")


def check_id_length(*ids: str) -> None:
    """Refuse (``invalid_event``) ids longer than ``MAX_ID_LENGTH`` (Attach, a Run's owner)."""
    if any(len(i) > MAX_ID_LENGTH for i in ids):
        raise BadRequestError(ErrorCode.INVALID_EVENT, f"ids are at most {MAX_ID_LENGTH} characters")


def _clip(value: str) -> str:
    """An id echoed in a rejection, at most ``MAX_ID_LENGTH`` long (a refused over-long id is
    not sent back whole)."""
    return value[:MAX_ID_LENGTH]


def _clip_fence(msg: common_pb2.Fence) -> Fence:
    return Fence(_clip(msg.session_id), msg.epoch, msg.turn_id)


class CommandHandler:
    """Attach and Run commands, from message to engine commands and rejections."""

    def __init__(
        self,
        config: WorkerConfig,
        state: ServingState,
        engine: Engine,
        hub: OutputHub,
        sessions: SessionTable,
        identity: IdentityPolicy,
    ) -> None:
        self._config = config
        self._state = state
        self._engine = engine
        self._hub = hub
        self._sessions = sessions
        self._identity = identity

    def attach(
        self, request: worker_pb2.AttachRequest, identify: Callable[[], str | None]
    ) -> tuple[Admission, bool]:
        """Grant an Attach: the admission and whether the session was already live.

        ``identify`` reads the caller's certificate identity (see ``IdentityPolicy.owner``)."""
        sid = request.session_id
        self._state.serving_model()
        if not sid or not request.owner:
            raise BadRequestError(ErrorCode.INVALID_EVENT, "Attach needs session_id and owner")
        check_id_length(sid, request.owner, request.request_id)
        owner, identity = self._identity.owner(request.owner, identify)
        fences = self._sessions.fences
        previous = fences.owner_of(sid)
        previous_request_id = self._sessions.request_id(sid)
        if previous is None and not self._engine.takes_one_more(
            fences.live_sessions, self._config.max_tick_load
        ):
            SESSIONS_REFUSED_REAL_TIME.inc()
            raise CapacityError(
                ErrorCode.CAPACITY_EXHAUSTED,
                f"this worker's tick takes {100 * self._engine.tick_load:.0f}% of its frame period: "
                "one more session would break real time",
            )
        try:
            admission, was_live = fences.attach(
                sid,
                request.epoch,
                owner,
                request.takeover,
                may_take_over=self._identity.may_take_over(identity),
            )
        except DuplexError as err:
            if request.takeover and err.code == WorkerErrorCode.NOT_OWNER:
                logger.warning("takeover of session %r by owner %r refused: %s", sid, owner, err.message)
            raise
        if admission.bumped:
            self._engine.submit([AbortOlder(sid, admission.epoch)])
        # Known from the Attach on: a session taken over before its first submission is
        # announced to the owner it leaves all the same.
        self._sessions.attached(sid, owner, request.request_id or sid)
        if previous is not None and previous != owner:
            logger.info(
                "session %r taken over by owner %r from owner %r at epoch %d",
                sid,
                owner,
                previous,
                admission.epoch,
            )
            if previous_request_id is not None:
                self._tell_displaced(previous, previous_request_id, sid, admission.epoch)
        return admission, was_live

    def _tell_displaced(self, owner: str, request_id: str, session_id: str, epoch: int) -> None:
        """The session was taken over: its old owner's queued work is gone and nothing more will
        come of it, so say so now (it stops waiting, ends the session there) rather than at its
        next submission, which may never come."""
        fence = Fence(session_id, epoch, 0)
        msg = "the session was taken over by another owner"
        self._hub.send_updates(owner, [Update(request_id, fence, error=(WorkerErrorCode.NOT_OWNER, msg))])

    def handle(self, owner: str, cmd: worker_pb2.WorkerCommand, mark: CommandMark | None = None) -> None:
        """Fence and validate one command, queue its work on the engine, answer rejections;
        ``mark`` (the stream's count of commands, this one included) is queued after its work."""
        model = self._state.serving_model()
        sessions = self._sessions
        fences = sessions.fences
        engine_cmds: list[EngineCommand] = []
        rejected: list[Update] = []
        for ab in cmd.abort:
            try:
                if len(ab.request_id) > MAX_ID_LENGTH or len(ab.fence.session_id) > MAX_ID_LENGTH:
                    raise bad_submission(f"ids are at most {MAX_ID_LENGTH} characters")
                admission = fences.check(ab.fence.session_id, ab.fence.epoch, owner, keep_input=ab.keep_input)
            except DuplexError as err:
                rejected.append(
                    Update(_clip(ab.request_id), _clip_fence(ab.fence), error=(err.code, err.message))
                )
                continue
            if admission.bumped:
                engine_cmds.append(AbortOlder(ab.fence.session_id, admission.epoch, ab.keep_input))
            sessions.claim(ab.fence.session_id)
        # Columnar where it counts: the PCM of every accepted APPEND is decoded in ONE numpy
        # pass after the loop (each work gets its rows as a view), and submissions are counted
        # per kind once per command. APPENDs in columns come first (``AppendColumns``): the
        # owner puts there only a session's appends that no submission of it precedes.
        appends: list[tuple[Work, bytes]] = []
        kinds: Counter[int] = Counter()
        frame_bytes = _frame_bytes(model)
        enqueued = 0
        if cmd.HasField("appends"):
            enqueued = self._append_columns(model, owner, cmd.appends, engine_cmds, rejected)
            kinds[APPEND] += len(cmd.appends.request_id)
        for sub in cmd.submit:
            kinds[sub.kind] += 1
            try:
                work, pcm = parse_submission(model, owner, sub, frame_bytes)
                self._admit(owner, work, work.units if pcm is None else len(pcm) // frame_bytes, engine_cmds)
            except DuplexError as err:
                rejected.append(
                    Update(_clip(sub.request_id), _clip_fence(sub.fence), error=(err.code, err.message))
                )
                continue
            if pcm is not None:
                appends.append((work, pcm))
        decode_appends(model, appends)
        enqueued += len(appends)
        for kind, n in kinds.items():
            _SUBMITTED.get(kind, _SUBMITTED_UNKNOWN).inc(n)
        for rel in cmd.release:
            sid = rel.fence.session_id
            if len(sid) > MAX_ID_LENGTH:
                continue  # no such session
            try:
                if rel.closed:  # ended for good: tombstoned, later Attaches get session_closed
                    live = fences.close(sid, rel.fence.epoch, owner)
                else:  # moved or dropped: it may come back
                    fences.check(sid, rel.fence.epoch, owner)
                    fences.release(sid)
                    live = True
            except DuplexError:
                continue  # a release that is not the session's current owner's is ignored (counted)
            if live:
                engine_cmds.append(ReleaseSession(sid))
            sessions.forget(sid)
        # Anything but an APPEND wakes an engine waiting for its tick.
        appends_only = len(engine_cmds) == enqueued
        if mark is not None:
            engine_cmds.append(mark)
        self._engine.submit(engine_cmds, appends_only=appends_only)
        if rejected:
            self._hub.send_updates(owner, rejected)

    def stream_ended(self, owner: str, stream: int) -> None:
        """Run stream ``stream`` of ``owner`` ended: the engine forgets its count of commands."""
        with contextlib.suppress(EngineDeadError):
            self._engine.submit([CommandMark(owner, stream, 0)], appends_only=True)

    def _admit(self, owner: str, work: Work, units: int, engine_cmds: list[EngineCommand]) -> None:
        """Fence one submission's work and queue it (its request's input queue holds ``units``
        more) or raise what refuses it."""
        fence = work.fence
        sid = fence.session_id
        sessions = self._sessions
        admission = sessions.fences.check(sid, fence.epoch, owner, is_input=work.kind != RESPOND)
        counter = sessions.counter(sid)
        max_queued = self._config.max_queued_frames
        if counter.depth + units > max_queued:
            raise CapacityError(
                WorkerErrorCode.CAPACITY, f"the request's input queue is full ({max_queued} frames)"
            )
        if admission.bumped:
            engine_cmds.append(AbortOlder(sid, admission.epoch))
        elif admission.epoch > fence.epoch:
            # The owner's input from before its cancel reached us: taken under the new epoch.
            work.fence = Fence(sid, admission.epoch, fence.turn_id)
        counter.submitted += units
        sessions.submitted(sid, work.request_id)
        engine_cmds.append(Enqueue(work, counter))

    def _append_columns(
        self,
        model: StepModel[Any],
        owner: str,
        cols: worker_pb2.AppendColumns,
        engine_cmds: list[EngineCommand],
        rejected: list[Update],
    ) -> int:
        """Queue the APPENDs of ``cols``: each column read once, all their PCM decoded in one
        pass; an entry refused is answered like a refused submission. Returns how many were
        queued. Columns that do not line up refuse the command (the Run stream ends)."""
        rids, sids, epochs, turns = (
            list(cols.request_id),
            list(cols.session_id),
            list(cols.epoch),
            list(cols.turn_id),
        )
        seqs, counts, replays = list(cols.seq), list(cols.frames), list(cols.replay)
        n = len(rids)
        if not (len(sids) == len(epochs) == len(turns) == len(seqs) == len(counts) == n) or (
            replays and len(replays) != n
        ):
            raise BadRequestError(ErrorCode.INVALID_EVENT, "AppendColumns: columns of unequal lengths")
        frames = decode_frames(model, cols.pcm, sum(counts))
        queued = pos = 0
        for i, rid in enumerate(rids):
            sid, units = sids[i], counts[i]
            start, pos = pos, pos + units
            try:
                if not rid or not sid:
                    raise bad_submission("an APPEND needs request_id and fence.session_id")
                if len(rid) > MAX_ID_LENGTH or len(sid) > MAX_ID_LENGTH:
                    raise bad_submission(f"ids are at most {MAX_ID_LENGTH} characters")
                if not units:
                    raise bad_submission("an APPEND carries at least one frame")
                fence = Fence(sid, epochs[i], turns[i])
                replay = bool(replays) and replays[i]
                work = Work(APPEND, fence, owner, rid, seq=seqs[i], frames=frames[start:pos], replay=replay)
                self._admit(owner, work, units, engine_cmds)
            except DuplexError as err:
                fence = Fence(_clip(sid), epochs[i], turns[i])
                rejected.append(Update(_clip(rid), fence, error=(err.code, err.message)))
                continue
            queued += 1
        return queued


def _frame_bytes(model: StepModel[Any]) -> int:
    return model.frame_samples * model.audio_format.frame_bytes


def decode_frames(model: StepModel[Any], pcm: bytes, frames: int) -> FloatArray:
    """``frames`` whole frames of the model's PCM as ``(frames, frame_samples)`` float32 rows,
    in one pass (``duplex.audio.decode``); PCM of another length refuses the command
    (INVALID_ARGUMENT)."""
    if len(pcm) != frames * _frame_bytes(model):
        raise BadRequestError(
            ErrorCode.INVALID_EVENT,
            f"AppendColumns: {len(pcm)} bytes of pcm for {frames} frames of {_frame_bytes(model)} bytes",
        )
    rows: FloatArray = decode(pcm, model.audio_format).reshape(-1, model.frame_samples)
    return rows


def decode_appends(model: StepModel[Any], appends: list[tuple[Work, bytes]]) -> None:
    """Decode the s16 PCM of validated APPENDs in one pass and give each work its frames, a
    view of ``(n, frame_samples)`` float32 rows."""
    if not appends:
        return
    pcm = appends[0][1] if len(appends) == 1 else b"".join(p for _, p in appends)
    frame_bytes = _frame_bytes(model)
    frames = decode_frames(model, pcm, len(pcm) // frame_bytes)
    pos = 0
    for work, data in appends:
        n = len(data) // frame_bytes
        work.frames = frames[pos : pos + n]
        pos += n


def parse_submission(
    model: StepModel[Any], owner: str, sub: worker_pb2.Submission, frame_bytes: int
) -> tuple[Work, bytes | None]:
    """Validate one submission into engine work; an APPEND's PCM comes back beside it, checked
    (whole frames) and not yet decoded (``decode_appends``). Raises ``bad_submission``."""
    # Each field read once: every read of a protobuf field is a lookup (a copy, for bytes).
    request_id, fence, kind = sub.request_id, sub.fence, sub.kind
    session_id = fence.session_id
    if not request_id or not session_id:
        raise bad_submission("a submission needs request_id and fence.session_id")
    if len(request_id) > MAX_ID_LENGTH or len(session_id) > MAX_ID_LENGTH:
        raise bad_submission(f"ids are at most {MAX_ID_LENGTH} characters")
    if kind not in _KIND_LABELS:
        raise bad_submission(f"unknown submission kind {int(kind)}")
    options = None
    if sub.HasField("params"):
        params = options_from_struct(sub.params)  # non-finite numbers: bad_submission
        try:
            options = model.parse_options(params)
        except DuplexError:
            raise
        except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            # A model's parser tripping over a value of the wrong type is the caller's
            # bad submission, not a failure of the owner's whole stream.
            logger.info("submission params refused by the model: %r", exc)
            raise bad_submission("invalid params") from exc
    work = Work(kind, Fence(session_id, fence.epoch, fence.turn_id), owner, request_id, options=options)
    if kind != APPEND:
        return work, None
    pcm = sub.pcm
    if not pcm or len(pcm) % frame_bytes:
        raise bad_submission(
            f"APPEND pcm of {len(pcm)} bytes is not a whole number of {frame_bytes}-byte frames"
        )
    work.seq = sub.seq
    work.replay = sub.replay
    return work, pcm
