"""The fencing authority: per session, the highest accepted epoch and the current owner.

It runs on the asyncio side only (Attach and Run commands are handled there), so it needs no
lock; the engine thread learns about epoch changes through ordered engine commands. Every
rejection raises ``FencedError``/``NotFoundError`` with the protocol's code and is counted here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from duplex.errors import CapacityError, ErrorCode, FencedError, NotFoundError, WorkerErrorCode
from worker_service.metrics import FENCED

#: Released sessions whose fence (epoch, owner) is remembered so a stale owner stays fenced.
MAX_TOMBSTONES = 65_536


@dataclass(slots=True)
class SessionFence:
    epoch: int
    owner: str
    live: bool = True
    """Attached and not released (counts against ``max_sessions``)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of a fence check that passed."""

    epoch: int
    """The session's highest accepted epoch now."""
    bumped: bool
    """The epoch rose: older queued and running work of the session must be aborted."""


class FenceTable:
    """Highest accepted epoch and owner per session (see docs/worker-protocol.md, Identity and fencing)."""

    def __init__(self, max_sessions: int = 0) -> None:
        self._sessions: dict[str, SessionFence] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_sessions = max_sessions
        self._live = 0

    @property
    def live_sessions(self) -> int:
        return self._live

    def attach(self, session_id: str, epoch: int, owner: str, takeover: bool) -> tuple[Admission, bool]:
        """Bind ``session_id`` to ``owner``; returns the admission and whether it was already live."""
        cur = self._sessions.get(session_id)
        if cur is None or not cur.live:
            self._check_capacity()
        if cur is None:
            self._sessions[session_id] = SessionFence(epoch, owner)
            self._live += 1
            return Admission(epoch, bumped=False), False
        if takeover:
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
        cur.epoch, cur.owner = granted, owner
        was_live = cur.live
        if not was_live:
            cur.live = True
            self._live += 1
            self._tombstones.pop(session_id, None)
        return Admission(granted, bumped), was_live

    def _check_capacity(self) -> None:
        if self._max_sessions and self._live >= self._max_sessions:
            raise CapacityError(
                ErrorCode.CAPACITY_EXHAUSTED, f"worker holds its maximum of {self._max_sessions} sessions"
            )

    def check(self, session_id: str, epoch: int, owner: str) -> Admission:
        """Admit work under ``(session_id, epoch)`` from ``owner`` or raise (counted)."""
        cur = self._sessions.get(session_id)
        if cur is None or not cur.live:
            FENCED.labels(reason="unknown_session").inc()
            raise NotFoundError(WorkerErrorCode.UNKNOWN_SESSION, "session is not attached (Attach first)")
        if epoch < cur.epoch:
            raise _fenced(
                WorkerErrorCode.STALE_EPOCH, f"epoch {epoch} is below the session's epoch {cur.epoch}"
            )
        if owner != cur.owner:
            raise _fenced(WorkerErrorCode.NOT_OWNER, "the session is attached to another owner")
        bumped = epoch > cur.epoch
        cur.epoch = epoch
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

    def owner_of(self, session_id: str) -> str | None:
        """The owner a live session is attached to."""
        cur = self._sessions.get(session_id)
        return cur.owner if cur is not None and cur.live else None

    def live_sessions_of(self, owner: str) -> list[str]:
        """Sessions currently attached to ``owner`` (a scan: only for the rare orphan reap)."""
        return [sid for sid, f in self._sessions.items() if f.live and f.owner == owner]

    def is_current(self, session_id: str, epoch: int, owner: str) -> bool:
        """Whether output stepped under ``(session_id, epoch)`` may still go to ``owner``."""
        cur = self._sessions.get(session_id)
        return cur is not None and cur.owner == owner and epoch >= cur.epoch


def _fenced(code: WorkerErrorCode, message: str) -> FencedError:
    FENCED.labels(reason=str(code)).inc()
    return FencedError(code, message)
