"""How a response's audio reaches its client against real time (``session.pacing``): frames late
beyond a frame period are counted and by how much, and the jitter between audio events."""

from __future__ import annotations

from duplex.v1 import session_pb2
from session_service.session.pacing import OutputPacing
from tests.session_helpers import sample, sample_sum

LATE = "duplex_session_output_frames_late_total"
JITTER = "duplex_session_output_jitter_seconds_count"
LATENESS = "duplex_session_output_lateness_seconds_sum"


def delta(response: str, offset_ms: int) -> session_pb2.AudioDelta:
    return session_pb2.AudioDelta(response_id=response, offset_ms=offset_ms)


def test_frames_that_go_out_behind_real_time_are_counted_late_and_by_how_much() -> None:
    pacing = OutputPacing(late_s=0.08)
    late0, lateness0, jitter0 = sample(LATE), sample_sum(LATENESS), sample(JITTER)
    # On time: one 80 ms frame every 80 ms from the first.
    for k in range(5):
        pacing.taken(delta("r1", 80 * k), 0.08, 10.0 + 0.08 * k)
    assert sample(LATE) == late0 and sample_sum(LATENESS) == lateness0
    # A stall of 300 ms: the next frame is 300 ms late, the ones after it too.
    pacing.taken(delta("r1", 400), 0.08, 10.0 + 0.4 + 0.3)
    pacing.taken(delta("r1", 480), 0.08, 10.0 + 0.48 + 0.3)
    assert sample(LATE) == late0 + 2
    assert abs(sample_sum(LATENESS) - lateness0 - 0.6) < 1e-6
    # A new response is measured from its own first frame.
    pacing.taken(delta("r2", 0), 0.08, 20.0)
    pacing.taken(delta("r2", 80), 0.08, 20.1)  # 20 ms late: jitter, not late
    assert sample(LATE) == late0 + 2
    assert sample(JITTER) == jitter0 + 7  # every event but each response's first
