"""Placement: which worker holds a session, by rendezvous hashing over the healthy ones.

Every replica computes the same owner for a session from the session id and the healthy
workers' own ids (``WorkerDescription.worker_id``, from ``Describe``) alone, so no shared state
is needed, whatever addresses the workers have or the order DNS lists them in; removing a
worker moves only its sessions, and a worker that comes back under its id (a restarted pod with
a new address) takes back the same sessions. A worker whose ``Describe`` has not answered is
not placeable.

``WorkerPool`` holds the links (``session_service.workers.link`` in the service; anything that
is a ``PlacementLink`` in a test), keyed by address; ``update`` changes that set while the
service runs (``session_service.workers.discovery``): a new address gets a link, a removed one's link
is closed (its sessions get ``worker_unavailable`` and move at their next turn, as for a lost
worker). It attaches a session on its rendezvous choice, the next one when a worker does not
answer or has no room; a resumed session tries the worker its token names first
(``prefer``), so a session stays where it lives while that worker is healthy.

One worker, one link: two addresses may reach workers that report the same id (a dual-stack
pod's A and AAAA records; an old address still answering during a pod move; two workers given
one ``--worker-id``). Only one of them may hold a Run stream (``claim``): a second stream of
the same owner to the same worker would end the first, and two processes under one id must
not both take sessions. The choice is deterministic where it can be: among the links whose
latest ``Describe`` reported the id, the lowest address; but a link that already serves is
never cut for another (its sessions would fail), so the choice is made again only when it
loses its stream. The others stand by (logged once) and ask again at their reconnect pace.

What placement raises may reach a client as it is: its messages never name a worker (its
address) nor carry gRPC's own text (which names addresses too); those are logged here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

import grpc

from duplex.errors import CapacityError, DuplexError, ErrorCode, UnavailableError
from duplex.v1 import worker_pb2
from session_service.metrics import (
    WORKER_LINKS,
    WORKER_SESSIONS,
    WORKER_STALLS,
    WORKER_TICK_COMMANDS,
    WORKER_TICK_LEAD,
    WORKERS_HEALTHY,
)
from session_service.plugin import PluginLoadError

log = logging.getLogger(__name__)

#: Longest worker id a link accepts from ``Describe`` (as long as the worker's own ids).
MAX_WORKER_ID_LENGTH = 128


def worker_key(desc: worker_pb2.WorkerDescription, address: str) -> str:
    """The id placement ranks a worker by: its ``worker_id``; a worker that reports none is
    known by its address. Raises ``PluginLoadError`` for an id longer than
    ``MAX_WORKER_ID_LENGTH`` or holding a control character."""
    worker_id = desc.worker_id
    if not worker_id:
        return address
    if len(worker_id) > MAX_WORKER_ID_LENGTH or not worker_id.isprintable():
        raise PluginLoadError(
            f"the worker's id is not usable (at most {MAX_WORKER_ID_LENGTH} printable characters): "
            f"{worker_id[:MAX_WORKER_ID_LENGTH]!r}"
        )
    return worker_id


#: Attach outcomes that say "this worker did not answer" (try the next one), not "it refused".
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

#: Attach refusals that are final and passed through as they are: fenced out by another owner
#: or epoch, or the session was closed for good (its worker keeps a tombstone).
_REFUSALS = frozenset(
    {ErrorCode.STALE_EPOCH, ErrorCode.NOT_OWNER, ErrorCode.FENCED, ErrorCode.SESSION_CLOSED}
)

#: What a client is told when no worker took the session (the details are logged).
NO_WORKER_REACHABLE = "no worker of the model is reachable"
NO_WORKER_TOOK = "no worker could take the session"
NO_WORKER_ROOM = "no worker has room for the session"


def _score(key: str, node: str) -> int:
    # A keyed cryptographic hash, not hash(): stable across processes and Python versions.
    digest = hashlib.blake2b(f"{node}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(key: str, nodes: Iterable[str]) -> list[str]:
    """Nodes ordered by preference for ``key`` (best first)."""
    return sorted(set(nodes), key=lambda n: (_score(key, n), n), reverse=True)


def rendezvous_pick(key: str, nodes: Iterable[str]) -> str | None:
    """The node that owns ``key``, or None when there is none."""
    best: str | None = None
    best_score = -1
    for node in nodes:
        score = _score(key, node)
        if score > best_score or (score == best_score and best is not None and node > best):
            best, best_score = node, score
    return best


class PlacementLink(Protocol):
    """What placement needs of a worker link (``WorkerLink`` is one)."""

    address: str
    generation: int
    """Counts the link's Run streams: an Attach made under one is not held by the next."""
    worker_id: str | None
    """The id the worker reported (``Describe``) while the link reaches it; None before its
    first answer and after the link failed. Placement ranks workers by it."""

    @property
    def healthy(self) -> bool: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int: ...


