"""Sparse audio output: the vocabulary both processes share.

A model step covers a batch, but only some requests produce audio in it. The producer declares
which (the typed ``MultimodalOutputs.sparse_audio`` / ``req_id`` on the wire, or the legacy
``meta.sparse_audio`` / ``meta.req_id`` dict keys read by the worker's adapter). A declaration
that does not line up FAILS CLOSED: the step routes no audio at all, because falling back to
dense routing would hand one caller's audio to another.

This module holds what the worker (its legacy adapter and its engine) and the session service's
router have in common: the one check of a typed declaration (``typed_audio_payloads``), the
bounded causes and carrier labels, the error type, the Prometheus counters, and flood-proof
logging (an error once per offending shape; the routing consequence at most once per interval,
with a count of what was suppressed).

Carrier classification here looks at ``type(value)`` ONLY. A marker may be a device tensor or an
arbitrary object; reading it element-wise (``bool()``, ``len()``, iteration, ``==``, ``.item()``)
could force a device sync or run producer code, so the value itself is never touched.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter as _Tally
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Final

from prometheus_client import Counter

from duplex.v1 import common_pb2, worker_pb2

__all__ = [
    "CARRIER_LABELS",
    "FAIL_CLOSED_REPORTER",
    "FAIL_CLOSED_TOTAL",
    "INVALID_DECLARATION_TOTAL",
    "UNKNOWN_REQUEST_TOTAL",
    "FailClosedReporter",
    "InvalidSparseDeclaration",
    "OnceLogger",
    "SparseCause",
    "carrier_kind",
    "log_error_once",
    "prefixed_carrier",
    "record_fail_closed",
    "reset_sparse_log_state",
    "typed_audio_payloads",
]

logger = logging.getLogger(__name__)


class SparseCause(StrEnum):
    """Why a sparse declaration is invalid (the ``cause`` label of the fail-closed counter)."""

    # The marker's carrier is not a list of str / a bare str / None.
    ILLEGAL_MARKER = "illegal_marker"
    # The legacy ``meta`` entry is present but is not a dict, so no declaration can be read.
    ILLEGAL_META = "illegal_meta"
    # The legacy outputs object is neither a dict nor a typed message.
    ILLEGAL_OUTPUTS = "illegal_outputs"
    # The marker is set but no usable request-id list (missing, or not a list of str).
    UNUSABLE_REQ_IDS = "unusable_req_ids"
    # Nested and flattened markers are both present and disagree.
    MARKER_CONFLICT = "marker_conflict"
    # Nested and flattened request-id lists are both present and disagree.
    REQ_ID_CONFLICT = "req_id_conflict"
    # The request-id list names a request twice.
    DUPLICATE_REQ_IDS = "duplicate_req_ids"
    # Sparse: the number of payloads differs from the number of request ids.
    LENGTH_MISMATCH = "length_mismatch"
    # Dense: the number of payloads differs from the batch size.
    DENSE_COUNT_MISMATCH = "dense_count_mismatch"
    # The step's batch names a request twice, so even dense routing is ambiguous.
    DUPLICATE_BATCH_IDS = "duplicate_batch_ids"
    # A legacy payload could not be converted to PCM (wrong type, dtype, shape, frame size).
    ILLEGAL_PAYLOAD = "illegal_payload"


# The carrier kinds a value can be classified as. Metric labels are built only from these, never
# from a type's name (which a producer controls) nor from a request id (unbounded).
_KINDS: Final[tuple[str, ...]] = (
    "none",
    "bool",
    "int",
    "float",
    "str",
    "bytes",
    "list",
    "list_non_str",
    "list_subclass",
    "tuple",
    "dict",
    "set",
    "tensor",
    "ndarray",
    "other",
)
# Prefixes say which part of a legacy declaration held the bad carrier; a bare kind is the marker.
_PREFIXES: Final[tuple[str, ...]] = ("", "req_id_", "meta_", "outputs_", "audio_", "payload_")
# Carriers that are not a value's kind: what went wrong with a well-typed declaration.
_FIXED_LABELS: Final[tuple[str, ...]] = (
    "req_id_missing",
    "marker_conflict",
    "req_id_conflict",
    "req_id_duplicate",
    "payload_count",
    "payload_dtype",
    "payload_shape",
    "payload_frame",
    "payload_error",
    # Found invalid by the session service's router in a typed message.
    "typed",
)
CARRIER_LABELS: Final[frozenset[str]] = frozenset(
    [p + k for p in _PREFIXES for k in _KINDS] + list(_FIXED_LABELS)
)


def _loaded_class(module: str, name: str) -> type | None:
    # A tensor or array can only exist once its library is imported, so look it up instead of
    # importing torch (seconds, hundreds of MB) into a process that never uses it.
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def carrier_kind(value: object) -> str:
    """Classify ``value`` into one of a bounded set of kinds, by its type alone.

    Only ``type(value)`` is inspected (no attribute of the value, not even ``__class__``), so
    a tensor, an array or a hostile object is never read. An exact ``list`` is reported as
    ``"list"``: whether its items are strings is for the caller, who may iterate it.
    """
    if value is None:
        return "none"
    tp = type(value)
    # bool before int: bool is an int subclass.
    if issubclass(tp, bool):
        return "bool"
    if issubclass(tp, int):
        return "int"
    if issubclass(tp, float):
        return "float"
    if issubclass(tp, str):
        return "str"
    if issubclass(tp, bytes | bytearray | memoryview):
        return "bytes"
    if tp is list:
        return "list"
    if issubclass(tp, list):
        # A subclass may override iteration; the contract is a plain list.
        return "list_subclass"
    if issubclass(tp, tuple):
        return "tuple"
    if issubclass(tp, dict):
        return "dict"
    if issubclass(tp, set | frozenset):
        return "set"
    tensor = _loaded_class("torch", "Tensor")
    if tensor is not None and issubclass(tp, tensor):
        return "tensor"
    np = sys.modules.get("numpy")
    if np is not None:
        if issubclass(tp, np.ndarray):
            return "ndarray"
        # numpy scalars are what `arr[0]` or `arr.any()` produce: label them by meaning.
        if issubclass(tp, np.bool_):
            return "bool"
        if issubclass(tp, np.integer):
            return "int"
        if issubclass(tp, np.floating):
            return "float"
    return "other"


def prefixed_carrier(prefix: str, value: object) -> str:
    """The bounded carrier label ``prefix + carrier_kind(value)``."""
    return _bounded(prefix + carrier_kind(value))


def _bounded(label: str) -> str:
    return label if label in CARRIER_LABELS else "other"


class InvalidSparseDeclaration(ValueError):
    """A sparse declaration that is present but out of contract.

    ``cause`` and ``carrier`` are bounded labels, safe as metric labels. The message may name the
    offending type for the operator, never a request id or a value.
    """

    def __init__(self, cause: SparseCause, carrier: str, message: str) -> None:
        super().__init__(message)
        self.cause: SparseCause = cause
        # Coerced into the bounded set so that no caller can mint a new label value.
        self.carrier: str = _bounded(carrier)


# Counter names omit `_total`: prometheus_client appends it.
FAIL_CLOSED_TOTAL: Final = Counter(
    "duplex_sparse_fail_closed",
    "AUDIO steps that routed no payload because their sparse declaration was invalid.",
    ["cause"],
)
INVALID_DECLARATION_TOTAL: Final = Counter(
    "duplex_sparse_invalid_declaration",
    "Invalid sparse-audio declarations, by the carrier found out of contract.",
    ["carrier"],
)
UNKNOWN_REQUEST_TOTAL: Final = Counter(
    "duplex_sparse_unknown_request",
    "Sparse audio payloads naming a request that was not in the step's batch (dropped).",
)
# Pre-create every cause so `rate()` alerts see a zero series before the first failure.
for _cause in SparseCause:
    FAIL_CLOSED_TOTAL.labels(cause=_cause.value)


class OnceLogger:
    """Logs an error once per key (an offending shape), so a broken producer cannot flood."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def error_once(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at error level unless ``key`` was logged before; True if logged."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self._log.error(msg, *args)
        return True

    def reset(self) -> None:
        """Forget every key (for tests)."""
        with self._lock:
            self._seen.clear()


