"""Evictions: the worker a session moved off is told to drop it, as soon as it is reachable.

A resume that takes a session over attaches it on the worker its token names while that worker
is healthy here (``placement.WorkerPool.place(prefer=...)``): the takeover fences the previous
owner out there. Only when that worker is not healthy here does the session move to another
one, and then the old worker may still hold it for its previous owner (a replica that lost its
client but not its link to that worker, or one cut off from this replica only), which could
keep it alive there beside the new placement. So that worker is told to drop it: an ``Attach``
with takeover (the worker grants a higher epoch and fences out whoever held it, under the same
rules as any takeover: with mutual TLS only from an identity allowed to take over), then a
``Release`` at the granted epoch, not ``closed`` (the session lives on elsewhere).

A worker without a healthy link here (down, not yet described, not yet discovered) gets its
evictions once a link of its id turns healthy (the pool's health listeners). Until then they
wait, bounded (``EvictionLimits``): at most ``max_pending``, the oldest dropped first, each for
at most ``ttl_s``; by then the previous owner has let the session go anyway (a replica closes
a session whose client left after its detached grace; a worker releases the sessions of an
owner gone for its orphan grace).

Only for a session this replica holds, and never against its own placement: an eviction is
cancelled when this replica no longer holds the session (it ended here, or another replica took
it over since: the latest owner decides where it lives) or holds it on that worker itself (its
own takeover there fenced the previous owner); one waits while the session is being placed
here, and a placement waits for an eviction of its session in flight. A release at the
eviction's epoch cannot release a later attachment: a later takeover is granted a higher epoch,
and the worker ignores a release below the session's epoch.

A session that moves because its runner placed it again (its worker was lost, or left the
membership) needs none of this: the previous owner is this replica, and the worker's list of
what it holds for this replica, sent when the link comes back, is reconciled
(``routing.Router.reconcile``); a worker that never comes back releases it after its orphan
grace.

Counted in ``duplex_session_evictions_total{result}`` (``EvictionResult``) and
``duplex_session_evictions_pending``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

import grpc

from duplex.clock import MONOTONIC, Clock
from duplex.errors import DuplexError
from duplex.v1 import common_pb2, worker_pb2
from session_service.config import EvictionLimits
from session_service.metrics import EVICTIONS, EVICTIONS_PENDING
from session_service.workers.placement import PlacementLink, WorkerPool
from session_service.workers.step_routing import SessionRegistry

log = logging.getLogger(__name__)

#: The epoch an eviction asks for: with takeover the worker grants more than it holds anyway.
EVICTION_EPOCH = 1

#: Attach outcomes that say "the worker did not answer" (try again when its link is back).
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class EvictionResult(StrEnum):
    """How an eviction ended (the ``result`` label of ``duplex_session_evictions_total``)."""

    EVICTED = "evicted"
    """Taken over and released at the old worker: its previous owner is fenced out there."""
    REFUSED = "refused"
    """The old worker refused the takeover (``not_owner``: this identity may not take it over;
    ``session_closed``; ``capacity_exhausted``: it does not hold the session and has no room)."""
    CANCELLED = "cancelled"
    """Nothing to evict any more: this replica placed the session on that worker itself (its
    takeover fenced the owner there), or no longer holds the session."""
    EXPIRED = "expired"
    """The old worker was not reachable from this replica within ``ttl_s``."""
    DROPPED = "dropped"
    """More than ``max_pending`` evictions waited: the oldest went."""


# Every result exists from the start, so rate() alerts see a zero series.
for _result in EvictionResult:
    EVICTIONS.labels(result=_result)


@dataclass(frozen=True, slots=True)
class Waiting:
    """An eviction waiting for its worker."""

    session_id: str
    worker_id: str
    deadline: float
    """When it expires (on the evictor's clock)."""
    tried_on: tuple[str, int] | None = None
    """The link (address, stream generation) a try failed on: not tried on that stream again."""


class PendingEvictions:
    """Evictions waiting for their worker, one per (session id, worker id), oldest first, at
    most ``max_pending``, each until its deadline. Expired ones are counted when seen."""

    def __init__(self, limits: EvictionLimits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], Waiting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple[str, str]]:
        """(session id, worker id) of the evictions waiting, oldest first (expired ones gone)."""
        self._expire_prefix(self._clock())
        return list(self._entries)

    def add(
        self,
        session_id: str,
        worker_id: str,
        *,
        deadline: float | None = None,
        tried_on: tuple[str, int] | None = None,
    ) -> None:
        """Wait for ``worker_id`` to drop ``session_id`` there (until ``deadline``: ``ttl_s``
        from now by default)."""
        now = self._clock()
        self._expire_prefix(now)
        key = (session_id, worker_id)
        self._entries.pop(key, None)
        self._entries[key] = Waiting(
            session_id, worker_id, now + self._limits.ttl_s if deadline is None else deadline, tried_on
        )
        while len(self._entries) > self._limits.max_pending:
            _, dropped = self._entries.popitem(last=False)
            EVICTIONS.labels(result=EvictionResult.DROPPED).inc()
            log.warning(
                "session %s: eviction at worker %r dropped (more than %d waiting)",
                dropped.session_id,
                dropped.worker_id,
                self._limits.max_pending,
            )
        self._changed()

    def discard(self, session_id: str, worker_id: str) -> bool:
        """Forget the eviction; whether it was waiting."""
        found = self._entries.pop((session_id, worker_id), None) is not None
        if found:
            self._changed()
        return found

    def take(self, due: Callable[[Waiting], bool]) -> list[Waiting]:
        """Remove and return every eviction ``due`` says may run now, oldest first; expired
        ones go (counted) whatever ``due`` says."""
        now = self._clock()
        taken: list[Waiting] = []
        for key, waiting in list(self._entries.items()):
            if waiting.deadline <= now:
                del self._entries[key]
                self._expired(waiting)
            elif due(waiting):
                del self._entries[key]
                taken.append(waiting)
        self._changed()
        return taken

    def _expire_prefix(self, now: float) -> None:
        # Deadlines rise along the order but for the few put back after a failed try; those
        # expire when ``take`` sees them.
        while self._entries:
            key, waiting = next(iter(self._entries.items()))
            if waiting.deadline > now:
                break
            del self._entries[key]
            self._expired(waiting)
        self._changed()

    def _expired(self, waiting: Waiting) -> None:
        EVICTIONS.labels(result=EvictionResult.EXPIRED).inc()
        log.warning(
            "session %s: worker %r was not reachable within %.0f s: not evicted there",
            waiting.session_id,
            waiting.worker_id,
            self._limits.ttl_s,
        )

    def _changed(self) -> None:
        EVICTIONS_PENDING.set(len(self._entries))


