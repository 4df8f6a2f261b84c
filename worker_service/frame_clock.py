"""The engine's frame clock: one tick per frame period of the model steps every runnable request.

A layer of ``worker_service.engine.Engine`` (its base class): the tick itself, the catch-up of
requests behind, and late joins. A request the tick did not step whose input comes within
``LATE_JOIN`` of a period after the tick began (the owner's command for the tick came late: a
busy machine, a slow hop) is stepped at once rather than a whole period later; the owner's link
counts that command as late all the same (``StepOutput.commands_applied``) and writes the next
ones earlier. Each step's output says when the next tick is and how many of the owner's commands
the step had (``_stamp``). Only the engine thread runs this.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Final

from worker_service import metrics
from worker_service.engine_types import CommandMarks, OwnerStep, Update
from worker_service.model import StepModel
from worker_service.step_outputs import Request

#: Frame clock: most extra steps in one tick for requests more than one frame behind (so a
#: client sending up to this many times faster than real time is still consumed as it sends).
CATCH_UP_STEPS: Final = 64
#: Frame clock: catching up stops once the tick has used this share of its frame period (the
#: next tick must start on time for everyone).
CATCH_UP_BUDGET: Final = 0.5
#: Frame clock: a request with at least this many input frames left after the tick's step is
#: behind (one left is the jitter of arrivals around the tick, caught up as it comes).
CATCH_UP_BACKLOG: Final = 2
#: Frame clock: input of requests the tick did not step that arrives within this share of the
#: period after the tick began (a command written for the tick that came late) is stepped at
#: once, as a late join, rather than a whole period later.
LATE_JOIN: Final = 0.25
#: Frame clock: the weight of the newest tick in the moving average of the tick load.
LOAD_SMOOTHING: Final = 0.1


class FrameClock:
    """The frame clock's part of the engine thread's work (state declared here, set by it)."""

    _period: float
    _next_step_at: float
    _tick_no: int
    _late_until: float
    _max_batch: int
    _runnable: OrderedDict[str, Request]
    _marks: CommandMarks
    tick_load: float
    """The share of a frame period one tick's step of every session takes (a moving average;
    0 before the first tick). Read on the asyncio side (admission): a float, set whole."""

    def _step(
        self, model: StepModel[Any], news: dict[str, list[Update]], chosen: list[Request]
    ) -> list[tuple[str, OwnerStep]]:
        raise NotImplementedError  # the engine's batched step

    def _tick(self, model: StepModel[Any], news: dict[str, list[Update]]) -> list[tuple[str, OwnerStep]]:
        """One tick of the frame clock: every runnable request steps once, then those behind
        catch up together (see the engine's module docstring)."""
        now = time.monotonic()
        due = self._next_step_at
        # On time (or a little late): the next tick one period after this one was due, so the
        # clock keeps its phase. Idle or far behind: it starts again from now.
        self._next_step_at = due + self._period if now - due < self._period else now + self._period
        self._tick_no += 1
        self._late_until = now + LATE_JOIN * self._period
        out = self._step_all(model, news, list(self._runnable.values()))
        stepped = time.monotonic()
        self._measure(now, stepped, late=stepped > self._next_step_at)
        budget_end = now + CATCH_UP_BUDGET * self._period
        for _ in range(CATCH_UP_STEPS):
            queued = [(r, r.input_frames()) for r in self._runnable.values()]
            if not any(n >= CATCH_UP_BACKLOG for _, n in queued):
                break
            behind = [r for r, n in queued if n]
            if time.monotonic() >= budget_end:
                break
            out.extend(self._step_all(model, news, behind))
        metrics.TICK_DURATION.observe(time.monotonic() - now)
        return self._stamp(out)

    def _measure(self, began: float, stepped: float, *, late: bool) -> None:
        """A tick's step of every runnable request took ``stepped - began``: its load (a moving
        average of that over the period, what admission reads) and whether it missed its deadline."""
        load = (stepped - began) / self._period
        self.tick_load = (
            load if not self.tick_load else self.tick_load + LOAD_SMOOTHING * (load - self.tick_load)
        )
        metrics.TICK_LOAD.set(self.tick_load)
        if late:
            metrics.TICKS_LATE.inc()

    def _late_join(self, model: StepModel[Any], news: dict[str, list[Update]]) -> list[tuple[str, OwnerStep]]:
        """Step the requests with input that the last tick did not step (their input came
        after it began, shortly: a command late for it), once each; the tick's own stay put."""
        late = [r for r in self._runnable.values() if r.tick != self._tick_no and r.input_frames()]
        if not late:
            return []
        metrics.LATE_JOINS.inc(len(late))
        return self._stamp(self._step_all(model, news, late))

    def _stamp(self, out: list[tuple[str, OwnerStep]]) -> list[tuple[str, OwnerStep]]:
        for owner, item in out:
            item.next_tick_at, item.commands_applied = self._next_step_at, self._marks.count(owner)
        return out

    def _step_all(
        self, model: StepModel[Any], news: dict[str, list[Update]], reqs: list[Request]
    ) -> list[tuple[str, OwnerStep]]:
        """Step ``reqs`` in batches of at most ``max_batch``."""
        size = self._max_batch
        if len(reqs) <= size:
            return self._step(model, news, reqs)
        out: list[tuple[str, OwnerStep]] = []
        for i in range(0, len(reqs), size):
            out.extend(self._step(model, news, reqs[i : i + size]))
        return out
