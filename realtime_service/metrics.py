"""The edge's Prometheus metrics (``duplex_realtime_*``), on its own ``/metrics`` port.

Labels are bounded: event types are the API's (or ``invalid``), codes the session service's
stable codes, refusals a fixed set of reasons.
"""

from __future__ import annotations

# Counter names omit `_total`: prometheus_client appends it.
from functools import cache

from prometheus_client import Counter, Gauge, Histogram

CONNECTIONS = Gauge("duplex_realtime_connections", "WebSocket connections held now")
CONNECTIONS_TOTAL = Counter("duplex_realtime_connections_accepted", "WebSocket connections accepted")
REFUSED = Counter(
    "duplex_realtime_refused",
    "Upgrade requests refused before a WebSocket was opened, by reason",
    ["reason"],
)
SESSIONS_REFUSED = Counter(
    "duplex_realtime_sessions_refused",
    "Connections whose session the session service would not open, by its code",
    ["code"],
)
SESSIONS_LOST = Counter(
    "duplex_realtime_sessions_lost",
    "Connections whose session failed and could not be resumed, by code",
    ["code"],
)
RESUMES = Counter(
    "duplex_realtime_resumes",
    "Resumes after the stream to the session service dropped, by outcome",
    ["outcome"],
)
CLIENT_EVENTS = Counter("duplex_realtime_client_events", "Client events received, by command", ["type"])
SERVER_EVENTS = Counter("duplex_realtime_server_events", "Server events queued, by type", ["type"])
AUDIO_DROPPED = Counter(
    "duplex_realtime_cancelled_audio_dropped",
    "Audio deltas of a cancelled response dropped before they were written",
)
SLOW_CONSUMERS = Counter(
    "duplex_realtime_slow_consumers", "Connections cut off because the client did not read its output"
)
IDLE_CLOSES = Counter("duplex_realtime_idle_closes", "Connections closed after the idle timeout")
STREAMS = Gauge("duplex_realtime_upstream_streams", "ConverseMany streams held to the session service")


@cache
def server_event(kind: str) -> Counter:
    """``SERVER_EVENTS`` of one event type, bound once (an audio delta is counted per frame; the
    types are the edge's own, a bounded set)."""
    return SERVER_EVENTS.labels(type=kind)


# ---- WebRTC calls (``POST /v1/realtime/calls``) ----------------------------------------------

CALLS = Gauge("duplex_realtime_calls", "WebRTC calls held now")
CALLS_ACCEPTED = Counter("duplex_realtime_calls_accepted", "WebRTC calls answered (201, an SDP answer)")
CALLS_REFUSED = Counter(
    "duplex_realtime_calls_refused", "WebRTC call requests refused before an answer, by reason", ["reason"]
)
CALLS_ENDED = Counter("duplex_realtime_calls_ended", "WebRTC calls ended, by reason", ["reason"])
WEBRTC_FAILURES = Counter(
    "duplex_realtime_webrtc_failures",
    "Calls whose ICE or DTLS did not complete within --webrtc-connect-timeout-s, by stage",
    ["stage"],
)
PACKETS_RECEIVED = Counter(
    "duplex_realtime_webrtc_packets_received", "RTP packets of browsers' audio received"
)
PACKETS_LOST = Counter(
    "duplex_realtime_webrtc_packets_lost",
    "RTP packets of browsers' audio lost on the way (as the edge counts)",
)
JITTER = Histogram(
    "duplex_realtime_webrtc_jitter_seconds",
    "Interarrival jitter of browsers' audio as the edge sees it, sampled once a second per call",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5),
)
PLAYOUT_UNDERRUNS = Counter(
    "duplex_realtime_webrtc_playout_underruns",
    "20 ms frames of a reply played partly silent because its audio came late",
)
INPUT_DROPPED = Counter(
    "duplex_realtime_webrtc_input_dropped",
    "Microphone frames dropped because the session was too far behind to take them",
)
CLIENT_SECRETS = Counter(
    "duplex_realtime_client_secrets", "Client secrets minted, used and refused, by outcome", ["outcome"]
)
