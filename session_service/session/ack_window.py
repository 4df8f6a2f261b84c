"""Input acks with backpressure: which appends may be acknowledged now.

An ``input_ack`` names the highest client ``seq`` handed on to the worker. While more than a
bound of handed-on audio is not yet consumed by the worker (``RequestUpdate.input_seq``), acks
are held and released as the worker catches up, so a client that waits for acks never overruns
the worker's per-request input queue. A new epoch, a lost or replaced worker, or a rejected
submission resets the window: nothing handed on is awaited any more and held acks go out.

A stream whose client reads acks carried on output (``acks_on_output``) is held stricter:
each append's ack waits until the worker has consumed it (``until_consumed``), so it goes out
with the step's news, riding on the output that step made.

The window is pure bookkeeping: every method returns the acks that may be sent now (in order)
and emits nothing itself; the runner sends them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Ack", "AckWindow"]


@dataclass(frozen=True, slots=True)
class Ack:
    """One ``input_ack`` to send."""

    seq: int
    """The highest client seq it acknowledges."""
    epoch: int
    """The epoch the appends it covers were made in."""
    received: tuple[float, ...]
    """When each append it covers was received (monotonic; for the ack latency metric)."""


_NONE: tuple[Ack, ...] = ()


class AckWindow:
    """The appends handed on but not consumed, and the acks held back because of them."""

    def __init__(self, *, hold_ms: int, frame_ms: float) -> None:
        """``hold_ms``: hold acks while more than this much audio is unconsumed (0 = never
        hold); ``frame_ms``: the duration of one worker frame."""
        self.bound = max(1, math.ceil(hold_ms / frame_ms)) if hold_ms > 0 else 0
        """Unconsumed worker frames beyond which acks are held (0 = never)."""
        self._sent = 0
        self._consumed = 0
        self._inflight: deque[tuple[int, int]] = deque()
        """(worker seq, ``_sent`` once it was handed on) of APPENDs not yet consumed."""
        self._held: deque[tuple[int, int, float, int]] = deque()
        """(client seq, epoch, received, ``_sent`` when it was acked) of appends handed on whose
        acks wait."""
        self.until_consumed = False
        """Hold every ack until the worker consumed the append it covers (``until_consumed``)."""

    @property
    def unconsumed(self) -> int:
        """Worker frames handed on that the worker has not reported consumed."""
        return self._sent - self._consumed

    @property
    def held(self) -> int:
        """Appends whose acks are held back."""
        return len(self._held)

    def handed_on(self, worker_seq: int, frames: int) -> None:
        """An APPEND of ``frames`` worker frames was written under ``worker_seq``."""
        self._sent += frames
        self._inflight.append((worker_seq, self._sent))

    def ack(self, seq: int, epoch: int, received: float) -> tuple[Ack, ...]:
        """The append ``seq`` was handed on: its ack, or nothing while the worker is behind.

        Acks never overtake each other: once one is held, later ones are held behind it."""
        unconsumed = self._sent - self._consumed
        if self._held or (self.bound and unconsumed > self.bound) or (self.until_consumed and unconsumed):
            self._held.append((seq, epoch, received, self._sent))
            return _NONE
        return (Ack(seq, epoch, (received,)),)

    def consumed(self, worker_seq: int) -> tuple[Ack, ...]:
        """The worker consumed every APPEND up to ``worker_seq`` (of the current epoch)."""
        inflight = self._inflight
        while inflight and inflight[0][0] <= worker_seq:
            self._consumed = inflight.popleft()[1]
        held = self._held
        if not held:
            return _NONE
        if self.until_consumed:
            # The acks of the appends consumed by now, in order (a later one waits behind).
            n = 0
            for entry in held:
                if entry[3] > self._consumed:
                    break
                n += 1
            return self._release(n)
        if self._sent - self._consumed <= self.bound:
            return self._release()
        return _NONE

    def hold_until_consumed(self, on: bool) -> tuple[Ack, ...]:
        """Switch ``until_consumed``; the acks that may go out now under the new rule."""
        self.until_consumed = on
        if on or not self._held or (self.bound and self._sent - self._consumed > self.bound):
            return _NONE
        return self._release()

    def reset(self) -> tuple[Ack, ...]:
        """The worker's input position starts over (new epoch, worker lost or replaced, input
        rejected): nothing handed on is awaited any more, and held acks go out (their appends
        were handed on; what became of them the client learns from the event that caused this)."""
        self._inflight.clear()
        self._sent = self._consumed = 0
        return self._release()

    def _release(self, n: int | None = None) -> tuple[Ack, ...]:
        """The first ``n`` held acks (all: None), one per epoch, carrying that epoch's highest seq."""
        held = self._held
        if n is None:
            n = len(held)
        if not n:
            return _NONE
        out: list[Ack] = []
        seq, epoch = 0, held[0][1]
        received: list[float] = []
        for _ in range(n):
            s, e, r, _mark = held.popleft()
            if e != epoch:
                out.append(Ack(seq, epoch, tuple(received)))
                received = []
            seq, epoch = s, e
            received.append(r)
        out.append(Ack(seq, epoch, tuple(received)))
        return tuple(out)
