"""Prometheus metrics of the session service (no per-session labels anywhere)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

# Counter names omit `_total`: prometheus_client appends it.
ACTIVE_SESSIONS: Final = Gauge("duplex_session_active_sessions", "Sessions held by this replica.")
EVENTS: Final = Counter(
    "duplex_session_events",
    "Session events by direction (in = from clients, out = to clients) and type.",
    ["direction", "type"],
)
ERRORS: Final = Counter("duplex_session_errors", "Errors sent to clients, by stable code.", ["code"])
DROPPED_OUTPUTS: Final = Counter(
    "duplex_session_dropped_outputs",
    "Worker outputs (audio, text, updates) not delivered to a client, by reason.",
    ["reason"],
)
FRAME_LATENCY: Final = Histogram(
    "duplex_session_frame_latency_seconds",
    "ack: client append received to input_ack sent; first_audio: commit/turn end to first reply audio.",
    ["stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
WORKER_COMMAND_SIZE: Final = Histogram(
    "duplex_session_worker_command_items",
    "Submissions, aborts and releases coalesced into one WorkerCommand.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
WORKERS_HEALTHY: Final = Gauge(
    "duplex_session_workers_healthy", "Workers with a live Run stream and the plugin's model."
)
WORKER_SESSIONS: Final = Gauge(
    "duplex_session_worker_sessions", "Sessions placed on each worker (by configured address).", ["worker"]
)
SILENCE_FRAMES: Final = Counter(
    "duplex_session_silence_frames", "Silence frames fed to keep a model turn going without client input."
)
MAILBOX_FULL: Final = Counter(
    "duplex_session_mailbox_full", "Internal events skipped because a session mailbox was full."
)

# Known label values exist from the start, so rate() alerts see a zero series.
for _reason in (
    "stale_epoch",
    "stale_turn",
    "response_cancelled",
    "unknown_request",
    "stale_worker",
    "purged",
    "fail_closed",
):
    DROPPED_OUTPUTS.labels(reason=_reason)
for _stage in ("ack", "first_audio"):
    FRAME_LATENCY.labels(stage=_stage)
