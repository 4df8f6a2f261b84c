"""The active response: what a runner knows of the reply it is streaming, and how it ends.

A response exists from ``response_started`` to its ``response_done`` and nowhere else: the
runner holds at most one ``ActiveResponse``, and ``ActiveResponse.done`` is the one place a
``response_done`` is built. A lockstep model (one reply frame per input frame, e.g. parrot)
would stall without client audio, so a response of one carries a ``SilenceFeeder`` that asks
the runner for a silence frame at real-time deadlines while the client has fallen behind real
time (``InputTimeline``), and never while it keeps up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplex.clock import Clock
from duplex.v1 import session_pb2
from session_service.plugin import ResponseProjection
from session_service.session.replay import Marker

#: The least a client may fall behind real time before silence is fed in its place.
MIN_ALLOWANCE_S = 0.1


class InputTimeline:
    """How far a session's input (the client's audio and fed silence) covers wall-clock time.

    A client streaming at real time moves ``covered`` by each append's duration as the appends
    arrive, so ``now - covered`` stays within about one append. It has fallen behind when the
    gap passes the jitter allowance: two of its appends (the last one's size), never less than
    ``MIN_ALLOWANCE_S``. Only then is silence due; fed silence moves ``covered`` a frame at a
    time from at most the allowance behind, so a client that was quiet for long gets real-time
    silence from now on, not a burst that catches up.

    An append covers at least up to the moment it arrived: a client that was behind (it started
    streaming after the session opened, it paused, the network held it up) is current again
    with its next append. Else the gap it left would stay: every later append would leave the
    timeline at the edge of the allowance, the feeder would look at every frame, and jitter
    would slip silence frames in between live audio.
    """

    def __init__(self, now: float) -> None:
        self.covered = now
        """Wall-clock time up to which input has been received (or fed)."""
        self.allowance = MIN_ALLOWANCE_S
        """How far behind the client may fall before silence is due."""

    def client(self, seconds: float, received: float) -> None:
        """The client appended ``seconds`` of audio, which arrived at ``received``."""
        self.covered = max(self.covered + seconds, received)
        self.allowance = max(MIN_ALLOWANCE_S, 2 * seconds)

    def silence_due(self, now: float, frame_s: float) -> bool:
        """Whether the input has fallen behind by the allowance. Half a frame of slack keeps a
        feeder that ticks a little early from skipping a frame."""
        return self.silence_due_in(now, frame_s) <= 0

    def silence_due_in(self, now: float, frame_s: float) -> float:
        """Seconds until silence is due (0 or less: due now; see ``silence_due``)."""
        return self.covered + self.allowance - frame_s / 2 - now

    def silence(self, now: float, frame_s: float) -> None:
        """A frame of silence was fed."""
        self.covered = max(self.covered, now - self.allowance) + frame_s


class SilenceFeeder:
    """Real-time silence for a lockstep model while its response runs and the client has
    fallen behind real time.

    Asks only when the session's ``InputTimeline`` says the client fell behind (``due_in()``:
    seconds until it will have, if no more input comes). While the client streams it sleeps
    until that moment (which each append moves on), so a client keeping real time costs no
    wake-up per frame; once silence is due it ticks deadline-aligned each period (no drift from
    sleep overshoot; after a stall it re-aligns instead of bursting), bounded (``max_frames``
    per response). It only asks (``request``: returns False
    when the request could not be queued); the runner decides, in order with the client's
    events, whether the frame is still wanted and calls ``fed`` once it was handed on.
    """

    def __init__(
        self,
        *,
        period_s: float,
        max_frames: int,
        clock: Clock,
        due_in: Callable[[], float],
        request: Callable[[], bool],
    ) -> None:
        self._period = period_s
        self._max_frames = max_frames
        self._clock = clock
        self._due_in = due_in
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
            wait = self._due_in()
            if wait > 0:
                # The client kept up: look again when it would have fallen behind, or sooner, since
                # smaller appends after a large one shrink the allowance (and so bring the moment
                # forward) while this sleeps.
                deadline = now + min(wait, MIN_ALLOWANCE_S)
                continue
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
    params: dict[str, Any] | None = None
    """Its per-response model options (``response_create.extra_body``), for a restart."""
    mark: Marker | None = None
    """The commit point of the input it answers in the session's replay log (None: none kept)."""
    restart: bool = False
    """It restarts the reply of a turn whose worker was lost: it has ``restart_timeout_s`` from
    its start to send audio (``started_at`` is then its start)."""
    native: bool = False
    """A speech span a model-native model started itself: its output carries the fences of the
    input that clocked it (any turn), so only its epoch fences it; spans come one after another."""

    def started(self) -> session_pb2.ResponseStarted:
        return session_pb2.ResponseStarted(
            response_id=self.response_id, turn_id=self.turn_id, epoch=self.epoch
        )

    def done(
        self, status: session_pb2.ResponseStatus.ValueType, reason: str, *, restarting: bool = False
    ) -> session_pb2.ResponseDone:
        """The ``response_done`` that ends it (the only place one is built); ``restarting``: its
        turn's reply starts again as another response (its worker was lost)."""
        return session_pb2.ResponseDone(
            response_id=self.response_id,
            turn_id=self.turn_id,
            status=status,
            reason=reason,
            audio_ms=self.proj.audio_ms,
            restarting=restarting,
        )

    def stop(self) -> None:
        """It ended: stop feeding silence."""
        if self.feeder is not None:
            self.feeder.stop()
