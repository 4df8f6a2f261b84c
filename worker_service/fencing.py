"""The fencing authority: per session, the highest accepted epoch and the current owner.

It runs on the asyncio side only (Attach and Run commands are handled there), so it needs no
lock; the engine thread learns about epoch changes through ordered engine commands. Every
rejection raises ``FencedError``/``NotFoundError`` with the protocol's code and is counted here.

With mutual TLS the fence is an authorization decision (``authorize=True``): an owner is the key
``IDENTITY/owner`` built from the caller's certificate (``identity.owner_key``), and a session
changes owner only by an explicit takeover from an identity allowed to take over, never by a
higher epoch.
Without it (plaintext on loopback, local development) a higher epoch moves a session, as it
always did. Either way a session closed for good stays refused for a while (its tombstone).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from duplex.errors import (
    BadRequestError,
    CapacityError,
    ErrorCode,
    FencedError,
    NotFoundError,
    WorkerErrorCode,
)
from duplex.fence import MAX_EPOCH, MAX_REQUESTED_EPOCH
from worker_service.config import DEFAULT_MAX_CLOSED_SESSIONS, DEFAULT_TOMBSTONE_TTL_S
from worker_service.metrics import FENCED, SESSIONS_REFUSED, TOMBSTONES_EVICTED

#: Released sessions whose fence (epoch, owner) is remembered so a stale owner stays fenced.
MAX_TOMBSTONES = 65_536

#: The longest id (session id, owner, request id) the worker accepts: every id it keeps is
#: bounded, so a caller cannot grow the worker's tables with huge ones.
MAX_ID_LENGTH = 128


@dataclass(slots=True)
class SessionFence:
    epoch: int
    owner: str
    live: bool = True
    """Attached and not released (counts against ``max_sessions``)."""
    input_from: int = 0
    """The owner's input (APPEND, COMMIT, CLEAR) of this epoch or later is still admitted, taken
    under the current epoch: the owner's cancels (``Abort.keep_input``) leave it where it was, so
    what the user said before the owner's cancel reached the worker is not lost; anything else
    that raises the epoch (an Attach, a takeover, a submission ahead of its abort) raises it too."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of a fence check that passed."""

    epoch: int
    """The session's highest accepted epoch now."""
    bumped: bool
    """The epoch rose: older queued and running work of the session must be aborted."""