L = TypeVar("L", bound=PlacementLink)

#: Builds the link of one worker address; it must call ``on_health`` whenever it turns healthy
#: or unhealthy.
LinkFactory = Callable[[str, Callable[[], None]], L]


class WorkerPool(Generic[L]):
    """The worker links (configured, or discovered: ``update``); places sessions by rendezvous
    hashing of the session id over the healthy workers' ids."""

    def __init__(
        self, addresses: Sequence[str], *, link_factory: LinkFactory[L], attach_timeout_s: float = 5.0
    ) -> None:
        self._attach_timeout_s = attach_timeout_s
        self._ready = asyncio.Event()
        self._factory = link_factory
        self._started = False
        self.links: dict[str, L] = {
            addr: link_factory(addr, self._health_changed) for addr in dict.fromkeys(addresses)
        }
        """Every link, by the address it dials."""
        self.health_listeners: list[Callable[[bool], None]] = []
        self._serving: dict[str, PlacementLink] = {}
        """Worker id -> the one link that may hold a Run stream to it (``claim``)."""
        self._standing_by: set[tuple[str, str]] = set()
        """(address, worker id) of links refused a claim, logged once."""
        WORKER_LINKS.set(len(self.links))

    def start(self) -> None:
        self._started = True
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        self._started = False
        await asyncio.gather(*(link.close() for link in self.links.values()))

    async def update(self, addresses: Iterable[str]) -> None:
        """Make the links those of ``addresses``: a link for each new one (started once the pool
        is), and each one no longer listed closed (its sessions get ``worker_unavailable`` and
        move at their next turn, as for a lost worker; its metric series go with it). The links
        of addresses kept are untouched. Called by one task at a time (the discovery loop)."""
        want = list(dict.fromkeys(addresses))
        keep = set(want)
        removed = [self.links.pop(addr) for addr in list(self.links) if addr not in keep]
        for link in removed:
            self.release(link)  # at once: another address of its worker may take over
        added = [addr for addr in want if addr not in self.links]
        for addr in added:
            link = self._factory(addr, self._health_changed)
            self.links[addr] = link
            if self._started:
                link.start()
        WORKER_LINKS.set(len(self.links))
        if added or removed:
            log.info(
                "workers: %d links (added %s; removed %s)",
                len(self.links),
                ", ".join(added) or "none",
                ", ".join(f"{link.address} ({link.worker_id or 'not described'})" for link in removed)
                or "none",
            )
        if not removed:
            return
        await asyncio.gather(*(link.close() for link in removed))
        for link in removed:
            if link.address in self.links:  # back already (a later update): its series are live
                continue
            for metric in (WORKER_SESSIONS, WORKER_STALLS, WORKER_TICK_LEAD):
                with contextlib.suppress(KeyError):
                    metric.remove(link.address)
            for outcome in ("made", "missed"):
                with contextlib.suppress(KeyError):
                    WORKER_TICK_COMMANDS.remove(link.address, outcome)

    # ---- one link per worker id ----------------------------------------------------------------

    def claim(self, link: PlacementLink, worker_id: str) -> bool:
        """Whether ``link``, whose worker just described itself as ``worker_id``, may open its
        Run stream; if so it serves that id until ``release``. Refused while another link of the
        pool serves the id, or reports it too from a lower address (links that described together
        prefer the lower address; otherwise the first to describe keeps it, so a serving stream is
        never cut for a late twin); the refused link stands by and asks again."""
        if not self._member(link):
            return False  # removed meanwhile
        holder = self._serving.get(worker_id)
        if holder is link:
            return True
        if holder is not None and self._member(holder):
            self._stand_by(link, worker_id, holder.address, "serves it")
            return False
        rivals = sorted(
            other.address
            for other in self.links.values()
            if other is not link and other.worker_id == worker_id and other.address < link.address
        )
        if rivals:
            self._stand_by(link, worker_id, rivals[0], "reports it from a lower address")
            return False
        self.release(link)
        self._serving[worker_id] = link
        if (link.address, worker_id) in self._standing_by:
            self._standing_by.discard((link.address, worker_id))
            log.info("worker %r: now served through %s", worker_id, link.address)
        return True

    def _member(self, link: PlacementLink) -> bool:
        """Whether ``link`` is still the pool's link for its address (not removed)."""
        member: PlacementLink | None = self.links.get(link.address)
        return member is link

    def release(self, link: PlacementLink) -> None:
        """``link`` holds no Run stream any more (lost, failed, closed)."""
        for worker_id in [w for w, holder in self._serving.items() if holder is link]:
            del self._serving[worker_id]

    def _stand_by(self, link: PlacementLink, worker_id: str, other: str, why: str) -> None:
        key = (link.address, worker_id)
        if key not in self._standing_by:
            self._standing_by.add(key)
            log.warning(
                "worker %r answers at %s, but %s %s (a second address of the same worker, an old "
                "address still answering, or two workers given one --worker-id): %s stands by",
                worker_id,
                link.address,
                other,
                why,
                link.address,
            )

    # ---- health and placement ------------------------------------------------------------------

    def healthy(self) -> list[L]:
        return [link for link in self.links.values() if link.healthy]

    @property
    def ready(self) -> bool:
        return bool(self.healthy())

    async def wait_ready(self, within_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._ready.wait()
        return self.ready

    def _health_changed(self) -> None:
        n = len(self.healthy())
        WORKERS_HEALTHY.set(n)
        if n:
            self._ready.set()
        else:
            self._ready.clear()
        for listener in self.health_listeners:
            listener(n > 0)

    def placeable(self) -> dict[str, L]:
        """The healthy links by worker id: one per id (the lowest address, should two healthy
        links report one id, which ``claim`` prevents for links that claim)."""
        chosen: dict[str, L] = {}
        for link in sorted(self.healthy(), key=lambda candidate: candidate.address):
            if link.worker_id:
                chosen.setdefault(link.worker_id, link)
        return chosen

    def rank(self, session_id: str, *, prefer: str | None = None) -> list[L]:
        """The placeable links in the session's rendezvous order over worker ids (best first);
        the link of worker ``prefer`` first when it is placeable."""
        placeable = self.placeable()
        order = rendezvous_rank(session_id, placeable)
        if prefer is not None and prefer in placeable:
            order.remove(prefer)
            order.insert(0, prefer)
        return [placeable[worker_id] for worker_id in order]

    def pick(self, session_id: str) -> L:
        ranked = self.rank(session_id)
        if not ranked:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, NO_WORKER_REACHABLE)
        return ranked[0]

    async def place(
        self, session_id: str, epoch: int, takeover: bool, *, prefer: str | None = None
    ) -> tuple[L, int]:
        """Attach the session on its rendezvous choice among the healthy workers; returns the
        link and the granted epoch. ``prefer``: a worker id to try first while it is healthy
        (a resumed session's own worker, where the takeover fences its previous owner out);
        the rendezvous order follows it.

        A worker that does not answer the Attach (gone, or its stream lost meanwhile) or has no
        room (``capacity_exhausted``) is skipped for the next one in rendezvous order; a fencing
        refusal (``stale_epoch``, ``not_owner``, ``fenced``) or ``session_closed`` is final and
        raised as it is. When no worker took it: ``capacity_exhausted`` if one had no room, else
        ``worker_unavailable`` (both retryable), with a message that names no worker. The link
        returned is healthy and on the same Run stream the Attach was made under, so the
        session's first submission reaches the worker that holds its attachment.
        """
        tried: set[str] = set()
        full = False
        while True:
            ranked = [link for link in self.rank(session_id, prefer=prefer) if link.address not in tried]
            if not ranked:
                if full:
                    raise CapacityError(ErrorCode.CAPACITY_EXHAUSTED, NO_WORKER_ROOM)
                raise UnavailableError(
                    ErrorCode.WORKER_UNAVAILABLE, NO_WORKER_TOOK if tried else NO_WORKER_REACHABLE
                )
            link = ranked[0]
            tried.add(link.address)
            generation = link.generation
            try:
                granted = await link.attach(
                    session_id, epoch, takeover=takeover, deadline_s=self._attach_timeout_s
                )
            except DuplexError as err:
                if err.code in _REFUSALS:
                    raise
                log.warning(
                    "session %s: attach to %s (%r) failed: %s (%s)",
                    session_id,
                    link.address,
                    link.worker_id,
                    err.message,
                    err.status.name,
                )
                if err.code == ErrorCode.CAPACITY_EXHAUSTED:
                    full = True
                    continue
                if err.status not in _UNREACHABLE:
                    raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, NO_WORKER_TOOK) from err
                continue
            if link.healthy and link.generation == generation:
                return link, granted
            log.warning(
                "session %s: the Run stream to %s was lost while it attached", session_id, link.address
            )
