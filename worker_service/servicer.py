"""``duplex.v1.DuplexWorker``: a thin adapter between protobuf messages and the domain.

Commands are validated and fenced here, on the event loop, then handed to the engine in order;
engine results are converted to ``StepOutput`` in each owner's stream writer, which first strips
anything stepped under a fence the session has since moved past (so once an abort is processed,
no older output reaches the owner, even if the engine stepped it a moment before).
Errors are typed ``DuplexError``s; ``duplex.errors.abort`` is the one place they become statuses.

Who is calling: with mutual TLS an owner is ``IDENTITY/owner``, the verified certificate's
identity with the caller's own owner id scoped under it (``owner_key``), for Attach, Run and every
command, so no identity can hold, replace or fence another's owner. Every id is bounded
(``MAX_ID_LENGTH``) and logged escaped (``%r``): a caller's id cannot forge a log line.

State nobody owns does not stay: a new Run stream first lists what the worker holds for its
owner (``StepOutput.held_sessions``), which the owner reconciles by releasing what it no longer
has; an owner that does not come back within the orphan grace has its sessions reaped; and an
Attach that nobody uses while its owner has no Run stream expires (``attach_lease_s``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from duplex.errors import (
    BadRequestError,
    CapacityError,
    DuplexError,
    ErrorCode,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    WorkerErrorCode,
    abort,
)
from duplex.fence import Fence
from duplex.tls import peer_identity
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_service.config import WorkerConfig
from worker_service.delivery import OutputHub, OwnerChannel
from worker_service.engine import (
    APPEND,
    CLEAR,
    COMMIT,
    RESPOND,
    AbortOlder,
    Engine,
    EngineCommand,
    EngineDeadError,
    Enqueue,
    OwnerStep,
    QueueCounter,
    ReleaseSession,
    Update,
    Work,
)
from worker_service.fencing import MAX_ID_LENGTH, FenceTable
from worker_service.metrics import (
    ATTACH_LEASES_EXPIRED,
    FENCED,
    ORPHANS_RELEASED,
    REQUEST_ERRORS,
    SUBMISSIONS,
)
from worker_service.model import StepModel, bad_submission, options_from_struct

logger = logging.getLogger(__name__)

SERVICE_NAME: str = worker_pb2.DESCRIPTOR.services_by_name["DuplexWorker"].full_name
_KIND_LABELS = {APPEND: "append", COMMIT: "commit", RESPOND: "respond", CLEAR: "clear"}

#: Separates a certificate identity from the owner id scoped under it (``IDENTITY/owner``).
OWNER_SEPARATOR = "/"

#: Most refused identities logged by name (each once); the rest are only counted.
MAX_REFUSED_IDENTITIES_LOGGED = 64

#: Most sessions listed in one reconciliation StepOutput (a longer list is split): each entry is
#: a fence of at most ~140 bytes, so one message stays far below the 16 MiB message limit.
HELD_PER_MESSAGE = 4096

_Context = grpc.aio.ServicerContext[Any, Any]


def owner_key(identity: str | None, owner: str) -> str:
    """The key an owner is known by: ``IDENTITY/owner`` with a certificate identity, else the
    owner id itself (plaintext). The owner id may not contain the separator, so a key names
    exactly one (identity, owner) pair even when identities contain it (URIs)."""
    if identity is None:
        return owner
    if OWNER_SEPARATOR in owner:
        raise BadRequestError(ErrorCode.INVALID_EVENT, f"an owner id may not contain {OWNER_SEPARATOR!r}")
    return f"{identity}{OWNER_SEPARATOR}{owner}"


def _check_id_length(*ids: str) -> None:
    if any(len(i) > MAX_ID_LENGTH for i in ids):
        raise BadRequestError(ErrorCode.INVALID_EVENT, f"ids are at most {MAX_ID_LENGTH} characters")


def _clip(value: str) -> str:
    """An id echoed in a rejection, at most ``MAX_ID_LENGTH`` long (a refused over-long id is
    not sent back whole)."""
    return value[:MAX_ID_LENGTH]


def _clip_fence(msg: common_pb2.Fence) -> Fence:
    return Fence(_clip(msg.session_id), msg.epoch, msg.turn_id)


@dataclass
class ServingState:
    """What the servicer needs to know about the server's lifecycle."""

    model: StepModel[Any] | None = None
    """Set once the model is loaded (the worker serves from then on)."""
    draining: bool = False
    failed: bool = False


