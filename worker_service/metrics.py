"""The worker's Prometheus metrics (``duplex_worker_`` prefix, base units, no per-session labels).

The ``duplex_sparse_*`` counters live in ``duplex.sparse`` (shared with the session service) and
are registered by importing it.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

import duplex.sparse  # noqa: F401  (registers the duplex_sparse_* counters in this process)

STEP_DURATION: Final = Histogram(
    "duplex_worker_step_duration_seconds",
    "Wall time of one engine step (batch assembly, model step, output routing).",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0),
)
MODEL_CPU: Final = Counter(
    "duplex_worker_model_cpu_seconds",
    "CPU time spent in the model's own code, by part: step (its batched steps, on the engine "
    "thread), helpers (work the model runs on its own threads, e.g. the parrot's reply "
    "synthesis). The worker's process CPU less these is what serving costs.",
    ["part"],
)
MODEL_STEP_CPU: Final = MODEL_CPU.labels(part="step")
MODEL_HELPER_CPU: Final = MODEL_CPU.labels(part="helpers")
BATCH_SIZE: Final = Histogram(
    "duplex_worker_batch_size",
    "Requests stepped in one engine step.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
ACTIVE_REQUESTS: Final = Gauge(
    "duplex_worker_active_requests", "Requests (sessions) holding model state in the engine."
)
QUEUE_DEPTH: Final = Gauge(
    "duplex_worker_queue_depth",
    "Queued work: input frames waiting for the engine (queue=input), StepOutputs waiting for "
    "their owner's stream (queue=output).",
    ["queue"],
)
FENCED: Final = Counter(
    "duplex_worker_fenced",
    "Work refused or dropped by fencing, by reason (stale_epoch, not_owner, unknown_session, "
    "aborted: queued/running work dropped by a newer epoch, stale_output: stepped output stripped "
    "at delivery, takeover_denied: a takeover from an identity not allowed to take over, "
    "session_closed: an Attach of a session closed for good, epoch_out_of_range: an epoch above "
    "2^63-1 asked for, identity_not_allowed: an Attach or Run from an identity not allowed to own "
    "sessions).",
    ["reason"],
)
TICK_DURATION: Final = Histogram(
    "duplex_worker_tick_duration_seconds",
    "Frame clock: wall time of one tick's work (its steps, catching up included).",
    buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.08, 0.128, 0.256, 0.512, 1.0),
)
TICKS_LATE: Final = Counter(
    "duplex_worker_ticks_late",
    "Frame clock: ticks that missed their deadline: their step of every session ended after the "
    "next tick was due (the model did not keep real time).",
)
TICK_LOAD: Final = Gauge(
    "duplex_worker_tick_load",
    "Frame clock: the share of a frame period one tick's step of every session takes (a moving "
    "average); near 1 the worker no longer keeps real time, and it refuses new sessions above "
    "--max-tick-load.",
)
SESSIONS_REFUSED: Final = Counter(
    "duplex_worker_sessions_refused",
    "Attaches of new sessions refused with capacity_exhausted, by reason: max_sessions (the "
    "worker holds --max-sessions), real_time (its measured step time says one more session would "
    "break real time: --max-tick-load).",
    ["reason"],
)
LATE_JOINS: Final = Counter(
    "duplex_worker_late_joins",
    "Frame clock: requests stepped just after a tick they missed (their input came within a "
    "quarter period after it began: a command written for the tick that came late), instead of a "
    "whole period later.",
)
SUBMISSIONS: Final = Counter("duplex_worker_submissions", "Submissions received, by kind.", ["kind"])
REQUEST_ERRORS: Final = Counter(
    "duplex_worker_request_errors",
    "Error updates sent to owners, by WorkerError code.",
    ["code"],
)
OWNER_STREAMS: Final = Gauge("duplex_worker_owner_streams", "Open Run streams (one per owner).")
OWNER_CUTOFFS: Final = Counter(
    "duplex_worker_owner_cutoffs",
    "Run streams ended because the owner fell too far behind (output queue full).",
)
ORPHANS_RELEASED: Final = Counter(
    "duplex_worker_orphaned_sessions_released",
    "Sessions released because nobody would: their owner did not reconnect within the orphan "
    "grace, or (also counted in duplex_worker_attach_leases_expired) they were attached by an "
    "owner with no Run stream and not used within the attach lease.",
)
ATTACH_LEASES_EXPIRED: Final = Counter(
    "duplex_worker_attach_leases_expired",
    "Sessions released because they were attached by an owner that had no Run stream and got no "
    "submission within --attach-lease-s.",
)
TOMBSTONES_EVICTED: Final = Counter(
    "duplex_worker_closed_tombstones_evicted",
    "Closed-session tombstones forgotten before their time because there were too many "
    "(--max-closed-sessions): such a session could be attached again.",
)
TURNS_HANDED_OVER: Final = Counter(
    "duplex_worker_turns_handed_over",
    "Turn ends told again to the owner that took a session over: the model had ended the turn and "
    "nothing had answered it (no RESPOND, COMMIT or CLEAR) when the previous owner left.",
)
ENGINE_FAILURES: Final = Counter(
    "duplex_worker_engine_failures", "Fatal engine errors (the worker stops serving)."
)

LLM_REQUESTS: Final = Counter(
    "duplex_worker_llm_requests",
    "Chat completions a chat stage (--model chat) asked of its language model server, by how "
    "they ended: completed, cancelled (the reply was cancelled: a barge-in), timeout (no answer "
    "or no next piece within --llm-timeout-s, or no free request slot), unavailable (the server "
    "could not be reached, or answered 429 or 5xx), refused (it answered another 4xx) or failed "
    "(an answer that could not be read). timeout and unavailable fail the turn with "
    "upstream_unavailable (retryable).",
    ["result"],
)
LLM_IN_FLIGHT: Final = Gauge(
    "duplex_worker_llm_requests_in_flight",
    "Chat completions streaming from the language model server now (at most --llm-concurrency).",
)
LLM_FIRST_TOKEN: Final = Histogram(
    "duplex_worker_llm_first_token_seconds",
    "From a chat stage's request to the first piece of the model's answer (text or a tool call).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
LLM_RESULTS: Final = ("completed", "cancelled", "timeout", "unavailable", "refused", "failed")

FENCE_REASONS: Final = (
    "stale_epoch",
    "not_owner",
    "unknown_session",
    "aborted",
    "stale_output",
    "takeover_denied",
    "session_closed",
    "epoch_out_of_range",
    "identity_not_allowed",
)
SUBMISSION_KINDS: Final = ("append", "commit", "respond", "clear", "text", "unknown")

# Pre-create the bounded label values so dashboards and alerts see zero series from the start.
for _r in FENCE_REASONS:
    FENCED.labels(reason=_r)
for _k in SUBMISSION_KINDS:
    SUBMISSIONS.labels(kind=_k)
for _q in ("input", "output"):
    QUEUE_DEPTH.labels(queue=_q)
for _r in LLM_RESULTS:
    LLM_REQUESTS.labels(result=_r)
for _r in ("max_sessions", "real_time"):
    SESSIONS_REFUSED.labels(reason=_r)
