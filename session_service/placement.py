"""Placement: which worker holds a session, by rendezvous hashing over the healthy ones.

Every replica computes the same owner for a session from the session id and the healthy
worker set alone, so no shared state is needed; removing a worker moves only its sessions.
``WorkerPool`` holds the links (``session_service.worker_link`` in the service; anything that
is a ``PlacementLink`` in a test) and attaches a session on its rendezvous choice, the next one
when a worker does not answer or has no room.

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
from session_service.metrics import WORKERS_HEALTHY

log = logging.getLogger(__name__)

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
    """Every configured worker; places sessions by rendezvous hashing over the healthy ones."""

    def __init__(
        self, addresses: Sequence[str], *, link_factory: LinkFactory[L], attach_timeout_s: float = 5.0
    ) -> None:
        self._attach_timeout_s = attach_timeout_s
        self._ready = asyncio.Event()
        self.links: dict[str, L] = {
            addr: link_factory(addr, self._health_changed) for addr in dict.fromkeys(addresses)
        }
        self.health_listeners: list[Callable[[bool], None]] = []

    def start(self) -> None:
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))

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

    def rank(self, session_id: str) -> list[L]:
        """The healthy links in the session's rendezvous order (best first)."""
        healthy = {link.address: link for link in self.healthy()}
        return [healthy[addr] for addr in rendezvous_rank(session_id, healthy)]

    def pick(self, session_id: str) -> L:
        ranked = self.rank(session_id)
        if not ranked:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, NO_WORKER_REACHABLE)
        return ranked[0]

    async def place(self, session_id: str, epoch: int, takeover: bool) -> tuple[L, int]:
        """Attach the session on its rendezvous choice among the healthy workers; returns the
        link and the granted epoch.

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
            ranked = [link for link in self.rank(session_id) if link.address not in tried]
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
                    "session %s: attach to %s failed: %s (%s)",
                    session_id,
                    link.address,
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
