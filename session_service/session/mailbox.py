"""A session's mailbox: the ordered queue of what its runner handles, bounded by count and bytes.

A client that sends faster than its session handles waits in ``put`` (its stream is not read
meanwhile, so HTTP/2 flow control pushes back on it) once either bound is reached: a count
alone would let 256 events of up to 320 KiB each pile up per session.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """FIFO of items with a size each; at most ``max_items`` and ``max_bytes`` at once (an item
    larger than ``max_bytes`` is still taken when the mailbox is empty, so it cannot wedge)."""

    def __init__(self, *, max_items: int, max_bytes: int) -> None:
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._items: deque[tuple[T, int]] = deque()
        self.bytes = 0
        """Bytes held now."""
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def _fits(self, size: int) -> bool:
        return not self._items or (
            len(self._items) < self._max_items and self.bytes + size <= self._max_bytes
        )

    def takes_at_once(self, size: int) -> bool:
        """Whether ``size`` bytes may be taken past the queue now: nothing is queued and they fit
        (the runner applies an append in its sender's task then; see ``charge``)."""
        return not self._items and self.has_room(size)

    def has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the bound with what is held now."""
        return self.bytes + size <= self._max_bytes

    def charge(self, size: int) -> None:
        """Count bytes held outside the queue (an append applied at once, its write not done)
        against the bound, so a sender cannot hold more by going past the queue."""
        self.bytes += size

    def discharge(self, size: int) -> None:
        """Bytes ``charge`` counted are no longer held."""
        self.bytes -= size
        self._writable.set()

    def put_nowait(self, item: T, size: int = 0) -> bool:
        """Queue ``item``; False (nothing queued) when it does not fit now."""
        if not self._fits(size):
            return False
        self._items.append((item, size))
        self.bytes += size
        self._readable.set()
        return True

    def put_control(self, item: T) -> None:
        """Queue an item of the runner's own (at most one of a kind waits at a time), whatever
        the bounds: it must not be lost to a client filling the mailbox."""
        self._items.append((item, 0))
        self._readable.set()

    async def put(self, item: T, size: int = 0) -> None:
        """Queue ``item``, waiting while it does not fit (backpressure to the sender)."""
        while not self.put_nowait(item, size):
            self._writable.clear()
            await self._writable.wait()

    def get_nowait(self) -> T | None:
        """The next item, or None when empty."""
        if not self._items:
            return None
        item, size = self._items.popleft()
        self.bytes -= size
        self._writable.set()
        return item

    async def get(self) -> T:
        """The next item, waiting for one."""
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        item = self.get_nowait()
        assert item is not None
        return item
