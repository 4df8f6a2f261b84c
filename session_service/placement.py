"""Placement: which worker holds a session, by rendezvous hashing over the healthy ones.

Every replica computes the same owner for a session from the session id and the healthy
worker set alone, so no shared state is needed; removing a worker moves only its sessions.
``WorkerPool`` holds the links (``session_service.worker_link``) and attaches a session on its
rendezvous choice, the next one when a worker does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence

import grpc

from duplex.errors import DuplexError, ErrorCode, UnavailableError
from duplex.v1 import worker_pb2
from session_service.metrics import WORKERS_HEALTHY
from session_service.plugin import DuplexModelPlugin
from session_service.worker_link import DEFAULT_STALL_TIMEOUT_S, WorkerLink

log = logging.getLogger(__name__)

#: Attach outcomes that say "this worker did not answer" (try the next one), not "it refused".
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


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


class WorkerPool:
    """Every configured worker; places sessions by rendezvous hashing over the healthy ones."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        owner: str,
        plugin: DuplexModelPlugin,
        on_step: Callable[[WorkerLink, worker_pb2.StepOutput], None],
        on_lost: Callable[[WorkerLink], None],
        attach_timeout_s: float = 5.0,
        backoff_max_s: float = 5.0,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        """``stall_timeout_s``: see ``WorkerLink`` (0 turns the stall check off)."""
        self.owner = owner
        self._attach_timeout_s = attach_timeout_s
        self._ready = asyncio.Event()
        self.links: dict[str, WorkerLink] = {
            addr: WorkerLink(
                addr,
                owner=owner,
                plugin=plugin,
                on_step=on_step,
                on_lost=on_lost,
                on_health=self._health_changed,
                backoff_max_s=backoff_max_s,
                stall_timeout_s=stall_timeout_s,
            )
            for addr in dict.fromkeys(addresses)
        }
        self.health_listeners: list[Callable[[bool], None]] = []

    def start(self) -> None:
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))

    def healthy(self) -> list[WorkerLink]:
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

    def rank(self, session_id: str) -> list[WorkerLink]:
        """The healthy links in the session's rendezvous order (best first)."""
        healthy = {link.address: link for link in self.healthy()}
        return [healthy[addr] for addr in rendezvous_rank(session_id, healthy)]

    def pick(self, session_id: str) -> WorkerLink:
        ranked = self.rank(session_id)
        if not ranked:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "no worker of the model is reachable")
        return ranked[0]

    async def place(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerLink, int]:
        """Attach the session on its rendezvous choice among the healthy workers; returns the
        link and the granted epoch.

        A worker that does not answer the Attach (gone, or its stream lost meanwhile) is skipped
        for the next one in rendezvous order; a fencing refusal is final. The link returned is
        healthy and on the same Run stream the Attach was made under, so the session's first
        submission reaches the worker that holds its attachment.
        """
        tried: set[str] = set()
        last: DuplexError | None = None
        while True:
            ranked = [link for link in self.rank(session_id) if link.address not in tried]
            if not ranked:
                if last is None:
                    raise UnavailableError(
                        ErrorCode.WORKER_UNAVAILABLE, "no worker of the model is reachable"
                    )
                raise UnavailableError(
                    ErrorCode.WORKER_UNAVAILABLE, f"no worker could take the session: {last.message}"
                ) from last
            link = ranked[0]
            tried.add(link.address)
            generation = link.generation
            try:
                granted = await link.attach(
                    session_id, epoch, takeover=takeover, deadline_s=self._attach_timeout_s
                )
            except DuplexError as err:
                if err.code in (ErrorCode.STALE_EPOCH, ErrorCode.NOT_OWNER, ErrorCode.FENCED):
                    raise
                if err.status not in _UNREACHABLE:
                    raise UnavailableError(
                        ErrorCode.WORKER_UNAVAILABLE, f"attach failed: {err.message}"
                    ) from err
                log.warning("session %s: attach to %s failed: %s", session_id, link.address, err.message)
                last = err
                continue
            if link.healthy and link.generation == generation:
                return link, granted
            last = UnavailableError(ErrorCode.WORKER_UNAVAILABLE, f"worker {link.address} went away")
