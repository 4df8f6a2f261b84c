"""Rendezvous (highest random weight) placement of sessions on workers.

Every replica computes the same owner for a session from the session id and the healthy
worker set alone, so no shared state is needed; removing a worker moves only its sessions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


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
