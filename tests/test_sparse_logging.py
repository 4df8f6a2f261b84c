"""Flood-proof logging and bounded metric labels of the sparse contract."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from duplex import sparse
from duplex.sparse import (
    CARRIER_LABELS,
    FAIL_CLOSED_REPORTER,
    FailClosedReporter,
    InvalidSparseDeclaration,
    OnceLogger,
    SparseCause,
    carrier_kind,
    record_fail_closed,
    reset_sparse_log_state,
)
from duplex.v1 import worker_pb2
from worker_service.sparse_adapter import adapt_multimodal_outputs

LOG = logging.getLogger("test.sparse")


@pytest.fixture(autouse=True)
def _fresh_log_state() -> Iterator[None]:
    reset_sparse_log_state()
    yield
    reset_sparse_log_state()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


# --- Once per shape. ----------------------------------------------------------------------------


def test_once_logger_logs_each_key_once_until_reset(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLogger(LOG)
    with caplog.at_level(logging.ERROR, logger="test.sparse"):
        assert once.error_once("k1", "first %s", "k1")
        assert not once.error_once("k1", "first %s", "k1")
        assert once.error_once("k2", "first %s", "k2")
        once.reset()
        assert once.error_once("k1", "first %s", "k1")
    assert [r.getMessage() for r in caplog.records] == ["first k1", "first k2", "first k1"]
    assert all(r.levelno == logging.ERROR for r in caplog.records)


def test_once_logger_is_thread_safe(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLogger(LOG)
    results: list[bool] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        for _ in range(200):
            logged = once.error_once("same", "boom")
            with lock:
                results.append(logged)

    with caplog.at_level(logging.ERROR, logger="test.sparse"):
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results.count(True) == 1 and len(results) == 1600
    assert len(caplog.records) == 1


def test_adapter_logs_an_offending_shape_once(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"audio": [b"ab"], "meta.sparse_audio": np.array(["1"]), "meta.req_id": ["a"]}
    other = {"audio": [b"ab"], "meta.sparse_audio": 1, "meta.req_id": ["a"]}
    with caplog.at_level(logging.ERROR, logger="duplex.sparse"):
        for _ in range(20):
            adapt_multimodal_outputs(raw, output_type=worker_pb2.OUTPUT_TYPE_AUDIO, batch_req_ids=["a"])
        adapt_multimodal_outputs(other, output_type=worker_pb2.OUTPUT_TYPE_AUDIO, batch_req_ids=["a"])
    shapes = messages(caplog, "Invalid sparse-audio declaration at")
    assert len(shapes) == 2
    assert "carrier=ndarray" in shapes[0] and "carrier=int" in shapes[1]
    # The consequence is rate-limited separately: one report for all 21 steps.
    assert len(messages(caplog, "failing closed")) == 1
    assert FAIL_CLOSED_REPORTER.suppressed == 20


def test_reset_forgets_logged_shapes(caplog: pytest.LogCaptureFixture) -> None:
    err = InvalidSparseDeclaration(SparseCause.DUPLICATE_REQ_IDS, "req_id_duplicate", "dup")
    reporter = FailClosedReporter(clock=FakeClock())
    with caplog.at_level(logging.ERROR, logger="duplex.sparse"):
        record_fail_closed(err, site="t", reporter=reporter)
        record_fail_closed(err, site="t", reporter=reporter)
        reset_sparse_log_state()
        record_fail_closed(err, site="t", reporter=reporter)
    assert len(messages(caplog, "Invalid sparse-audio declaration at t")) == 2


# --- The rate-limited fail-closed report. ------------------------------------------------------------


def test_reporter_logs_at_most_once_per_interval_with_suppressed_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    reporter = FailClosedReporter(interval_s=60.0, clock=clock, log=LOG)
    with caplog.at_level(logging.ERROR, logger="test.sparse"):
        assert reporter.report(SparseCause.ILLEGAL_MARKER, site="w")
        for _ in range(3):
            clock.now += 10
            assert not reporter.report(SparseCause.ILLEGAL_MARKER, site="w")
        clock.now += 29.9  # 59.9 s after the report: still inside the interval
        assert not reporter.report(SparseCause.LENGTH_MISMATCH, site="w")
        assert reporter.suppressed == 4
        clock.now += 0.1  # exactly one interval
        assert reporter.report(SparseCause.DUPLICATE_REQ_IDS, site="w")
        assert reporter.suppressed == 0
        clock.now += 120
        assert reporter.report(SparseCause.ILLEGAL_MARKER, site="w")
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 3 and reporter.reported == 3
    assert "cause=illegal_marker" in logs[0] and "last report: 0 (none)" in logs[0]
    assert "cause=duplicate_req_ids" in logs[1]
    assert "last report: 4 (illegal_marker=3, length_mismatch=1)" in logs[1]
    assert "last report: 0 (none)" in logs[2]
    assert all(r.levelno == logging.ERROR for r in caplog.records)


def test_reporter_is_thread_safe_and_every_call_is_accounted_for(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    reporter = FailClosedReporter(interval_s=60.0, clock=clock, log=LOG)
    n_threads, per_thread = 8, 500
    barrier = threading.Barrier(n_threads)
    logged: list[bool] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        barrier.wait()
        cause = list(SparseCause)[i % len(SparseCause)]
        for _ in range(per_thread):
            r = reporter.report(cause, site="threads")
            with lock:
                logged.append(r)

    with caplog.at_level(logging.ERROR, logger="test.sparse"):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert logged.count(True) == 1
        assert reporter.reported == 1
        assert reporter.suppressed == n_threads * per_thread - 1
        clock.now += 60
        assert reporter.report(SparseCause.ILLEGAL_MARKER, site="threads")
    last = caplog.records[-1].getMessage()
    assert f"last report: {n_threads * per_thread - 1} (" in last
    assert len(caplog.records) == 2


def test_reporter_under_a_real_clock_reports_once_for_a_burst(caplog: pytest.LogCaptureFixture) -> None:
    reporter = FailClosedReporter(log=LOG)  # default: 60 s, monotonic clock
    with caplog.at_level(logging.ERROR, logger="test.sparse"):
        for _ in range(100):
            reporter.report(SparseCause.ILLEGAL_PAYLOAD, site="burst")
    assert len(caplog.records) == 1 and reporter.suppressed == 99


def test_counters_add_up_across_threads() -> None:
    err = InvalidSparseDeclaration(SparseCause.REQ_ID_CONFLICT, "req_id_conflict", "conflict")
    before = REGISTRY.get_sample_value("duplex_sparse_fail_closed_total", {"cause": "req_id_conflict"}) or 0.0
    reporter = FailClosedReporter(clock=FakeClock())

    def work() -> None:
        for _ in range(250):
            record_fail_closed(err, site="threads", reporter=reporter)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = REGISTRY.get_sample_value("duplex_sparse_fail_closed_total", {"cause": "req_id_conflict"})
    assert after == before + 1000
    assert reporter.reported + reporter.suppressed == 1000


# --- Metric names and bounded labels. ---------------------------------------------------------------


def test_metric_names_and_help_are_registered() -> None:
    names = {m.name for m in REGISTRY.collect()}
    # prometheus_client reports counter families without the _total suffix.
    assert {
        "duplex_sparse_fail_closed",
        "duplex_sparse_invalid_declaration",
        "duplex_sparse_unknown_request",
    } <= names


def test_every_cause_has_a_zero_series_before_any_failure() -> None:
    for cause in SparseCause:
        assert (
            REGISTRY.get_sample_value("duplex_sparse_fail_closed_total", {"cause": cause.value}) is not None
        )


def test_an_unbounded_carrier_label_is_coerced() -> None:
    err = InvalidSparseDeclaration(SparseCause.ILLEGAL_MARKER, "request-1234", "x")
    assert err.carrier == "other"
    assert isinstance(err, ValueError) and err.cause is SparseCause.ILLEGAL_MARKER


class EvilTypeNameThatMustNotBecomeALabel:
    pass


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "none"),
        (True, "bool"),
        (np.bool_(False), "bool"),
        (3, "int"),
        (np.int16(3), "int"),
        (2.5, "float"),
        (np.float32(1), "float"),
        ("s", "str"),
        (np.str_("s"), "str"),
        (b"b", "bytes"),
        (memoryview(b"b"), "bytes"),
        (["s"], "list"),
        ([1], "list"),
        (("s",), "tuple"),
        ({}, "dict"),
        (frozenset(), "set"),
        (torch.zeros(1), "tensor"),
        (torch.nn.Parameter(torch.zeros(1)), "tensor"),
        (np.zeros(1), "ndarray"),
        (np.ma.masked_array([1]), "ndarray"),
        (EvilTypeNameThatMustNotBecomeALabel(), "other"),
        (1j, "other"),
    ],
    ids=repr,
)
def test_carrier_kind_is_bounded(value: object, kind: str) -> None:
    assert carrier_kind(value) == kind
    assert kind in CARRIER_LABELS


def test_carrier_labels_are_a_small_fixed_set_without_type_names() -> None:
    assert len(CARRIER_LABELS) < 128
    assert "req_id_missing" in CARRIER_LABELS and "typed" in CARRIER_LABELS
    assert not any("Evil" in label or "." in label for label in CARRIER_LABELS)


def test_the_module_exposes_a_default_reporter() -> None:
    assert isinstance(sparse.FAIL_CLOSED_REPORTER, FailClosedReporter)