class FenceTable:
    """Highest accepted epoch and owner per session (see docs/worker-protocol.md, Identity and fencing)."""

    def __init__(
        self,
        max_sessions: int = 0,
        *,
        authorize: bool = False,
        tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S,
        max_closed: int = DEFAULT_MAX_CLOSED_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``authorize``: owners are certificate-scoped keys; only a takeover changes one.
        ``tombstone_ttl_s`` / ``max_closed``: how long / how many closed sessions stay refused."""
        self._sessions: dict[str, SessionFence] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._closed: OrderedDict[str, tuple[int, float]] = OrderedDict()
        """Session id -> (final epoch, when its tombstone expires), oldest first."""
        self._max_sessions = max_sessions
        self._authorize = authorize
        self._ttl = tombstone_ttl_s
        self._max_closed = max_closed
        self._clock = clock
        self._live = 0

    @property
    def live_sessions(self) -> int:
        return self._live

    @property
    def authorizes(self) -> bool:
        """Whether owners are certificate identities (an owner change needs an allowed takeover)."""
        return self._authorize

    def attach(
        self, session_id: str, epoch: int, owner: str, takeover: bool, *, may_take_over: bool = True
    ) -> tuple[Admission, bool]:
        """Bind ``session_id`` to ``owner``; returns the admission and whether it was already live.

        ``may_take_over``: whether the caller's identity may take a session from another owner
        (consulted only when the table authorizes)."""
        _check_requested(epoch, ErrorCode.INVALID_EVENT)
        if self.is_closed(session_id):
            FENCED.labels(reason="session_closed").inc()
            raise NotFoundError(ErrorCode.SESSION_CLOSED, "the session was closed")
        cur = self._sessions.get(session_id)
        if cur is None or not cur.live:
            self._check_capacity()
        if cur is None:
            self._sessions[session_id] = SessionFence(epoch, owner, input_from=epoch)
            self._live += 1
            return Admission(epoch, bumped=False), False
        if self._authorize and owner != cur.owner:
            # An authorization decision: a higher epoch alone never moves a session.
            if not takeover:
                raise _fenced(WorkerErrorCode.NOT_OWNER, "the session is attached to another owner")
            if not may_take_over:
                FENCED.labels(reason="takeover_denied").inc()
                raise FencedError(
                    WorkerErrorCode.NOT_OWNER, "this identity may not take sessions over from another owner"
                )
        if takeover:
            if cur.epoch >= MAX_EPOCH:  # no higher epoch exists to fence the owner out with
                raise _fenced(
                    WorkerErrorCode.STALE_EPOCH,
                    f"the session is at the highest epoch ({MAX_EPOCH}): it cannot be taken over",
                )
            granted = max(epoch, cur.epoch + 1)
        elif epoch < cur.epoch:
            raise _fenced(
                WorkerErrorCode.STALE_EPOCH, f"epoch {epoch} is below the session's epoch {cur.epoch}"
            )
        elif epoch == cur.epoch and owner != cur.owner:
            raise _fenced(WorkerErrorCode.NOT_OWNER, "the session is attached to another owner at this epoch")
        else:
            granted = epoch
        bumped = granted > cur.epoch
        cur.epoch, cur.owner, cur.input_from = granted, owner, granted
        was_live = cur.live
        if not was_live:
            cur.live = True
            self._live += 1
            self._tombstones.pop(session_id, None)
        return Admission(granted, bumped), was_live

    def _check_capacity(self) -> None:
        if self._max_sessions and self._live >= self._max_sessions:
            SESSIONS_REFUSED.labels(reason="max_sessions").inc()
            raise CapacityError(
                ErrorCode.CAPACITY_EXHAUSTED, f"worker holds its maximum of {self._max_sessions} sessions"
            )

    def check(
        self, session_id: str, epoch: int, owner: str, *, is_input: bool = False, keep_input: bool = False
    ) -> Admission:
        """Admit work under ``(session_id, epoch)`` from ``owner`` or raise (counted).

        ``is_input``: the work is input (APPEND, COMMIT, CLEAR): the owner's input of an epoch it
        has since cancelled is admitted under the current epoch (``Admission.epoch``; see
        ``SessionFence.input_from``). ``keep_input``: a raise of the epoch by this check (an
        abort's) keeps the owner's older input admitted."""
        _check_requested(epoch, WorkerErrorCode.BAD_SUBMISSION)
        cur = self._sessions.get(session_id)
        if cur is None or not cur.live:
            FENCED.labels(reason="unknown_session").inc()
            raise NotFoundError(WorkerErrorCode.UNKNOWN_SESSION, "session is not attached (Attach first)")
        if epoch < cur.epoch:
            if is_input and owner == cur.owner and epoch >= cur.input_from:
                return Admission(cur.epoch, bumped=False)
            raise _fenced(
                WorkerErrorCode.STALE_EPOCH, f"epoch {epoch} is below the session's epoch {cur.epoch}"
            )
        if owner != cur.owner:
            raise _fenced(WorkerErrorCode.NOT_OWNER, "the session is attached to another owner")
        bumped = epoch > cur.epoch
        cur.epoch = epoch
        if bumped and not keep_input:
            cur.input_from = epoch
        return Admission(epoch, bumped)

    def release(self, session_id: str) -> None:
        """Mark the session's model state freed; its fence is remembered (bounded)."""
        cur = self._sessions.get(session_id)
        if cur is None or not cur.live:
            return
        cur.live = False
        self._live -= 1
        self._tombstones[session_id] = None
        while len(self._tombstones) > MAX_TOMBSTONES:
            old, _ = self._tombstones.popitem(last=False)
            self._sessions.pop(old, None)

    def close(self, session_id: str, epoch: int, owner: str) -> bool:
        """The session ended for good: forget its fence and keep a tombstone (its final epoch)
        that refuses any later Attach for ``tombstone_ttl_s``. Only its owner, at an epoch not
        below the session's, may close it (raises otherwise, counted, like ``check``); a
        released session is closed too. Returns whether the session was live (its model state
        must be freed)."""
        _check_requested(epoch, WorkerErrorCode.BAD_SUBMISSION)
        cur = self._sessions.get(session_id)
        if cur is None:
            FENCED.labels(reason="unknown_session").inc()
            raise NotFoundError(WorkerErrorCode.UNKNOWN_SESSION, "session is not attached (Attach first)")
        if epoch < cur.epoch:
            raise _fenced(
                WorkerErrorCode.STALE_EPOCH, f"epoch {epoch} is below the session's epoch {cur.epoch}"
            )
        if owner != cur.owner:
            raise _fenced(WorkerErrorCode.NOT_OWNER, "the session is attached to another owner")
        was_live = cur.live
        if was_live:
            self._live -= 1
        del self._sessions[session_id]
        self._tombstones.pop(session_id, None)
        now = self._clock()
        self._expire(now)
        self._closed[session_id] = (max(epoch, cur.epoch), now + self._ttl)
        while len(self._closed) > self._max_closed:
            self._closed.popitem(last=False)
            TOMBSTONES_EVICTED.inc()
        return was_live

    def is_closed(self, session_id: str) -> bool:
        """Whether the session was closed for good (and its tombstone has not expired)."""
        if session_id not in self._closed:
            return False
        self._expire(self._clock())
        return session_id in self._closed

    def _expire(self, now: float) -> None:
        # Tombstones are kept in closing order with one lifetime: the expired ones are a prefix.
        while self._closed:
            sid, (_, expires) = next(iter(self._closed.items()))
            if expires > now:
                return
            del self._closed[sid]

    def owner_of(self, session_id: str) -> str | None:
        """The owner a live session is attached to."""
        cur = self._sessions.get(session_id)
        return cur.owner if cur is not None and cur.live else None

    def current(self, session_id: str) -> tuple[int, str] | None:
        """``(epoch, owner)`` of a live session (None when it is not attached)."""
        cur = self._sessions.get(session_id)
        return (cur.epoch, cur.owner) if cur is not None and cur.live else None

    def live_sessions_of(self, owner: str) -> list[str]:
        """Sessions currently attached to ``owner`` (a scan: only for the rare orphan reap and a
        new Run stream's reconciliation)."""
        return [sid for sid, f in self._sessions.items() if f.live and f.owner == owner]

    def is_current(self, session_id: str, epoch: int, owner: str) -> bool:
        """Whether output stepped under ``(session_id, epoch)`` may still go to ``owner``."""
        cur = self._sessions.get(session_id)
        return cur is not None and cur.owner == owner and epoch >= cur.epoch

    def input_current(self, session_id: str, epoch: int, owner: str) -> bool:
        """Whether news of input stepped under ``(session_id, epoch)`` (its consumption, VAD,
        turn ends) may still go to ``owner``: the input outlived the owner's cancels since
        (``SessionFence.input_from``), though anything of a reply stepped with it may not."""
        cur = self._sessions.get(session_id)
        return cur is not None and cur.owner == owner and epoch >= cur.input_from


def _check_requested(epoch: int, code: str) -> None:
    """Refuse (counted) an epoch above what a caller may ask for (``MAX_REQUESTED_EPOCH``)."""
    if epoch > MAX_REQUESTED_EPOCH:
        FENCED.labels(reason="epoch_out_of_range").inc()
        raise BadRequestError(code, f"an epoch is at most {MAX_REQUESTED_EPOCH}")


def _fenced(code: WorkerErrorCode, message: str) -> FencedError:
    FENCED.labels(reason=str(code)).inc()
    return FencedError(code, message)
