"""Time as the services see it: one small interface, so timers can be driven by tests.

Everything that measures or waits (idle timeouts, silence continuation, latency metrics,
worker liveness) takes a ``Clock``; production code uses ``MONOTONIC``. A test passes a
manual clock it advances itself, so no test depends on how fast a shared machine is.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = ["MONOTONIC", "Clock", "MonotonicClock"]


class Clock(Protocol):
    """Monotonic seconds, and waiting on them."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[object]:
        """Like ``asyncio.timeout``: the block is cancelled and ``TimeoutError`` raised once
        ``seconds`` have passed on this clock."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` (the event loop's own time base)."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds)


MONOTONIC: Clock = MonotonicClock()
