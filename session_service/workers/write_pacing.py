"""When a worker link writes its next ``WorkerCommand``: the write point of the worker's tick.

A link's sender coalesces every pending submission into one command. Against a worker on a frame
clock (its steps carry ``next_tick_us``) and while several sessions submit, the command waits for
the tick's write point, ahead of the tick: the sessions' frames of a tick travel in one command,
not one each. Without a clock it waits ``coalesce_s``. A lone session is never held back, and an
abort (a barge-in) cuts the wait short (``cut_short``).

**One command per tick, its lead learnt.** A worker that says in each step how many of the
stream's commands it had (``StepOutput.commands_applied``) tells the link whether each command
made the tick it was written for. The link then writes once a tick, ``lead`` ahead of it, and
adapts the lead: a miss widens it by ``LEAD_MISS``, a command that made it narrows it by
``LEAD_MADE``, so about one command in ``LEAD_MISS / LEAD_MADE`` misses, whatever the hop and
the machine's load. A miss is cheap: the worker steps the late frames at once, just after the
tick (a late join), not a period later; so the lead stays short, and the frames that come
between the write and the tick (and wait for the next one) few. Control submissions
(COMMIT, RESPOND, CLEAR) join the tick's command: applied ahead of the tick, a reply computed
meanwhile still starts at that tick. A worker that does not say (an older one) gets the fixed
``TICK_LEAD`` and ``WRITES_PER_TICK`` commands a tick, control submissions at once.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

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

#: One command per tick (a worker that says ``commands_applied``): the lead, a fraction of the
#: frame period, at first, at least and at most; widened by ``LEAD_MISS`` on each miss and
#: narrowed by ``LEAD_MADE`` on each command that made its tick.
LEAD_START = 0.25
LEAD_MIN = 0.08
LEAD_MAX = 0.6
LEAD_MISS = 0.05
LEAD_MADE = 0.0025

#: Commands written for a tick and not yet judged (no step of that tick came: none of the
#: link's sessions stepped in it) are forgotten beyond this many.
TARGETS_KEPT = 64


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
        self.told = False
        """The worker says ``commands_applied``: one command per tick, with a learnt lead."""
        self.lead = LEAD_START
        """One command per tick: how far ahead of the tick it is written (of the period)."""
        self.commands = 0
        """Commands written on the stream (its first counts 1), as the worker counts them."""
        self._targets: deque[tuple[int, float]] = deque(maxlen=TARGETS_KEPT)
        """(command number, its tick) of commands written for a tick, not yet judged."""
        self._nap: asyncio.Future[None] | None = None

    def submitted(self, session_id: str) -> None:
        """A session submitted (counted only where waiting is on at all)."""
        if self.coalesce_s > 0:
            self.senders.add(session_id)

    def heard_tick(self, next_tick_us: int, commands_applied: int = 0) -> tuple[int, int]:
        """A step announced the worker's next tick, ``next_tick_us`` from now, and how many of
        the stream's commands it had when it began. Returns how many commands written for
        this step's tick (or an earlier one) made it and how many missed it; the lead adapts."""
        self.tick_at = asyncio.get_running_loop().time() + next_tick_us / 1e6
        if not commands_applied:
            return 0, 0
        self.told = True
        made = missed = 0
        targets = self._targets
        # This step's tick is a period before the next; half a period of slack for the error of
        # projecting the worker's clock onto this loop's.
        judged_until = self.tick_at - self.period / 2
        while targets and targets[0][1] <= judged_until:
            number, _ = targets.popleft()
            if commands_applied >= number:
                made += 1
            else:
                missed += 1
        if missed:
            self.lead = min(LEAD_MAX, self.lead + missed * LEAD_MISS)
        elif made:
            self.lead = max(LEAD_MIN, self.lead - made * LEAD_MADE)
        return made, missed

    def new_stream(self) -> None:
        """A new stream (maybe a restarted, or older, worker): its clock is not known yet, and
        its first command was written."""
        self.tick_at = 0.0
        self.told = False
        self.commands = 1
        self._targets.clear()

    def wrote(self, tick: float = 0.0) -> None:
        """The sender wrote a command, for ``tick`` (what ``until_write_point`` returned; 0: it
        was for no tick in particular)."""
        self.commands += 1
        if tick:
            self._targets.append((self.commands, tick))

    @property
    def control_waits(self) -> bool:
        """Control submissions join the tick's one command rather than cut the wait short."""
        return self.told

    def cut_short(self) -> None:
        """Write now: an abort (a barge-in), or a control submission against a worker that does
        not say ``commands_applied``, does not wait for the tick."""
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

    async def until_write_point(self) -> tuple[float, bool]:
        """Wait until the command may be written: the lead before the worker's next tick or
        the middle of the period before it (projected from the last tick it announced), or
        ``coalesce_s`` without a clock; ``cut_short`` ends the wait. Returns the tick the
        command is for where the worker says ``commands_applied`` (for ``wrote``; else 0), and
        whether the point was a mid-tick one (the sender writes there only what cannot wait)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        delay = self.coalesce_s
        target, mid = 0.0, False
        if self.tick_at and self.period:
            half = self.period / WRITES_PER_TICK
            announced = self.tick_at
            if self.told and announced - half >= now:
                announced -= half  # the mid-tick point before the announced tick is ahead too
            point = next_tick(now, announced, half, self.written_for)
            self.written_for = point
            if self.told:
                # The tick the point is, or the one after it (a point mid-period).
                ticks = math.ceil((point - self.tick_at) / self.period - 1e-6)
                target = self.tick_at + ticks * self.period
                mid = target - point > self.period / 4
                delay = point - self.lead * self.period - now
            else:
                delay = point - TICK_LEAD * self.period - now
        if delay <= 0:
            return target, mid
        nap = self._nap = loop.create_future()
        timer = loop.call_later(delay, _wake, nap)
        try:
            await nap
        finally:
            timer.cancel()
            self._nap = None
        return target, mid
