"""Releases a worker link keeps while it has no stream: one per session, bounded.

A session released while its worker's link is down must still be released there: its release
is kept and sent first thing on the link's next stream. State only, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from duplex.v1 import worker_pb2
from session_service.metrics import RELEASES_DROPPED, RELEASES_KEPT

#: Releases a link keeps while it has no stream (one per session; beyond it the oldest is
#: dropped and counted: the next stream's reconciliation releases that session anyway). Four
#: times a worker's default session limit.
MAX_KEPT_RELEASES = 4096


class KeptReleases:
    """Releases waiting for a stream, by session id, oldest first (``MAX_KEPT_RELEASES``)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, worker_pb2.Release] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._kept

    def session_ids(self) -> list[str]:
        """The sessions whose releases wait, oldest first."""
        return list(self._kept)

    def keep(self, releases: Iterable[worker_pb2.Release], *, count: bool = True) -> None:
        """Keep releases for the next stream: one per session (a later one replaces an earlier
        one, closed if either was), at most ``MAX_KEPT_RELEASES``, the oldest dropped first."""
        kept = self._kept
        for rel in releases:
            sid = rel.fence.session_id
            earlier = kept.pop(sid, None)
            if earlier is not None and earlier.closed and not rel.closed:
                rel = worker_pb2.Release(request_id=rel.request_id, fence=rel.fence, closed=True)
            kept[sid] = rel
            if count:
                RELEASES_KEPT.inc()
        while len(kept) > MAX_KEPT_RELEASES:
            kept.popitem(last=False)
            RELEASES_DROPPED.inc()

    def forget(self, session_id: str) -> None:
        self._kept.pop(session_id, None)

    def take(self) -> list[worker_pb2.Release]:
        """Every kept release, oldest first; none is kept after."""
        taken = list(self._kept.values())
        self._kept.clear()
        return taken
