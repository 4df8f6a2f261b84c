"""The session service's typed router: each rule, and that failing closed routes nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from duplex.sparse import FailClosedReporter, SparseCause, reset_sparse_log_state
from duplex.v1 import common_pb2, worker_pb2
from session_service.workers.sparse_check import RoutedStep, route_step
from tests.sparse_helpers import all_fail_closed, fail_closed, invalid, pcm, unknown

AUDIO = worker_pb2.OUTPUT_TYPE_AUDIO
TEXT = worker_pb2.OUTPUT_TYPE_TEXT


@pytest.fixture(autouse=True)
def _fresh_log_state() -> Iterator[None]:
    reset_sparse_log_state()
    yield
    reset_sparse_log_state()


def step(
    batch: list[str],
    *,
    output_type: int = AUDIO,
    sparse: bool = False,
    req_id: list[str] | None = None,
    audio: list[str] | None = None,
) -> worker_pb2.StepOutput:
    return worker_pb2.StepOutput(
        step=1,
        batch=[worker_pb2.BatchEntry(request_id=r) for r in batch],
        outputs=worker_pb2.MultimodalOutputs(
            output_type=output_type,  # type: ignore[arg-type]
            sparse_audio=sparse,
            req_id=req_id or [],
            audio=[common_pb2.AudioPayload(pcm=pcm(a)) for a in audio or []],
        ),
    )


def routed_content(routed: RoutedStep) -> dict[str, bytes]:
    return {rid: p.pcm for rid, p in routed.payloads.items()}


def assert_failed_closed(routed: RoutedStep, cause: SparseCause) -> None:
    assert routed.failed_closed is cause
    assert dict(routed.payloads) == {}
    assert routed.downstream_req_ids == ()


class Counts:
    """Deltas of the sparse counters over a block."""

    def __enter__(self) -> Counts:
        self._start = (all_fail_closed(), invalid("typed"), unknown())
        return self

    def __exit__(self, *exc: object) -> None:
        end = (all_fail_closed(), invalid("typed"), unknown())
        self.fail_closed, self.invalid, self.unknown = (e - s for e, s in zip(end, self._start, strict=True))


# --- Non-audio steps. -----------------------------------------------------------------------------


@pytest.mark.parametrize("output_type", [TEXT, worker_pb2.OUTPUT_TYPE_UNSPECIFIED, 9])
def test_non_audio_step_is_dense_and_never_consults_the_declaration(output_type: int) -> None:
    # Every sparse rule is broken here; none may matter.
    s = step(["a", "b", "a"], output_type=output_type, sparse=True, req_id=["x", "x"], audio=["x"])
    with Counts() as c:
        routed = route_step(s)
    assert routed == RoutedStep({}, ("a", "b", "a"), sparse=False, failed_closed=None)
    assert (c.fail_closed, c.invalid, c.unknown) == (0, 0, 0)


def test_step_without_outputs_is_non_audio() -> None:
    s = worker_pb2.StepOutput(step=3, batch=[worker_pb2.BatchEntry(request_id="a")])
    assert route_step(s) == RoutedStep({}, ("a",), sparse=False, failed_closed=None)


# --- Dense audio. -----------------------------------------------------------------------------------


def test_dense_routes_payload_i_to_batch_i() -> None:
    with Counts() as c:
        routed = route_step(step(["c", "a", "b"], audio=["c", "a", "b"]))
    assert routed_content(routed) == {"c": pcm("c"), "a": pcm("a"), "b": pcm("b")}
    assert routed.downstream_req_ids == ("c", "a", "b")
    assert not routed.sparse and routed.failed_closed is None
    assert (c.fail_closed, c.unknown) == (0, 0)


@pytest.mark.parametrize("n", [0, 2, 4])
def test_dense_count_mismatch_fails_closed(n: int) -> None:
    before = fail_closed("dense_count_mismatch")
    with Counts() as c:
        routed = route_step(step(["a", "b", "c"], audio=["a", "b", "c", "d"][:n]))
    assert_failed_closed(routed, SparseCause.DENSE_COUNT_MISMATCH)
    assert fail_closed("dense_count_mismatch") == before + 1
    assert (c.fail_closed, c.invalid) == (1, 1)


def test_dense_empty_batch_without_audio_is_valid() -> None:
    routed = route_step(step([], audio=[]))
    assert routed == RoutedStep({}, (), sparse=False, failed_closed=None)


# --- Sparse audio. -----------------------------------------------------------------------------------


def test_sparse_routes_each_payload_to_its_own_id_in_batch_order() -> None:
    with Counts() as c:
        routed = route_step(step(["a", "b", "c", "d"], sparse=True, req_id=["d", "b"], audio=["d", "b"]))
    assert routed_content(routed) == {"d": pcm("d"), "b": pcm("b")}
    # Delivery follows the batch, not the declaration's order.
    assert routed.downstream_req_ids == ("b", "d")
    assert routed.sparse and routed.failed_closed is None
    assert (c.fail_closed, c.unknown) == (0, 0)


def test_unknown_ids_get_nothing_are_counted_and_others_still_route() -> None:
    with Counts() as c:
        routed = route_step(
            step(["a", "b"], sparse=True, req_id=["gone1", "b", "gone2"], audio=["gone1", "b", "gone2"])
        )
    assert routed_content(routed) == {"b": pcm("b")}
    assert routed.downstream_req_ids == ("b",)
    assert routed.failed_closed is None
    assert c.unknown == 2 and c.fail_closed == 0


def test_all_ids_unknown_routes_nothing_but_is_not_a_failure() -> None:
    with Counts() as c:
        routed = route_step(step(["a"], sparse=True, req_id=["x"], audio=["x"]))
    assert routed == RoutedStep({}, (), sparse=True, failed_closed=None)
    assert c.unknown == 1 and c.fail_closed == 0


def test_empty_sparse_list_is_valid_and_routes_nothing() -> None:
    with Counts() as c:
        routed = route_step(step(["a", "b"], sparse=True))
    assert routed == RoutedStep({}, (), sparse=True, failed_closed=None)
    assert (c.fail_closed, c.unknown) == (0, 0)


@pytest.mark.parametrize(
    ("req_id", "audio"), [(["a"], []), (["a"], ["a", "b"]), ([], ["a"]), (["a", "b"], ["a"])]
)
def test_sparse_length_mismatch_fails_closed(req_id: list[str], audio: list[str]) -> None:
    before = fail_closed("length_mismatch")
    with Counts() as c:
        routed = route_step(step(["a", "b"], sparse=True, req_id=req_id, audio=audio))
    assert_failed_closed(routed, SparseCause.LENGTH_MISMATCH)
    assert fail_closed("length_mismatch") == before + 1
    assert (c.fail_closed, c.invalid, c.unknown) == (1, 1, 0)


@pytest.mark.parametrize("req_id", [["a", "a"], ["a", "b", "a"], ["x", "x"], ["x", "a", "x"]])
def test_duplicate_sparse_ids_fail_closed(req_id: list[str]) -> None:
    before = fail_closed("duplicate_req_ids")
    with Counts() as c:
        routed = route_step(step(["a", "b"], sparse=True, req_id=req_id, audio=req_id))
    assert_failed_closed(routed, SparseCause.DUPLICATE_REQ_IDS)
    assert fail_closed("duplicate_req_ids") == before + 1
    # Nothing was routed, so nothing was dropped as unknown either.
    assert (c.fail_closed, c.unknown) == (1, 0)


@pytest.mark.parametrize("sparse", [False, True])
def test_duplicate_batch_ids_on_audio_step_fail_closed(sparse: bool) -> None:
    s = step(
        ["a", "b", "a"],
        sparse=sparse,
        req_id=["b"] if sparse else None,
        audio=["b"] if sparse else ["a", "b", "a"],
    )
    before = fail_closed("duplicate_batch_ids")
    routed = route_step(s)
    assert_failed_closed(routed, SparseCause.DUPLICATE_BATCH_IDS)
    assert fail_closed("duplicate_batch_ids") == before + 1


def test_payloads_are_not_copied() -> None:
    s = step(["a"], sparse=True, req_id=["a"], audio=["a"])
    routed = route_step(s)
    # The routed payload is the step's own message (a view), not a copy of its PCM.
    assert routed.payloads["a"] == s.outputs.audio[0]
    s.outputs.audio[0].pcm = b"changed!"
    assert routed.payloads["a"].pcm == b"changed!"


# --- Reporting. -----------------------------------------------------------------------------------------


def test_fail_closed_is_reported_through_the_given_reporter(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    reporter = FailClosedReporter(interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="duplex.sparse"):
        for _ in range(5):
            route_step(step(["a"], sparse=True, req_id=["a", "a"], audio=["a", "a"]), reporter=reporter)
    assert reporter.reported == 1 and reporter.suppressed == 4
    consequence = [r for r in caplog.records if "failing closed" in r.getMessage()]
    assert len(consequence) == 1 and "session_router" in consequence[0].getMessage()


def test_valid_steps_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        route_step(step(["a", "b"], sparse=True, req_id=["b", "zz"], audio=["b", "zz"]))
        route_step(step(["a", "b"], audio=["a", "b"]))
    assert caplog.records == []
