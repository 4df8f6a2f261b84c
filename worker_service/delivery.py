"""Per-owner output queues on the asyncio side: where the engine's results land.

The engine thread never waits for an owner: its sink schedules ``deliver`` on the event loop
(``call_soon_threadsafe``), which appends to each owner's bounded channel. An owner whose
channel is full is too slow to keep up: its stream is ended with RESOURCE_EXHAUSTED (it
reconnects and its sessions go on) rather than letting its backlog grow or stall the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from duplex.errors import CapacityError, DuplexError, ErrorCode, FencedError, WorkerErrorCode
from worker_service.engine_types import OwnerStep, Update
from worker_service.metrics import OWNER_CUTOFFS, OWNER_STREAMS, QUEUE_DEPTH

logger = logging.getLogger(__name__)


class OwnerChannel:
    """A bounded queue of one owner's StepOutputs, closed with or without an error."""

    def __init__(self, owner: str, maxsize: int) -> None:
        self.owner = owner
        self._maxsize = maxsize
        self._items: deque[OwnerStep] = deque()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._error: DuplexError | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, item: OwnerStep) -> bool:
        """Queue an item; False when the channel is full (the caller decides)."""
        if self._closed:
            return True
        if len(self._items) >= self._maxsize:
            return False
        self._items.append(item)
        self._wakeup.set()
        return True

    def close(self, error: DuplexError | None = None) -> None:
        """End the channel: with ``error`` at once (queued items dropped), without after draining."""
        if self._closed:
            return
        self._closed = True
        self._error = error
        if error is not None:
            self._items.clear()
        self._wakeup.set()

    async def get(self) -> OwnerStep | None:
        """The next item; None once closed and drained; raises the close error."""
        while True:
            if self._error is not None:
                raise self._error
            if self._items:
                return self._items.popleft()
            if self._closed:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()


class OutputHub:
    """The open Run streams, one channel per owner."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int) -> None:
        self._loop = loop
        self._maxsize = maxsize
        self._channels: dict[str, OwnerChannel] = {}

    def open(self, owner: str) -> OwnerChannel:
        """A channel for a new Run stream of ``owner``; an older stream of the owner is ended."""
        old = self._channels.get(owner)
        if old is not None:
            old.close(FencedError(ErrorCode.FENCED, "superseded by a newer Run stream of the same owner"))
        channel = self._channels[owner] = OwnerChannel(owner, self._maxsize)
        OWNER_STREAMS.set(len(self._channels))
        return channel

    def owners(self) -> list[str]:
        """The owners with an open Run stream."""
        return list(self._channels)

    def has(self, owner: str) -> bool:
        """Whether ``owner`` has an open Run stream."""
        return owner in self._channels

    def discard(self, channel: OwnerChannel) -> None:
        if self._channels.get(channel.owner) is channel:
            del self._channels[channel.owner]
            OWNER_STREAMS.set(len(self._channels))
        channel.close()

    def sink(self, items: list[tuple[str, OwnerStep]]) -> None:
        """The engine's sink: runs on the engine thread, never blocks."""
        self._loop.call_soon_threadsafe(self.deliver, items)

    def deliver(self, items: list[tuple[str, OwnerStep]]) -> None:
        """Append results to their owners' channels (event loop)."""
        for owner, item in items:
            channel = self._channels.get(owner)
            if channel is None:
                continue  # the owner has no stream now; its sessions' output has nowhere to go
            if not channel.push(item):
                logger.warning("owner %r fell %d steps behind: ending its stream", owner, self._maxsize)
                OWNER_CUTOFFS.inc()
                channel.close(CapacityError(WorkerErrorCode.CAPACITY, "the owner's output queue is full"))
                self.discard(channel)
        QUEUE_DEPTH.labels(queue="output").set(sum(len(c) for c in self._channels.values()))

    def send_updates(self, owner: str, updates: list[Update]) -> None:
        """Update-only news from command handling (rejections) as a ``step=0`` item."""
        if updates:
            self.deliver([(owner, OwnerStep(step=0, updates=updates))])

    def close_all(self, error: DuplexError | None = None) -> None:
        for channel in list(self._channels.values()):
            channel.close(error)
        self._channels.clear()
        OWNER_STREAMS.set(0)
