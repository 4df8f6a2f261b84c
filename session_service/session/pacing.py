"""How a response's audio reaches its client against real time: late frames and jitter.

A client plays a response's audio at real time from its first frame on, so frame ``k`` (at
``offset_ms`` into the response) is due ``offset_ms`` after the first one went out. When a tick
overran, a hop stalled or the worker fell behind, frames go out after that: they are counted
late (beyond a frame period: a client's jitter buffer holds about that much) and by how much
(``duplex_session_output_lateness_seconds``). The jitter is how far the time between two
consecutive audio events of a response strays from the audio the first of them held
(``duplex_session_output_jitter_seconds``). Measured as the client's stream takes each audio
event (``outbound``): what this replica sends, not what the network then does with it.
"""

from __future__ import annotations

from duplex.v1 import session_pb2
from session_service.metrics import OUTPUT_FRAMES_LATE, OUTPUT_JITTER, OUTPUT_LATENESS

#: A frame that goes out within this of its time is on time (clock reads and float sums differ).
ON_TIME_S = 0.001


class OutputPacing:
    """The pacing of one session's audio as its stream takes it (O(1) per audio event)."""

    __slots__ = ("_first", "_last", "_late_s", "_response")

    def __init__(self, late_s: float) -> None:
        self._late_s = late_s
        """Beyond this much after its due time a frame counts as late."""
        self._response = ""
        self._first = (0.0, 0)
        """When the response's first audio went out, and its offset (ms)."""
        self._last = (0.0, 0.0)
        """When the previous audio event went out, and its duration (s)."""

    def taken(self, delta: session_pb2.AudioDelta, duration_s: float, now: float) -> None:
        """``delta`` (of ``duration_s`` seconds of audio) went out to the client at ``now``."""
        if delta.response_id != self._response:
            self._response = delta.response_id
            self._first = (now, delta.offset_ms)
            self._last = (now, duration_s)
            return
        first_at, first_ms = self._first
        lateness = now - first_at - (delta.offset_ms - first_ms) / 1000.0
        if lateness > ON_TIME_S:
            OUTPUT_LATENESS.observe(lateness)
            if lateness > self._late_s:
                OUTPUT_FRAMES_LATE.inc()
        last_at, last_s = self._last
        OUTPUT_JITTER.observe(abs(now - last_at - last_s))
        self._last = (now, duration_s)
