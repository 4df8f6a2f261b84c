"""Shared helpers of the sparse-contract tests: the sparse counters and tagged payloads.

The counters are read from their own metric objects (``duplex.sparse``), the ones registered in
the process-wide registry: the same samples as ``REGISTRY.get_sample_value``, without collecting
every metric of the process for each read (the property tests read them thousands of times)."""

from __future__ import annotations

from prometheus_client import Counter

from duplex.sparse import FAIL_CLOSED_TOTAL, INVALID_DECLARATION_TOTAL, UNKNOWN_REQUEST_TOTAL, SparseCause


def _samples(metric: Counter, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called ``name`` of ``metric``, by their sorted labels."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in metric.collect()
        for s in family.samples
        if s.name == name
    }


def fail_closed(cause: str) -> float:
    return _samples(FAIL_CLOSED_TOTAL, "duplex_sparse_fail_closed_total").get((("cause", cause),), 0.0)


def all_fail_closed() -> float:
    samples = _samples(FAIL_CLOSED_TOTAL, "duplex_sparse_fail_closed_total")
    return sum(samples.get((("cause", c.value),), 0.0) for c in SparseCause)


def invalid(carrier: str) -> float:
    samples = _samples(INVALID_DECLARATION_TOTAL, "duplex_sparse_invalid_declaration_total")
    return samples.get((("carrier", carrier),), 0.0)


def unknown() -> float:
    return _samples(UNKNOWN_REQUEST_TOTAL, "duplex_sparse_unknown_request_total").get((), 0.0)


def pcm(tag: str) -> bytes:
    """A payload that names ``tag``: its hex, of even length (a whole number of s16le frames)."""
    return tag.encode().hex().encode()