class EvictingLink(PlacementLink, Protocol):
    """What an eviction needs of a link besides placement (``WorkerLink`` is one)."""

    def attaching(self, session_id: str) -> bool: ...

    def release(self, release: worker_pb2.Release) -> None: ...


EL = TypeVar("EL", bound=EvictingLink)


class Evictor(Generic[EL]):
    """Places sessions through the pool (``place``: the ``Placer`` of runners and of the
    session manager) and evicts a resumed session from the worker its token named when it was
    placed elsewhere."""

    def __init__(
        self,
        pool: WorkerPool[EL],
        registry: SessionRegistry,
        *,
        limits: EvictionLimits | None = None,
        attach_timeout_s: float = 5.0,
        clock: Clock = MONOTONIC,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._attach_timeout_s = attach_timeout_s
        self.pending = PendingEvictions(limits or EvictionLimits(), clock.now)
        self._running: dict[str, asyncio.Task[None]] = {}
        """The eviction in flight per session (one at a time)."""
        self._placing: Counter[str] = Counter()
        """Sessions this replica is placing now (their evictions wait)."""
        self._closed = False
        pool.health_listeners.append(self._workers_changed)

    async def close(self) -> None:
        """Stop the evictions in flight (the replica stops); start no more."""
        self._closed = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> list[str]:
        """Sessions with an eviction in flight."""
        return list(self._running)

    async def place(
        self, session_id: str, epoch: int, takeover: bool, *, prefer: str | None = None
    ) -> tuple[EL, int]:
        """``WorkerPool.place``; when ``prefer`` (the worker a resumed session's token names)
        was not where the session went, that worker is told to drop it (``evict``)."""
        running = self._running.get(session_id)
        if running is not None:
            # Its eviction first (bounded by the Attach deadline): an Attach of ours racing
            # it on one worker could be granted the lower epoch and then fenced by it.
            await asyncio.wait([running])
        self._placing[session_id] += 1
        try:
            link, granted = await self._pool.place(session_id, epoch, takeover, prefer=prefer)
        finally:
            self._placing[session_id] -= 1
            if self._placing[session_id] <= 0:
                del self._placing[session_id]
        if link.worker_id is not None and self.pending.discard(session_id, link.worker_id):
            # Our own takeover there fenced out whoever held it.
            EVICTIONS.labels(result=EvictionResult.CANCELLED).inc()
        if prefer and link.worker_id != prefer:
            log.info(
                "session %s: placed on %r, not on %r its token names (not healthy here): evicting it there",
                session_id,
                link.worker_id,
                prefer,
            )
            self.pending.add(session_id, prefer)
        # Soon, not now: the caller registers the session's runner first (``_moot`` reads it).
        asyncio.get_running_loop().call_soon(self._start_due)
        return link, granted

    def evict(self, session_id: str, worker_id: str) -> None:
        """Tell worker ``worker_id`` to drop ``session_id``: now when a link to it is healthy,
        else once one is (bounded: ``EvictionLimits``)."""
        self.pending.add(session_id, worker_id)
        self._start_due()

    def _workers_changed(self, _any_healthy: bool) -> None:
        self._start_due()

    def _moot(self, session_id: str, worker_id: str) -> bool:
        """Whether there is nothing to evict: this replica no longer holds the session (it ended
        here, or was taken over again: the latest owner decides where it lives), or holds it on
        that worker itself (its own takeover there fenced whoever held it)."""
        runner = self._registry.get(session_id)
        if runner is None or runner.closed:
            return True
        link = runner.link
        return link is not None and link.worker_id == worker_id

    def _start_due(self) -> None:
        """Start the evictions whose worker is reachable now (one per session at a time)."""
        if self._closed or not self.pending:
            return
        placeable = self._pool.placeable()
        busy = set(self._running) | set(self._placing)

        def due(waiting: Waiting) -> bool:
            link = placeable.get(waiting.worker_id)
            if link is None or waiting.session_id in busy:
                return False
            if waiting.tried_on == (link.address, link.generation):
                return False  # it did not answer on this stream: wait for the next one
            busy.add(waiting.session_id)
            return True

        for waiting in self.pending.take(due):
            link = placeable[waiting.worker_id]
            if self._moot(waiting.session_id, waiting.worker_id) or link.attaching(waiting.session_id):
                EVICTIONS.labels(result=EvictionResult.CANCELLED).inc()
                continue
            task = asyncio.create_task(self._evict(link, waiting), name=f"evict-{waiting.session_id}")
            self._running[waiting.session_id] = task
            task.add_done_callback(functools.partial(self._done, waiting.session_id))

    def _done(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(session_id) is task:
            del self._running[session_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("session %s: eviction failed", session_id, exc_info=task.exception())
        self._start_due()  # another eviction of the session may have waited for this one

    async def _evict(self, link: EL, waiting: Waiting) -> None:
        session_id, worker_id = waiting.session_id, waiting.worker_id
        generation = link.generation
        try:
            granted = await link.attach(
                session_id, EVICTION_EPOCH, takeover=True, deadline_s=self._attach_timeout_s
            )
        except DuplexError as err:
            if err.status in _UNREACHABLE:
                # Its stream went, or the worker hangs: again on its next stream.
                log.info("session %s: eviction at %r: the worker did not answer", session_id, worker_id)
                self.pending.add(
                    session_id, worker_id, deadline=waiting.deadline, tried_on=(link.address, generation)
                )
                return
            EVICTIONS.labels(result=EvictionResult.REFUSED).inc()
            log.warning(
                "session %s: worker %r (%s) refused its eviction: %s (%s)",
                session_id,
                worker_id,
                link.address,
                err.message,
                err.code,
            )
            return
        if link.healthy and link.generation == generation:
            fence = common_pb2.Fence(session_id=session_id, epoch=granted)
            link.release(worker_pb2.Release(request_id=session_id, fence=fence))
        # else the link released it again itself: its Attach outlived the stream it was made on
        EVICTIONS.labels(result=EvictionResult.EVICTED).inc()
        log.info(
            "session %s: evicted from worker %r (%s) at epoch %d: it lives on elsewhere",
            session_id,
            worker_id,
            link.address,
            granted,
        )
