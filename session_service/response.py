"""The active response: what a runner knows of the reply it is streaming, and how it ends.

A response exists from ``response_started`` to its ``response_done`` and nowhere else: the
runner holds at most one ``ActiveResponse``, and ``ActiveResponse.done`` is the one place a
``response_done`` is built. A lockstep model (one reply frame per input frame, e.g. parrot)
would stall without client audio, so a response of one carries a ``SilenceFeeder`` that asks
the runner for a silence frame at real-time deadlines while the client sends nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from duplex.clock import Clock
from duplex.v1 import session_pb2
from session_service.plugin import ResponseProjection


class SilenceFeeder:
    """Real-time silence for a lockstep model while its response runs without client audio.

    Deadline-aligned (no drift from sleep overshoot; after a stall it re-aligns instead of
    bursting), skipped while real input flows (``last_input`` within a frame period), bounded
    (``max_frames`` per response). It only asks (``request``: returns False when the request
    could not be queued); the runner decides, in order with the client's events, whether the
    frame is still wanted and calls ``fed`` once it was handed on.
    """

    def __init__(
        self,
        *,
        period_s: float,
        max_frames: int,
        clock: Clock,
        last_input: Callable[[], float | None],
        request: Callable[[], bool],
    ) -> None:
        self._period = period_s
        self._max_frames = max_frames
        self._clock = clock
        self._last_input = last_input
        self._request = request
        self.frames = 0
        """Silence frames handed on in this response."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="silence-feeder")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def fed(self) -> None:
        self.frames += 1

    async def _run(self) -> None:
        period, clock = self._period, self._clock
        deadline = clock.now() + period
        while self.frames < self._max_frames:
            await clock.sleep(max(0.0, deadline - clock.now()))
            if self.frames >= self._max_frames:
                return
            now = clock.now()
            last = self._last_input()
            if last is None or now - last >= period:
                self._request()
            deadline += period
            if deadline < now:  # fell behind: re-align instead of bursting
                deadline = now + period


@dataclass(slots=True, eq=False)
class ActiveResponse:
    """One response from ``response_started`` to ``response_done``."""

    response_id: str
    turn_id: int
    """The turn it answers: output of another turn is not its own."""
    epoch: int
    """The epoch it runs in: a cancel ends it."""
    proj: ResponseProjection
    """The data plane's state for it (output conversion, audio position, text)."""
    started_at: float
    """Clock time of the commit / turn end it answers (for the first-audio latency)."""
    first_audio: bool = False
    """Whether audio of it was sent yet."""
    feeder: SilenceFeeder | None = None
    """Silence continuation, for a lockstep model."""

    def started(self) -> session_pb2.ResponseStarted:
        return session_pb2.ResponseStarted(
            response_id=self.response_id, turn_id=self.turn_id, epoch=self.epoch
        )

    def done(self, status: session_pb2.ResponseStatus.ValueType, reason: str) -> session_pb2.ResponseDone:
        """The ``response_done`` that ends it (the only place one is built)."""
        return session_pb2.ResponseDone(
            response_id=self.response_id,
            turn_id=self.turn_id,
            status=status,
            reason=reason,
            audio_ms=self.proj.audio_ms,
        )

    def stop(self) -> None:
        """It ended: stop feeding silence."""
        if self.feeder is not None:
            self.feeder.stop()
