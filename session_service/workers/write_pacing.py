"""When a worker link writes its next ``WorkerCommand``: the write point of the worker's tick.

A link's sender coalesces every pending submission into one command. Against a worker on a frame
clock (its steps carry ``next_tick_us``) and while several sessions submit, the command waits for
the tick's write point, a little ahead of the tick (``TICK_LEAD``), at most ``WRITES_PER_TICK``
times a tick: the sessions' frames of a tick travel in one or two commands, not one each. Without
a clock it waits ``coalesce_s``. A lone session is never held back, and an abort or a control
submission cuts the wait short (``cut_short``).
"""

from __future__ import annotations

import asyncio
import math

#: How often the pacer looks at how many sessions submit (waiting only pays when several do).
SENDERS_LOOK_S = 0.1

#: How far ahead of the worker's next tick (a fraction of its frame period) a link writes its
#: command for the tick: room for the hop and the worker's handling of the command.
TICK_LEAD = 0.15

#: Commands written per worker tick (at most): the last TICK_LEAD before the tick, the others
#: evenly before it. More than one because a command written only TICK_LEAD ahead misses its
#: tick whenever the hop and the worker's handling of it take longer (a busy machine), and then
#: every frame in it waits a whole tick more: with one write per tick the ack p99 of 64
#: real-time sessions was 119-140 ms, with two 77-82 ms, for the same CPU (``benchmarks.tiers``).
WRITES_PER_TICK = 2


def next_tick(now: float, announced: float, period: float, written_for: float) -> float:
    """The worker tick a command written from ``now`` is for: the first one not yet past,
    projected from the ``announced`` one a period at a time, and never one a command was already
    ``written_for`` (what arrives after that write waits for the next tick)."""
    tick = announced
    if tick < now:
        tick += period * math.ceil((now - tick) / period)
    if tick - written_for < period / 2:
        tick += period
    return tick


def _wake(nap: asyncio.Future[None]) -> None:
    if not nap.done():
        nap.set_result(None)


class WritePacer:
    """The write point of one link's commands (no I/O: it only waits)."""

    def __init__(self, coalesce_s: float) -> None:
        self.coalesce_s = coalesce_s
        """How long the sender waits, once woken, for more submissions (0: write at once)."""
        self.senders: set[str] = set()
        """Sessions that submitted since ``senders_since`` (is there anyone to wait for?)."""
        self.senders_since = 0.0
        self.shared = False
        """Whether more than one session submitted in the last look (``worth_waiting``)."""
        self.tick_at = 0.0
        """Loop time of the worker's next tick as its last step said (0: no frame clock)."""
        self.period = 0.0
        """The worker's frame period in seconds (from Describe)."""
        self.written_for = 0.0
        """The tick the last command was written for (the next one waits for the tick after)."""
        self._nap: asyncio.Future[None] | None = None

    def submitted(self, session_id: str) -> None:
        """A session submitted (counted only where waiting is on at all)."""
        if self.coalesce_s > 0:
            self.senders.add(session_id)

    def heard_tick(self, next_tick_us: int) -> None:
        """A step announced the worker's next tick, ``next_tick_us`` from now."""
        self.tick_at = asyncio.get_running_loop().time() + next_tick_us / 1e6

    def new_stream(self) -> None:
        """A new stream (maybe a restarted worker): its clock is not known yet."""
        self.tick_at = 0.0

    def cut_short(self) -> None:
        """Write now: an abort (a barge-in) or a control submission does not wait for the tick."""
        if self._nap is not None:
            _wake(self._nap)

    def worth_waiting(self) -> bool:
        """Whether other sessions may join a command within the window: more than one session
        submitted in the last tenth of a second. A lone session (nobody to wait for) is written
        at once, so coalescing never slows it down."""
        if self.coalesce_s <= 0:
            return False
        now = asyncio.get_running_loop().time()
        if now - self.senders_since >= SENDERS_LOOK_S:
            self.shared = len(self.senders) > 1
            self.senders.clear()
            self.senders_since = now
        return self.shared

    async def until_write_point(self) -> None:
        """Wait until the command should be written: ``TICK_LEAD`` before the worker's next tick
        (projected from the last one it announced), or ``coalesce_s`` without a clock;
        ``cut_short`` ends the wait."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        delay = self.coalesce_s
        if self.tick_at and self.period:
            point = next_tick(now, self.tick_at, self.period / WRITES_PER_TICK, self.written_for)
            self.written_for = point
            delay = point - TICK_LEAD * self.period - now
        if delay <= 0:
            return
        nap = self._nap = loop.create_future()
        timer = loop.call_later(delay, _wake, nap)
        try:
            await nap
        finally:
            timer.cancel()
            self._nap = None
