"""Property tests: no declaration, valid or not, ever hands one request another's audio.

Every payload's PCM encodes the id of the request its producer meant it for, so a routing can be
checked by content: a payload delivered to request R must say R.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.sparse import reset_sparse_log_state
from duplex.v1 import common_pb2, worker_pb2
from session_service.workers.sparse_check import RoutedStep, route_step
from tests.sparse_helpers import all_fail_closed, unknown
from worker_service.sparse_adapter import adapt_multimodal_outputs

AUDIO = worker_pb2.OUTPUT_TYPE_AUDIO
TEXT = worker_pb2.OUTPUT_TYPE_TEXT
PROFILE = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(autouse=True)
def _fresh_log_state() -> Iterator[None]:
    reset_sparse_log_state()
    yield
    reset_sparse_log_state()


def encode(rid: str) -> bytes:
    # Hex of the id: even length (whole s16le frames) and decodable.
    return rid.encode().hex().encode()


def decode(pcm: bytes) -> str:
    return bytes.fromhex(pcm.decode()).decode()


def assert_never_misroutes(routed: RoutedStep, batch: list[str]) -> None:
    for rid, payload in routed.payloads.items():
        assert rid in batch, f"payload reached {rid!r}, which is not in the batch"
        assert decode(payload.pcm) == rid, f"{rid!r} received {decode(payload.pcm)!r}'s audio"
    # Delivered in batch order, and only to batch members.
    assert list(routed.downstream_req_ids) == [r for r in batch if r in routed.downstream_req_ids]
    if routed.failed_closed is not None:
        assert dict(routed.payloads) == {} and routed.downstream_req_ids == ()


ids = st.text(alphabet="abcdefgh-_0123456789", min_size=1, max_size=6)
batches = st.lists(ids, max_size=8, unique=True)
output_types = st.sampled_from([AUDIO, AUDIO, AUDIO, TEXT, worker_pb2.OUTPUT_TYPE_UNSPECIFIED])


# --- The typed router against ANY typed declaration. ----------------------------------------------


@st.composite
def typed_steps(draw: st.DrawFn) -> tuple[list[str], worker_pb2.StepOutput]:
    batch = draw(batches)
    outsiders = ["gone-" + s for s in draw(st.lists(ids, max_size=3))]
    pool = batch + outsiders
    sparse = draw(st.booleans())
    if sparse and pool:
        req_id = draw(st.lists(st.sampled_from(pool), max_size=10))  # may repeat ids
    else:
        req_id = draw(st.lists(ids, max_size=3)) if sparse else []
    # What each payload says is who the declaration assigns it to; extras say "junk".
    owners = req_id if sparse else batch
    n_audio = draw(st.one_of(st.just(len(owners)), st.integers(0, 10)))
    audio = [owners[i] if i < len(owners) else f"junk{i}" for i in range(n_audio)]
    s = worker_pb2.StepOutput(
        step=1,
        batch=[worker_pb2.BatchEntry(request_id=r) for r in batch],
        outputs=worker_pb2.MultimodalOutputs(
            output_type=draw(output_types),
            sparse_audio=sparse,
            req_id=req_id,
            audio=[common_pb2.AudioPayload(pcm=encode(a)) for a in audio],
        ),
    )
    return batch, s


@PROFILE
@given(typed_steps())
def test_router_never_misroutes_and_invalid_routes_nothing(
    case: tuple[list[str], worker_pb2.StepOutput],
) -> None:
    batch, s = case
    out = s.outputs
    before_fail, before_unknown = all_fail_closed(), unknown()
    routed = route_step(s)
    assert_never_misroutes(routed, batch)

    if out.output_type != AUDIO:
        assert routed == RoutedStep({}, tuple(batch), sparse=False, failed_closed=None)
        assert all_fail_closed() == before_fail and unknown() == before_unknown
        return
    req_id = list(out.req_id)
    if out.sparse_audio:
        valid = len(req_id) == len(out.audio) and len(set(req_id)) == len(req_id)
    else:
        valid = len(out.audio) == len(batch)
    if not valid:
        assert routed.failed_closed is not None
        assert dict(routed.payloads) == {} and routed.downstream_req_ids == ()
        assert all_fail_closed() == before_fail + 1
        assert unknown() == before_unknown
        return
    assert routed.failed_closed is None and all_fail_closed() == before_fail
    if out.sparse_audio:
        assert set(routed.payloads) == set(req_id) & set(batch)
        assert unknown() == before_unknown + len(set(req_id) - set(batch))
    else:
        assert set(routed.payloads) == set(batch)
    assert set(routed.downstream_req_ids) == set(routed.payloads)


# --- The legacy adapter + router pipeline against random legacy dicts. ---------------------------


TRUTHY = ["1", "true", "yes", "on"]
FALSY = ["0", "false", "no", "off", "", "2", "y"]
CORRUPTIONS = [
    "none",
    "illegal_marker",
    "marker_conflict",
    "req_id_conflict",
    "missing_req_id",
    "unusable_req_id",
    "duplicate",
    "payload_count",
    "illegal_meta",
    "illegal_payload",
]


def illegal_markers() -> st.SearchStrategy[Any]:
    return st.sampled_from(
        [
            lambda: np.array(["1"]),
            lambda: np.array(["0"]),
            lambda: torch.tensor([1]),
            lambda: 1,
            lambda: 0,
            lambda: 1.0,
            lambda: True,
            lambda: False,
            lambda: ["1", 1],
            lambda: ("1",),
            lambda: {"1": 1},
            lambda: b"1",
            object,
        ]
    ).map(lambda make: make())


def casings(word: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda ups: "".join(c.upper() if u else c for c, u in zip(word, ups, strict=True))
    )


def legal_markers(truthy: bool) -> st.SearchStrategy[Any]:
    word = st.sampled_from(TRUTHY if truthy else FALSY).flatmap(casings)
    if truthy:
        as_list = st.tuples(st.lists(st.sampled_from(FALSY), max_size=2), word).map(lambda t: [*t[0], t[1]])
    else:
        as_list = st.lists(word, max_size=3)
    return st.one_of(word, as_list)


def payload_carriers(rid: str) -> st.SearchStrategy[Any]:
    pcm = encode(rid)
    samples = np.frombuffer(pcm, dtype="<i2")
    return st.sampled_from(
        [
            lambda: pcm,
            lambda: bytearray(pcm),
            lambda: samples.copy(),
            lambda: torch.from_numpy(samples.copy()),
            # float32 in [-1, 1] that converts back to exactly these samples
            lambda: samples.astype(np.float32) / np.float32(32767),
        ]
    ).map(lambda make: make())


@dataclass
class LegacyCase:
    batch: list[str]
    output_type: int
    raw: dict[str, Any]
    # The producer's intent is invalid: the step must route nothing.
    corrupt: bool
    # The request each routed payload must reach, by content; None when dense.
    sparse_ids: list[str] | None


@st.composite
def legacy_cases(draw: st.DrawFn) -> LegacyCase:
    batch = draw(batches)
    outsiders = ["gone-" + s for s in draw(st.lists(ids, max_size=2, unique=True))]
    sparse = draw(st.booleans())
    # Weighted towards valid declarations, so that real routing is exercised as much as failure.
    corruption = draw(st.sampled_from(["none"] * (len(CORRUPTIONS) - 1) + CORRUPTIONS))
    if corruption in ("req_id_conflict", "missing_req_id", "unusable_req_id", "duplicate"):
        sparse = True  # these only matter when the marker is set
    pool = list(dict.fromkeys(batch + outsiders))
    owners: list[str] = draw(st.lists(st.sampled_from(pool), unique=True)) if (sparse and pool) else []
    if not sparse:
        owners = list(batch)
    if corruption == "duplicate":
        owners = [*owners, owners[0]] if owners else ["dup", "dup"]

    marker_side = draw(st.sampled_from(["nested", "flat", "both"]))
    ids_side = draw(st.sampled_from(["nested", "flat", "both"]))
    if corruption == "marker_conflict":
        marker_side = "both"
    if corruption == "req_id_conflict":
        ids_side = "both"

    meta: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    marker_present = sparse or draw(st.booleans())
    if marker_present:
        for side in ("nested", "flat") if marker_side == "both" else (marker_side,):
            value = draw(legal_markers(sparse))
            (meta if side == "nested" else raw)[
                "sparse_audio" if side == "nested" else "meta.sparse_audio"
            ] = value
    if sparse or draw(st.booleans()):
        # Dense steps may carry an id list too (with a falsy or no marker it is never consulted).
        id_values = owners if sparse else draw(st.lists(ids, max_size=3))
        for side in ("nested", "flat") if ids_side == "both" else (ids_side,):
            if side == "nested":
                meta["req_id"] = list(id_values)
            else:
                raw["meta.req_id"] = list(id_values)

    if corruption == "illegal_marker":
        side = draw(st.sampled_from(["nested", "flat"]))
        illegal = draw(illegal_markers())
        if side == "nested":
            meta["sparse_audio"] = illegal
        else:
            raw["meta.sparse_audio"] = illegal
    elif corruption == "marker_conflict":
        flip = draw(st.booleans())
        meta["sparse_audio"] = draw(legal_markers(sparse if flip else not sparse))
        raw["meta.sparse_audio"] = draw(legal_markers(not sparse if flip else sparse))
    elif corruption == "req_id_conflict":
        other = draw(st.sampled_from(["extra", "drop", "reverse"]))
        if other == "drop" and owners:
            raw["meta.req_id"] = owners[:-1]
        elif other == "reverse" and len(owners) >= 2:
            raw["meta.req_id"] = owners[::-1]
        else:
            raw["meta.req_id"] = [*owners, "extra-id"]
    elif corruption == "missing_req_id":
        meta.pop("req_id", None)
        raw.pop("meta.req_id", None)
    elif corruption == "unusable_req_id":
        bad = draw(
            st.sampled_from(
                [
                    lambda o: tuple(o),
                    lambda o: [*o, 1],
                    lambda o: np.array(o, dtype=object),
                    lambda o: ",".join(o),
                ]
            )
        )
        if draw(st.booleans()) or "req_id" not in meta:
            raw["meta.req_id"] = bad(owners)
        else:
            meta["req_id"] = bad(owners)

    if meta:
        raw["meta"] = meta
    if corruption == "illegal_meta":
        raw["meta"] = draw(st.sampled_from([["meta"], "meta", ("sparse_audio", "1"), 1]))

    audio: list[Any] = [draw(payload_carriers(o)) for o in owners]
    if corruption == "payload_count":
        if draw(st.booleans()) and audio:
            audio.pop()
        else:
            audio.append(draw(payload_carriers("surplus")))
    elif corruption == "illegal_payload":
        bad_payload = draw(st.sampled_from(["not audio", 7, np.zeros((2, 2), np.float32), b"\x00"]))
        if audio:
            audio[draw(st.integers(0, len(audio) - 1))] = bad_payload
        else:
            audio.append(bad_payload)  # a count mismatch as well: invalid either way
    raw["audio"] = audio
    return LegacyCase(
        batch=batch,
        output_type=draw(output_types),
        raw=raw,
        corrupt=corruption != "none",
        sparse_ids=owners if sparse else None,
    )


@PROFILE
@given(legacy_cases())
def test_legacy_pipeline_never_misroutes(case: LegacyCase) -> None:
    before = all_fail_closed()
    typed = adapt_multimodal_outputs(case.raw, output_type=case.output_type, batch_req_ids=case.batch)
    step = worker_pb2.StepOutput(
        step=7, batch=[worker_pb2.BatchEntry(request_id=r) for r in case.batch], outputs=typed
    )
    routed = route_step(step)
    assert_never_misroutes(routed, case.batch)

    if case.output_type != AUDIO:
        # Never consulted: not counted, nothing routed, delivered densely.
        assert all_fail_closed() == before
        assert routed == RoutedStep({}, tuple(case.batch), sparse=False, failed_closed=None)
        return
    if case.corrupt:
        # The adapter failed closed into the zero-audio sparse shape, counted once.
        assert typed == worker_pb2.MultimodalOutputs(output_type=AUDIO, sparse_audio=True)
        assert dict(routed.payloads) == {} and routed.downstream_req_ids == ()
        assert all_fail_closed() == before + 1
        return
    assert all_fail_closed() == before
    if case.sparse_ids is None:
        assert set(routed.payloads) == set(case.batch)
        assert routed.downstream_req_ids == tuple(case.batch)
    else:
        assert set(routed.payloads) == set(case.sparse_ids) & set(case.batch)