class FailClosedReporter:
    """Reports the fail-closed consequence at most once per interval.

    Every call is accounted for: a call either logs, or is suppressed and counted into the next
    report ("N suppressed since the last report, by cause").
    """

    def __init__(
        self,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger = logger,
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._log = log
        self._lock = threading.Lock()
        self._last_report_at: float | None = None
        self._suppressed: _Tally[str] = _Tally()
        self._reported = 0

    def report(self, cause: SparseCause, *, site: str) -> bool:
        """Note one fail-closed step; log it unless one was logged within the interval.

        Returns True when this call logged.
        """
        with self._lock:
            now = self._clock()
            if self._last_report_at is not None and now - self._last_report_at < self._interval_s:
                self._suppressed[cause.value] += 1
                return False
            suppressed = self._suppressed
            self._suppressed = _Tally()
            self._last_report_at = now
            self._reported += 1
        total = sum(suppressed.values())
        detail = ", ".join(f"{c}={n}" for c, n in sorted(suppressed.items())) or "none"
        # Logged outside the lock: a slow handler must not serialize the engine and the router.
        self._log.error(
            "Invalid sparse-audio declaration (cause=%s, site=%s): failing closed, no audio payload "
            "of the step is routed. Fix the emitting model. Suppressed since the last report: %d (%s).",
            cause.value,
            site,
            total,
            detail,
        )
        return True

    @property
    def reported(self) -> int:
        """How many calls logged."""
        with self._lock:
            return self._reported

    @property
    def suppressed(self) -> int:
        """How many calls were suppressed since the last report."""
        with self._lock:
            return sum(self._suppressed.values())

    def reset(self) -> None:
        """Forget the last report and the suppressed count (for tests)."""
        with self._lock:
            self._last_report_at = None
            self._suppressed = _Tally()
            self._reported = 0


_ONCE: Final = OnceLogger()
FAIL_CLOSED_REPORTER: Final = FailClosedReporter()


def log_error_once(key: str, msg: str, *args: object) -> bool:
    """Log an error once per ``key`` (use a bounded key) in the process-wide memory that
    `reset_sparse_log_state` clears; True if logged."""
    return _ONCE.error_once(key, msg, *args)


def record_fail_closed(
    err: InvalidSparseDeclaration, *, site: str, reporter: FailClosedReporter | None = None
) -> None:
    """Account for one AUDIO step that failed closed: counters, a once-per-shape error log,
    and the rate-limited consequence report. ``site`` names the code path for the log only."""
    FAIL_CLOSED_TOTAL.labels(cause=err.cause.value).inc()
    INVALID_DECLARATION_TOTAL.labels(carrier=err.carrier).inc()
    # Keyed on bounded labels, so the memory of what was logged stays bounded too.
    _ONCE.error_once(
        f"{site}:{err.cause.value}:{err.carrier}",
        "Invalid sparse-audio declaration at %s (cause=%s, carrier=%s): %s",
        site,
        err.cause.value,
        err.carrier,
        err,
    )
    (reporter if reporter is not None else FAIL_CLOSED_REPORTER).report(err.cause, site=site)


def reset_sparse_log_state() -> None:
    """Reset the once-per-shape memory and the default reporter (for tests)."""
    _ONCE.reset()
    FAIL_CLOSED_REPORTER.reset()


def typed_audio_payloads(
    outputs: worker_pb2.MultimodalOutputs, batch_ids: Sequence[str]
) -> dict[str, common_pb2.AudioPayload]:
    """The one check of a typed AUDIO declaration: each payload by the request it belongs to.

    Sparse (``sparse_audio``): payloads align to ``req_id``; an id outside ``batch_ids`` (a
    request already gone) is dropped alone and counted, since each payload names its own
    request. Dense: payloads align to ``batch_ids``. Raises ``InvalidSparseDeclaration`` when
    the declaration does not line up (sparse lengths differ, an id repeats, a dense count is not
    the batch size, or the batch names a request twice): the caller then fails the step closed.

    The worker's engine calls it before slicing a step per owner, the session service's router
    on every step it receives. Set and dict work only; PCM is never copied.
    """
    batch = frozenset(batch_ids)
    if len(batch) != len(batch_ids):
        raise InvalidSparseDeclaration(
            SparseCause.DUPLICATE_BATCH_IDS, "typed", "the step's batch names a request more than once"
        )
    audio = outputs.audio
    if not outputs.sparse_audio:
        if len(audio) != len(batch_ids):
            raise InvalidSparseDeclaration(
                SparseCause.DENSE_COUNT_MISMATCH,
                "typed",
                f"dense step has {len(audio)} payloads for a batch of {len(batch_ids)}",
            )
        return dict(zip(batch_ids, audio, strict=True))
    req_ids = outputs.req_id
    if len(req_ids) != len(audio):
        raise InvalidSparseDeclaration(
            SparseCause.LENGTH_MISMATCH,
            "typed",
            f"sparse step has {len(audio)} payloads for {len(req_ids)} request ids",
        )
    payloads = {rid: payload for rid, payload in zip(req_ids, audio, strict=True) if rid in batch}
    if len(payloads) != len(req_ids):
        # Checked only after the cheap pass above, on the rare step that needs it.
        if len(set(req_ids)) != len(req_ids):
            raise InvalidSparseDeclaration(
                SparseCause.DUPLICATE_REQ_IDS,
                "typed",
                "sparse request-id list names a request more than once",
            )
        UNKNOWN_REQUEST_TOTAL.inc(len(req_ids) - len(payloads))
    return payloads
