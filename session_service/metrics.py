"""Prometheus metrics of the session service (no per-session labels anywhere)."""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

# Counter names omit `_total`: prometheus_client appends it.
ACTIVE_SESSIONS: Final = Gauge("duplex_session_active_sessions", "Sessions held by this replica.")
STREAMS: Final = Gauge(
    "duplex_session_streams", "Client calls (Converse and ConverseMany) in progress on this replica."
)
CALLS: Final = Gauge(
    "duplex_session_calls",
    "Authenticated calls in progress on this replica, opened or not (counted against "
    "--max-concurrent-rpcs and, per caller, --max-calls-per-principal).",
)
LANES: Final = Gauge(
    "duplex_session_lanes", "Lanes of ConverseMany streams on this replica (open, or opening)."
)
EVENTS: Final = Counter(
    "duplex_session_events",
    "Session events by direction (in = from clients, out = to clients) and type.",
    ["direction", "type"],
)
ERRORS: Final = Counter("duplex_session_errors", "Errors sent to clients, by stable code.", ["code"])
DROPPED_OUTPUTS: Final = Counter(
    "duplex_session_dropped_outputs",
    "Worker outputs (audio, text, updates) not delivered to a client, by reason "
    "(see session_service.session.worker_output).",
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
# Labelled by the link's address (a configured HOST:PORT, or a resolved IP:PORT): one series per
# link this replica holds (at most --max-workers); a link removed by discovery takes its series along.
WORKER_SESSIONS: Final = Gauge(
    "duplex_session_worker_sessions", "Sessions placed on each worker link (by its address).", ["worker"]
)
WORKER_TICK_COMMANDS: Final = Counter(
    "duplex_session_worker_tick_commands",
    "Commands written for a worker's tick, by whether the worker had them when that tick began "
    "(made) or not (missed: every frame in them waited a tick more). Only against a worker that "
    "says which commands its steps had (StepOutput.commands_applied).",
    ["worker", "outcome"],
)
WORKER_TICK_LEAD: Final = Gauge(
    "duplex_session_worker_tick_lead_seconds",
    "How far ahead of a worker's tick the link writes the tick's one command (widened on a miss, "
    "narrowed as commands make their ticks).",
    ["worker"],
)
WORKER_STALLS: Final = Counter(
    "duplex_session_worker_stalls",
    "Worker links dropped because the worker owed output and sent none for the stall timeout.",
    ["worker"],
)
WORKER_LINKS: Final = Gauge(
    "duplex_session_worker_links",
    "Worker links this replica holds (configured or discovered), healthy or not.",
)
RESOLUTIONS: Final = Counter(
    "duplex_session_worker_resolutions",
    "DNS resolutions of the workers' name (--workers dns:...) by result: ok, empty (no usable "
    "record: the links are kept), failed (timeout, SERVFAIL: the links are kept).",
    ["result"],
)
SILENCE_FRAMES: Final = Counter(
    "duplex_session_silence_frames", "Silence frames fed to keep a model turn going without client input."
)
MAILBOX_FULL: Final = Counter(
    "duplex_session_mailbox_full", "Internal events skipped because a session mailbox was full."
)

RELEASES_KEPT: Final = Counter(
    "duplex_session_worker_releases_kept",
    "Releases for a worker whose link was down, kept to be sent first on its next stream.",
)
RELEASES_DROPPED: Final = Counter(
    "duplex_session_worker_releases_dropped",
    "Releases for a worker whose link was down that were not kept (too many waiting); the "
    "worker's list of held sessions on the next stream releases those sessions instead.",
)
RECONCILED: Final = Counter(
    "duplex_session_reconciled_releases",
    "Sessions a worker listed as held for this replica on a new Run stream that this replica no "
    "longer held on it (closed or moved while the link was down), released there.",
)
FAILOVERS: Final = Counter(
    "duplex_session_turn_failovers",
    "Sessions moved off a lost or hung worker with their turn's input replayed on another, by "
    "result: replayed (the input is on the new worker), unavailable (no worker took it: the "
    "turn failed), not_replayable (the model cannot be replayed, or turn failover is off: the turn "
    "failed), context_reset (a model-native model's worker: the session moved on with a fresh "
    "model context).",
    ["result"],
)
REPLAYED_FRAMES: Final = Counter(
    "duplex_session_replayed_frames", "Worker frames of input replayed on a new worker after a failover."
)
RESTARTED_RESPONSES: Final = Counter(
    "duplex_session_restarted_responses",
    "Responses restarted for the same turn, by cause: worker_lost (the worker streaming it was "
    "lost), resumed (the replica streaming it was lost and the session resumed here).",
    ["cause"],
)
OUTPUT_LATENESS: Final = Histogram(
    "duplex_session_output_lateness_seconds",
    "How late a response's audio went out to its client against real time from its first frame "
    "(frames that went out on time or early are not observed).",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
)
OUTPUT_FRAMES_LATE: Final = Counter(
    "duplex_session_output_frames_late",
    "Audio events that went out to their client more than a frame period after real time (from "
    "the response's first frame on): a client's jitter buffer of a frame would have run dry.",
)
OUTPUT_JITTER: Final = Histogram(
    "duplex_session_output_jitter_seconds",
    "How far the time between two consecutive audio events of a response, as its client's stream "
    "takes them, strays from the audio the first of them held.",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
)
RESTARTS_TIMED_OUT: Final = Counter(
    "duplex_session_restarts_timed_out",
    "Restarted responses that sent no audio within --restart-timeout-s of their start and ended "
    "response_done{FAILED, worker_unavailable} (the new worker did not bring the reply back in time).",
)
EVICTIONS: Final = Counter(
    "duplex_session_evictions",
    "Sessions a resume moved off the worker their token named, which that worker was told to drop "
    "(session_service.workers.eviction), by result: evicted (taken over and released there), refused (the "
    "worker refused the takeover), cancelled (placed on that worker by this replica, or no longer "
    "held here), expired (the worker was not reachable from this replica in time), dropped (too "
    "many waiting).",
    ["result"],
)  # its results exist from the start, created with their enum (eviction.EvictionResult)
EVICTIONS_PENDING: Final = Gauge(
    "duplex_session_evictions_pending",
    "Evictions waiting for their worker to be reachable from this replica.",
)

COALESCED_ACKS: Final = Counter(
    "duplex_session_coalesced_acks",
    "input_ack events folded into an ack still queued for a client that was behind (acks are "
    "cumulative; each one folded is a message not written).",
)

CARRIED_ACKS: Final = Counter(
    "duplex_session_carried_acks",
    "Input acks carried on another event (carried_ack, for streams opened with acks_on_output) "
    "instead of an input_ack event of their own: each is a message not written.",
)

# Known label values exist from the start, so rate() alerts see a zero series (the drop
# reasons are created with their table, session_service.session.lifecycle.DropReason).
for _stage in ("ack", "first_audio"):
    FRAME_LATENCY.labels(stage=_stage)
for _result in ("ok", "empty", "failed"):
    RESOLUTIONS.labels(result=_result)
for _result in ("replayed", "unavailable", "not_replayable", "context_reset"):
    FAILOVERS.labels(result=_result)
for _cause in ("worker_lost", "resumed"):
    RESTARTED_RESPONSES.labels(cause=_cause)


class Children(dict[str, Any]):
    """``metric.labels(...)`` children by one label's value, looked up once and then cached.

    ``labels()`` takes a lock and builds a key tuple on every call; on a per-frame path that is
    a measurable share of the session service's CPU. Label values are bounded sets here (event
    types, reasons, codes), so the cache stays small.
    """

    def __init__(self, metric: Any, label: str, **fixed: str) -> None:
        super().__init__()
        self._metric = metric
        self._label = label
        self._fixed = fixed

    def __missing__(self, value: str) -> Any:
        child = self._metric.labels(**self._fixed, **{self._label: value})
        self[value] = child
        return child


#: Cached children of the per-event metrics (``EVENTS_IN["append"].inc()``).
EVENTS_IN: Final = Children(EVENTS, "type", direction="in")
EVENTS_OUT: Final = Children(EVENTS, "type", direction="out")
ERRORS_BY_CODE: Final = Children(ERRORS, "code")
DROPPED: Final = Children(DROPPED_OUTPUTS, "reason")
LATENCY_ACK: Final = FRAME_LATENCY.labels(stage="ack")
LATENCY_FIRST_AUDIO: Final = FRAME_LATENCY.labels(stage="first_audio")
