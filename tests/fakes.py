"""Test doubles of one unit's collaborators: a clock that moves only when a test says so."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from types import TracebackType


class ManualClock:
    """A ``duplex.clock.Clock`` whose time moves only with ``advance``.

    Sleeps and timeouts wait for the test to advance past their deadline, so timer behaviour
    (idle timeouts, silence continuation) is tested without waiting and without depending on
    how fast a shared machine runs the test.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._timeouts: list[_ManualTimeout] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + seconds, next(self._seq), fut))
        await fut

    def timeout(self, seconds: float) -> _ManualTimeout:
        return _ManualTimeout(self, self.t + seconds)

    async def advance(self, seconds: float, *, step: float | None = None) -> None:
        """Move time forward (in increments of ``step``, letting woken tasks run after each)."""
        end = self.t + seconds
        while True:
            self.t = min(end, self.t + step) if step else end
            while self._sleepers and self._sleepers[0][0] <= self.t:
                _, _, fut = heapq.heappop(self._sleepers)
                if not fut.done():
                    fut.set_result(None)
            for timeout in [t for t in self._timeouts if t.deadline <= self.t]:
                timeout.expire()
            for _ in range(20):  # let what woke up run (and queue what it queues)
                await asyncio.sleep(0)
            if self.t >= end:
                return


class _ManualTimeout:
    """``asyncio.timeout`` on a ``ManualClock``: the real ``asyncio.Timeout`` does the
    cancelling; this only tells it when."""

    def __init__(self, clock: ManualClock, deadline: float) -> None:
        self._clock = clock
        self.deadline = deadline
        self._inner = asyncio.timeout(None)

    async def __aenter__(self) -> _ManualTimeout:
        await self._inner.__aenter__()
        self._clock._timeouts.append(self)
        if self.deadline <= self._clock.t:
            self.expire()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._clock._timeouts.remove(self)
        return await self._inner.__aexit__(exc_type, exc, tb)

    def expire(self) -> None:
        self._inner.reschedule(asyncio.get_running_loop().time())