class DuplexWorkerServicer(worker_pb2_grpc.DuplexWorkerServicer):
    def __init__(
        self, config: WorkerConfig, state: ServingState, engine: Engine, hub: OutputHub, fences: FenceTable
    ) -> None:
        self._config = config
        self._state = state
        self._engine = engine
        self._hub = hub
        self._fences = fences
        self._counters: dict[str, QueueCounter] = {}
        # The request id each session's owner uses (to tell a displaced owner about a takeover).
        self._request_ids: dict[str, str] = {}
        self._reapers: dict[str, asyncio.Task[None]] = {}
        # Sessions attached and not yet claimed by a submission or abort: released when their
        # owner still has no Run stream once the lease is up (``attach_lease_s``).
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._refused_identities: set[str] = set()

    @property
    def fences(self) -> FenceTable:
        return self._fences

    def _owner(self, context: _Context, owner: str) -> tuple[str, str | None]:
        """The caller's owner key and certificate identity (None without mutual TLS)."""
        if not self._fences.authorizes:
            return owner, None
        identity = peer_identity(context)
        if identity is None:  # mutual TLS verified a certificate that names nobody
            raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, "the client certificate names no identity")
        allowed = self._config.owner_identities
        if allowed is not None and identity not in allowed:
            # A CA signs many services: only the session tier's identities create, own, release
            # or take over sessions. Anyone else could otherwise tombstone, fence at the highest
            # epoch or squat sessions a failover will need.
            FENCED.labels(reason="identity_not_allowed").inc()
            refused = self._refused_identities
            if identity not in refused and len(refused) < MAX_REFUSED_IDENTITIES_LOGGED:
                refused.add(identity)
                logger.warning("identity %r may not own sessions here: refused (logged once)", identity)
            raise PermissionDeniedError(
                ErrorCode.IDENTITY_NOT_ALLOWED, "this identity may not own sessions on this worker"
            )
        return owner_key(identity, owner), identity

    def _may_take_over(self, identity: str | None) -> bool:
        allowed = self._config.takeover_allowed
        return identity is None or allowed is None or identity in allowed

    def _serving_model(self) -> StepModel[Any]:
        if self._state.failed:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the worker's engine failed")
        if self._state.draining:
            raise UnavailableError(ErrorCode.DRAINING, "the worker is draining")
        if self._state.model is None:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the worker is still loading its model")
        return self._state.model

    # -- unary -----------------------------------------------------------------------------------

    async def Describe(
        self,
        request: worker_pb2.DescribeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DescribeRequest, worker_pb2.WorkerDescription],
    ) -> worker_pb2.WorkerDescription:
        model = self._state.model
        if model is None:
            await abort(context, UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the model is loading"))
        return worker_pb2.WorkerDescription(
            model_id=model.model_id,
            device=str(model.device),
            max_batch=self._config.max_batch,
            audio_format=model.audio_format.to_proto(),
            frame_samples=model.frame_samples,
            worker_id=self._config.worker_id,
            max_sessions=self._config.max_sessions,
        )

    async def Attach(
        self,
        request: worker_pb2.AttachRequest,
        context: grpc.aio.ServicerContext[worker_pb2.AttachRequest, worker_pb2.AttachResponse],
    ) -> worker_pb2.AttachResponse:
        sid = request.session_id
        owner = request.owner
        try:
            self._serving_model()
            if not sid or not request.owner:
                raise BadRequestError(ErrorCode.INVALID_EVENT, "Attach needs session_id and owner")
            _check_id_length(sid, request.owner, request.request_id)
            owner, identity = self._owner(context, request.owner)
            previous = self._fences.owner_of(sid)
            previous_request_id = self._request_ids.get(sid)
            admission, was_live = self._fences.attach(
                sid,
                request.epoch,
                owner,
                request.takeover,
                may_take_over=self._may_take_over(identity),
            )
            if admission.bumped:
                self._engine.submit([AbortOlder(sid, admission.epoch)])
            self._lease(sid, owner)
            # Known from the Attach on: a session taken over before its first submission is
            # announced to the owner it leaves all the same.
            self._request_ids[sid] = request.request_id or sid
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
        except DuplexError as err:
            if request.takeover and err.code == WorkerErrorCode.NOT_OWNER:
                logger.warning("takeover of session %r by owner %r refused: %s", sid, owner, err.message)
            await abort(context, err)
        return worker_pb2.AttachResponse(epoch=admission.epoch, resumed=was_live)

    def _tell_displaced(self, owner: str, request_id: str, session_id: str, epoch: int) -> None:
        """The session was taken over: its old owner's queued work is gone and nothing more will
        come of it, so say so now (it stops waiting, ends the session there) rather than at its
        next submission, which may never come."""
        fence = Fence(session_id, epoch, 0)
        msg = "the session was taken over by another owner"
        self._hub.send_updates(owner, [Update(request_id, fence, error=(WorkerErrorCode.NOT_OWNER, msg))])

    # -- the command stream ----------------------------------------------------------------------

    async def Run(  # type: ignore[override]  # a coroutine writing with context.write
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerCommand],
        context: grpc.aio.ServicerContext[worker_pb2.WorkerCommand, worker_pb2.StepOutput],
    ) -> None:
        """The owner's stream, written with ``context.write()``: a write that waits for an owner
        that stopped reading fails when the stream is dropped, and it fails here, where that is
        expected, not inside gRPC's handling of a response generator (which logs it as an error
        with a traceback)."""
        try:
            self._serving_model()
            first = await anext(request_iterator, None)
            if first is None:
                return
            if not first.owner:
                raise BadRequestError(ErrorCode.INVALID_EVENT, "the first WorkerCommand must set owner")
            _check_id_length(first.owner)
            owner, _ = self._owner(context, first.owner)
        except DuplexError as err:
            await abort(context, err)
        logger.info("owner %r opened a Run stream", owner)
        reaper = self._reapers.pop(owner, None)
        if reaper is not None:
            reaper.cancel()  # the owner is back within its grace: it reconciles what it holds
        channel = self._hub.open(owner)
        # Reconciliation: the stream's first StepOutputs list the sessions held for the owner,
        # so that it releases those it no longer has (closed or moved while it was away; its
        # releases for them may never have been sent). Queued before anything else; the first
        # command (which may carry such releases) is applied before the list is converted, and
        # the conversion leaves out whatever is no longer the owner's by then.
        held = self._fences.live_sessions_of(owner)
        for i in range(0, len(held), HELD_PER_MESSAGE):
            channel.push(OwnerStep(step=0, held=held[i : i + HELD_PER_MESSAGE]))
        reader: asyncio.Task[None] | None = None
        if self._apply(owner, first, channel):
            reader = asyncio.create_task(self._read(owner, first.owner, request_iterator, channel))
        try:
            while True:
                item = await channel.get()
                if item is None:
                    return
                msg = self._to_proto(owner, item)
                if msg is not None and not await _write(context, msg):
                    return  # the stream ended while the write waited
        except DuplexError as err:
            await abort(context, err)
        finally:
            if reader is not None:
                reader.cancel()
            self._hub.discard(channel)
            logger.info("owner %r: Run stream ended", owner)
            if not self._hub.has(owner) and owner not in self._reapers:
                self._reapers[owner] = asyncio.create_task(self._reap_orphans(owner))

    async def _reap_orphans(self, owner: str) -> None:
        """Release the sessions of an owner that did not come back (crashed, partitioned, cut
        off): nothing else would ever free their model state, slots and capacity."""
        try:
            await asyncio.sleep(self._config.orphan_grace_s)
        finally:
            if self._reapers.get(owner) is asyncio.current_task():
                del self._reapers[owner]
        if self._hub.has(owner):
            return
        orphans = self._fences.live_sessions_of(owner)
        if not orphans:
            return
        logger.warning(
            "owner %r gone for %.1f s: releasing its %d sessions",
            owner,
            self._config.orphan_grace_s,
            len(orphans),
        )
        ORPHANS_RELEASED.inc(len(orphans))
        self._release_sessions(orphans)

    def _release_sessions(self, session_ids: list[str]) -> None:
        """Free the sessions' model state and mark them released (their fences are kept)."""
        try:
            self._engine.submit([ReleaseSession(sid) for sid in session_ids])
        except EngineDeadError:
            pass  # nothing to free: the engine and its state are gone
        for sid in session_ids:
            self._fences.release(sid)
            self._forget(sid)

    def _forget(self, session_id: str) -> None:
        """Drop the servicer's own bookkeeping of a session that is no longer live."""
        self._counters.pop(session_id, None)
        self._request_ids.pop(session_id, None)
        self._claim(session_id)

    # -- attach leases ---------------------------------------------------------------------------

    def _lease(self, session_id: str, owner: str) -> None:
        """(Re)start the session's attach lease (``attach_lease_s``)."""
        lease_s = self._config.attach_lease_s
        if not lease_s:
            return
        self._claim(session_id)
        loop = asyncio.get_running_loop()
        self._leases[session_id] = loop.call_later(lease_s, self._lease_expired, session_id, owner)

    def _claim(self, session_id: str) -> None:
        """The session's owner used it (or it is gone): its lease ends."""
        handle = self._leases.pop(session_id, None)
        if handle is not None:
            handle.cancel()

    def _lease_expired(self, session_id: str, owner: str) -> None:
        """Nothing claimed the attachment within the lease. An owner with a Run stream knows
        what it holds (and reconciles it whenever a stream opens); one without a stream may
        never open one, and nothing else would release the session: it is released now."""
        self._leases.pop(session_id, None)
        if self._fences.owner_of(session_id) != owner or self._hub.has(owner):
            return
        logger.warning(
            "session %r attached by owner %r unclaimed for %.1f s and the owner has no Run "
            "stream: releasing it",
            session_id,
            owner,
            self._config.attach_lease_s,
        )
        ATTACH_LEASES_EXPIRED.inc()
        ORPHANS_RELEASED.inc()
        self._release_sessions([session_id])

    def cancel_reapers(self) -> None:
        """Stop pending orphan reaps and attach leases (server shutdown)."""
        for task in self._reapers.values():
            task.cancel()
        self._reapers.clear()
        for handle in self._leases.values():
            handle.cancel()
        self._leases.clear()

    async def _read(
        self,
        owner: str,
        owner_id: str,
        commands: AsyncIterator[worker_pb2.WorkerCommand],
        channel: OwnerChannel,
    ) -> None:
        """Apply the stream's commands after its first (``Run`` applied that one)."""
        try:
            async for cmd in commands:
                if channel.closed:
                    return
                if cmd.owner and cmd.owner != owner_id:
                    raise BadRequestError(ErrorCode.INVALID_EVENT, "owner changed within a Run stream")
                if not self._apply(owner, cmd, channel):
                    return
            channel.close()  # half-close: the stream ends once what is queued is sent
        except asyncio.CancelledError:
            raise
        except DuplexError as err:
            channel.close(err)
        except Exception:
            logger.exception("reading the Run stream failed")
            channel.close(DuplexError(ErrorCode.INTERNAL, "internal error"))

    def _apply(self, owner: str, cmd: worker_pb2.WorkerCommand, channel: OwnerChannel) -> bool:
        """``handle_command``; a failure of the stream as a whole (the worker stops serving, a
        bug) closes the channel with its error and returns False."""
        try:
            self.handle_command(owner, cmd)
        except DuplexError as err:
            channel.close(err)
            return False
        except Exception:
            logger.exception("Run command handling failed")
            channel.close(DuplexError(ErrorCode.INTERNAL, "internal error"))
            return False
        return True

    def handle_command(self, owner: str, cmd: worker_pb2.WorkerCommand) -> None:
        """Fence and validate one command, queue its work on the engine, answer rejections."""
        model = self._serving_model()
        engine_cmds: list[EngineCommand] = []
        rejected: list[Update] = []
        for ab in cmd.abort:
            try:
                if len(ab.request_id) > MAX_ID_LENGTH or len(ab.fence.session_id) > MAX_ID_LENGTH:
                    raise bad_submission(f"ids are at most {MAX_ID_LENGTH} characters")
                admission = self._fences.check(ab.fence.session_id, ab.fence.epoch, owner)
            except DuplexError as err:
                rejected.append(
                    Update(_clip(ab.request_id), _clip_fence(ab.fence), error=(err.code, err.message))
                )
                continue
            if admission.bumped:
                engine_cmds.append(AbortOlder(ab.fence.session_id, admission.epoch))
            if self._leases:
                self._claim(ab.fence.session_id)
        for sub in cmd.submit:
            SUBMISSIONS.labels(kind=_KIND_LABELS.get(sub.kind, "unknown")).inc()
            try:
                work = self._to_work(model, owner, sub)
                admission = self._fences.check(sub.fence.session_id, sub.fence.epoch, owner)
                counter = self._counters.get(sub.fence.session_id)
                if counter is None:
                    counter = self._counters[sub.fence.session_id] = QueueCounter()
                if counter.depth + work.units > self._config.max_queued_frames:
                    raise CapacityError(
                        WorkerErrorCode.CAPACITY,
                        f"the request's input queue is full ({self._config.max_queued_frames} frames)",
                    )
            except DuplexError as err:
                rejected.append(
                    Update(_clip(sub.request_id), _clip_fence(sub.fence), error=(err.code, err.message))
                )
                continue
            if admission.bumped:
                engine_cmds.append(AbortOlder(sub.fence.session_id, admission.epoch))
            counter.submitted += work.units
            self._request_ids[sub.fence.session_id] = sub.request_id
            if self._leases:
                self._claim(sub.fence.session_id)
            engine_cmds.append(Enqueue(work, counter))
        for rel in cmd.release:
            sid = rel.fence.session_id
            if len(sid) > MAX_ID_LENGTH:
                continue  # no such session
            try:
                if rel.closed:  # ended for good: tombstoned, later Attaches get session_closed
                    live = self._fences.close(sid, rel.fence.epoch, owner)
                else:  # moved or dropped: it may come back
                    self._fences.check(sid, rel.fence.epoch, owner)
                    self._fences.release(sid)
                    live = True
            except DuplexError:
                continue  # a release that is not the session's current owner's is ignored (counted)
            if live:
                engine_cmds.append(ReleaseSession(sid))
            self._forget(sid)
        self._engine.submit(engine_cmds)
        if rejected:
            self._hub.send_updates(owner, rejected)

    def _to_work(self, model: StepModel[Any], owner: str, sub: worker_pb2.Submission) -> Work:
        if not sub.request_id or not sub.fence.session_id:
            raise bad_submission("a submission needs request_id and fence.session_id")
        if len(sub.request_id) > MAX_ID_LENGTH or len(sub.fence.session_id) > MAX_ID_LENGTH:
            raise bad_submission(f"ids are at most {MAX_ID_LENGTH} characters")
        if sub.kind not in _KIND_LABELS:
            raise bad_submission(f"unknown submission kind {int(sub.kind)}")
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
        work = Work(
            kind=sub.kind,
            fence=Fence.from_proto(sub.fence),
            owner=owner,
            request_id=sub.request_id,
            options=options,
        )
        if sub.kind == APPEND:
            fmt = model.audio_format
            frame_bytes = model.frame_samples * fmt.frame_bytes
            if not sub.pcm or len(sub.pcm) % frame_bytes:
                raise bad_submission(
                    f"APPEND pcm of {len(sub.pcm)} bytes is not a whole number of {frame_bytes}-byte frames"
                )
            samples = np.frombuffer(sub.pcm, dtype="<i2").astype(np.float32) * np.float32(1.0 / 32768.0)
            work.frames = samples.reshape(-1, model.frame_samples)
            work.seq = sub.seq
            work.replay = sub.replay
        return work

    def _to_proto(self, owner: str, item: OwnerStep) -> worker_pb2.StepOutput | None:
        """Convert one owner's step, stripping output of fences the session has moved past."""
        if item.held:
            return self._held_proto(owner, item)
        is_current = self._fences.is_current
        if item.step:
            stale = {rid for rid, f in item.batch if not is_current(f.session_id, f.epoch, owner)}
            if stale:
                item = _strip(item, stale, lambda f: is_current(f.session_id, f.epoch, owner))
                if not item.batch and not item.updates:
                    return None
        out = worker_pb2.StepOutput(step=item.step)
        for rid, fence in item.batch:
            entry = out.batch.add(request_id=rid)
            fence.write_to(entry.fence)
        if item.step:
            mm = out.outputs
            mm.output_type = item.output_type
            mm.sparse_audio = item.sparse
            mm.req_id.extend(item.audio_ids)
            mm.audio.extend(item.audio)
        for upd in item.updates:
            ru = out.updates.add(request_id=upd.request_id)
            upd.fence.write_to(ru.fence)
            if upd.error is not None:
                REQUEST_ERRORS.labels(code=upd.error[0]).inc()
                ru.error.code, ru.error.message = upd.error
                continue
            for kind, offset in upd.vad:
                ru.vad.add(kind=kind, sample_offset=offset)
            ru.text = upd.text
            ru.input_seq = upd.input_seq
            ru.turn_ended = upd.turn_ended
            ru.committed_samples = upd.committed_samples
            ru.response_started = upd.response_started
            ru.response_finished = upd.response_finished
        return out

    def _held_proto(self, owner: str, item: OwnerStep) -> worker_pb2.StepOutput | None:
        """A reconciliation list: the listed sessions still held for ``owner``, at their fences
        now (a session released or taken over since the list was made is left out)."""
        out = worker_pb2.StepOutput(step=0)
        for sid in item.held:
            cur = self._fences.current(sid)
            if cur is not None and cur[1] == owner:
                out.held_sessions.add(session_id=sid, epoch=cur[0])
        return out if out.held_sessions else None


async def _write(context: _Context, msg: worker_pb2.StepOutput) -> bool:
    """Write one StepOutput; False when the stream ended while the write waited (a failed
    write means the transport gave up on the call; gRPC may not have marked the context
    cancelled yet)."""
    try:
        await context.write(msg)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not (context.cancelled() or context.done()):
            logger.info("a write to an owner failed (%s): the stream is over", type(exc).__name__)
        return False
    return True


def _strip(item: OwnerStep, stale: set[str], is_current: Any) -> OwnerStep:
    FENCED.labels(reason="stale_output").inc(len(stale))
    keep = [i for i, (rid, _) in enumerate(item.batch) if rid not in stale]
    out = OwnerStep(step=item.step, output_type=item.output_type, sparse=item.sparse)
    out.batch = [item.batch[i] for i in keep]
    if item.sparse:
        pairs = [(rid, p) for rid, p in zip(item.audio_ids, item.audio, strict=True) if rid not in stale]
        out.audio_ids = [rid for rid, _ in pairs]
        out.audio = [p for _, p in pairs]
    elif item.audio:
        out.audio = [item.audio[i] for i in keep]
    out.updates = [u for u in item.updates if u.request_id not in stale and is_current(u.fence)]
    return out
