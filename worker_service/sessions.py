"""The sessions the worker holds: their fences and the bookkeeping that follows each of them.

Beneath it, ``fencing.FenceTable``: per session the highest accepted epoch and the owner, and
the tombstones of sessions closed for good. Beside the fences, what the calls keep per session:
the request id its owner uses (a displaced owner is told under it), its input queue counter
(per-session capacity), and its attach lease; and per owner, the orphan reap pending since its
last Run stream ended.

State nobody owns does not stay: an owner that does not come back within the orphan grace has
its sessions released, and so does an Attach nobody uses while its owner has no Run stream
(``attach_lease_s``). What those transitions need of the rest of the worker comes in as two
callables (whether an owner has a Run stream; queueing engine commands), so this module holds
state and timers, not streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from worker_service.config import WorkerConfig
from worker_service.engine_types import EngineCommand, EngineDeadError, QueueCounter, ReleaseSession
from worker_service.fencing import FenceTable
from worker_service.metrics import ATTACH_LEASES_EXPIRED, ORPHANS_RELEASED

logger = logging.getLogger(__name__)


class SessionTable:
    """The fence table plus each session's and each owner's bookkeeping (event loop only)."""

    def __init__(
        self,
        fences: FenceTable,
        config: WorkerConfig,
        *,
        has_stream: Callable[[str], bool],
        submit: Callable[[Sequence[EngineCommand]], None],
    ) -> None:
        """``has_stream(owner)``: whether the owner has a Run stream open now; ``submit``: queue
        engine commands (``Engine.submit``), used to free released sessions' model state."""
        self._fences = fences
        self._config = config
        self._has_stream = has_stream
        self._submit = submit
        self._counters: dict[str, QueueCounter] = {}
        # The request id each session's owner uses (to tell a displaced owner about a takeover).
        self._request_ids: dict[str, str] = {}
        self._reapers: dict[str, asyncio.Task[None]] = {}
        # Sessions attached and not yet claimed by a submission or abort: released when their
        # owner still has no Run stream once the lease is up (``attach_lease_s``).
        self._leases: dict[str, asyncio.TimerHandle] = {}

    @property
    def fences(self) -> FenceTable:
        return self._fences

    # -- per session -----------------------------------------------------------------------------

    def request_id(self, session_id: str) -> str | None:
        """The request id the session's owner uses (from its Attach or latest submission)."""
        return self._request_ids.get(session_id)

    def attached(self, session_id: str, owner: str, request_id: str) -> None:
        """An Attach of ``owner`` was granted: (re)start the lease, note the request id."""
        self._lease(session_id, owner)
        self._request_ids[session_id] = request_id

    def counter(self, session_id: str) -> QueueCounter:
        """The session's input queue counter (created on first use)."""
        counter = self._counters.get(session_id)
        if counter is None:
            counter = self._counters[session_id] = QueueCounter()
        return counter

    def submitted(self, session_id: str, request_id: str) -> None:
        """A submission of the session was accepted: its owner uses ``request_id`` now."""
        self._request_ids[session_id] = request_id
        self.claim(session_id)

    def claim(self, session_id: str) -> None:
        """The session's owner used it (or it is gone): its lease ends."""
        if not self._leases:  # the common case: nothing to look up
            return
        handle = self._leases.pop(session_id, None)
        if handle is not None:
            handle.cancel()

    def forget(self, session_id: str) -> None:
        """Drop the bookkeeping of a session that is no longer live."""
        self._counters.pop(session_id, None)
        self._request_ids.pop(session_id, None)
        self.claim(session_id)

    def release(self, session_ids: list[str]) -> None:
        """Free the sessions' model state and mark them released (their fences are kept)."""
        try:
            self._submit([ReleaseSession(sid) for sid in session_ids])
        except EngineDeadError:
            pass  # nothing to free: the engine and its state are gone
        for sid in session_ids:
            self._fences.release(sid)
            self.forget(sid)

    # -- attach leases ---------------------------------------------------------------------------

    def _lease(self, session_id: str, owner: str) -> None:
        """(Re)start the session's attach lease (``attach_lease_s``)."""
        lease_s = self._config.attach_lease_s
        if not lease_s:
            return
        self.claim(session_id)
        loop = asyncio.get_running_loop()
        self._leases[session_id] = loop.call_later(lease_s, self._lease_expired, session_id, owner)

    def _lease_expired(self, session_id: str, owner: str) -> None:
        """Nothing claimed the attachment within the lease. An owner with a Run stream knows
        what it holds (and reconciles it whenever a stream opens); one without a stream may
        never open one, and nothing else would release the session: it is released now."""
        self._leases.pop(session_id, None)
        if self._fences.owner_of(session_id) != owner or self._has_stream(owner):
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
        self.release([session_id])

    # -- orphan reaping --------------------------------------------------------------------------

    def owner_returned(self, owner: str) -> None:
        """A Run stream of ``owner`` opened: a pending reap is called off (the owner is back
        within its grace and reconciles what it holds)."""
        reaper = self._reapers.pop(owner, None)
        if reaper is not None:
            reaper.cancel()

    def owner_left(self, owner: str) -> None:
        """A Run stream of ``owner`` ended: with no other stream of it open, its sessions are
        released unless it comes back within the orphan grace."""
        if not self._has_stream(owner) and owner not in self._reapers:
            self._reapers[owner] = asyncio.create_task(self._reap_orphans(owner))

    async def _reap_orphans(self, owner: str) -> None:
        """Release the sessions of an owner that did not come back (crashed, partitioned, cut
        off): nothing else would ever free their model state, slots and capacity."""
        try:
            await asyncio.sleep(self._config.orphan_grace_s)
        finally:
            if self._reapers.get(owner) is asyncio.current_task():
                del self._reapers[owner]
        if self._has_stream(owner):
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
        self.release(orphans)

    def cancel_timers(self) -> None:
        """Stop pending orphan reaps and attach leases (server shutdown)."""
        for task in self._reapers.values():
            task.cancel()
        self._reapers.clear()
        for handle in self._leases.values():
            handle.cancel()
        self._leases.clear()
