"""Shared helpers of the sparse-contract tests: the sparse counters and tagged payloads."""

from __future__ import annotations

from prometheus_client import REGISTRY

from duplex.sparse import SparseCause


def fail_closed(cause: str) -> float:
    return REGISTRY.get_sample_value("duplex_sparse_fail_closed_total", {"cause": cause}) or 0.0


def all_fail_closed() -> float:
    return sum(fail_closed(c.value) for c in SparseCause)


def invalid(carrier: str) -> float:
    return REGISTRY.get_sample_value("duplex_sparse_invalid_declaration_total", {"carrier": carrier}) or 0.0


def unknown() -> float:
    return REGISTRY.get_sample_value("duplex_sparse_unknown_request_total") or 0.0


def pcm(tag: str) -> bytes:
    """A payload that names ``tag``: its hex, of even length (a whole number of s16le frames)."""
    return tag.encode().hex().encode()
