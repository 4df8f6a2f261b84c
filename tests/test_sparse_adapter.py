"""The worker's legacy ``multimodal_outputs`` adapter: every rule of the sparse contract."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from duplex import sparse
from duplex.sparse import SparseCause, reset_sparse_log_state
from duplex.v1 import common_pb2, worker_pb2
from tests.sparse_helpers import all_fail_closed, fail_closed, invalid, pcm
from worker_service import sparse_adapter
from worker_service.sparse_adapter import adapt_multimodal_outputs

AUDIO = worker_pb2.OUTPUT_TYPE_AUDIO
TEXT = worker_pb2.OUTPUT_TYPE_TEXT
BATCH = ["a", "b", "c"]


@pytest.fixture(autouse=True)
def _fresh_log_state() -> Iterator[None]:
    reset_sparse_log_state()
    yield
    reset_sparse_log_state()


def adapt(
    raw: object, output_type: int = AUDIO, batch: list[str] | None = None
) -> worker_pb2.MultimodalOutputs:
    return adapt_multimodal_outputs(
        raw, output_type=output_type, batch_req_ids=BATCH if batch is None else batch
    )


def sparse_dict(marker: object, ids: object, audio: list[object], *, where: str = "nested") -> dict[str, Any]:
    if where == "nested":
        return {"audio": audio, "meta": {"sparse_audio": marker, "req_id": ids}}
    return {"audio": audio, "meta.sparse_audio": marker, "meta.req_id": ids}


def assert_zero_audio(out: worker_pb2.MultimodalOutputs) -> None:
    assert out == worker_pb2.MultimodalOutputs(output_type=AUDIO, sparse_audio=True)


class FailsClosed:
    """Asserts an adapter call fails closed with one cause and carrier, counted once each."""

    def __init__(self, cause: SparseCause, carrier: str) -> None:
        self.cause, self.carrier = cause, carrier

    def __enter__(self) -> FailsClosed:
        self.before = (fail_closed(self.cause), invalid(self.carrier), all_fail_closed())
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        assert fail_closed(self.cause) == self.before[0] + 1
        assert invalid(self.carrier) == self.before[1] + 1
        assert all_fail_closed() == self.before[2] + 1


class NotCounted:
    def __enter__(self) -> NotCounted:
        self.before = all_fail_closed()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert all_fail_closed() == self.before


# --- Spies: objects that record any attempt to read them. ------------------------------------

TOUCHED: list[str] = []


def _touch(name: str) -> Any:
    TOUCHED.append(name)
    raise AssertionError(f"illegal carrier was read: {name}")


class SpyObject:
    """Records any attribute access and every protocol a reader could use."""

    def __getattribute__(self, name: str) -> Any:
        return _touch(f"getattr:{name}")

    def __iter__(self) -> Any:
        return _touch("__iter__")

    def __bool__(self) -> bool:
        return bool(_touch("__bool__"))

    def __len__(self) -> int:
        return int(_touch("__len__"))

    def __eq__(self, other: object) -> bool:
        return bool(_touch("__eq__"))

    def __ne__(self, other: object) -> bool:
        return bool(_touch("__ne__"))

    def __hash__(self) -> int:
        return int(_touch("__hash__"))

    def __index__(self) -> int:
        return int(_touch("__index__"))

    def __int__(self) -> int:
        return int(_touch("__int__"))

    def __float__(self) -> float:
        return float(_touch("__float__"))

    def __getitem__(self, key: object) -> Any:
        return _touch("__getitem__")

    def __contains__(self, key: object) -> bool:
        return bool(_touch("__contains__"))

    def __array__(self, *args: object, **kwargs: object) -> Any:
        return _touch("__array__")

    def __str__(self) -> str:
        return str(_touch("__str__"))

    def __repr__(self) -> str:
        return "<SpyObject>"  # pytest may repr it in a failure message

    def __format__(self, spec: str) -> str:
        return str(_touch("__format__"))

    # Reached only through __getattribute__ (which records first), but named for the reader.
    def item(self) -> Any:
        return _touch("item")

    def tolist(self) -> Any:
        return _touch("tolist")


class SpyList(list[str]):
    """A list subclass: not the contract's plain list, and its overrides must never run."""

    def __iter__(self) -> Any:
        return _touch("list.__iter__")

    def __len__(self) -> int:
        return int(_touch("list.__len__"))

    def __getitem__(self, key: Any) -> Any:
        return _touch("list.__getitem__")

    def __bool__(self) -> bool:
        return bool(_touch("list.__bool__"))

    def __eq__(self, other: object) -> bool:
        return bool(_touch("list.__eq__"))

    def __contains__(self, key: object) -> bool:
        return bool(_touch("list.__contains__"))

    __hash__ = None  # type: ignore[assignment]


class SpyStr(str):
    """A str subclass: legal, but read with str's own code, never its overrides."""

    def lower(self) -> str:
        return str(_touch("str.lower"))

    def __eq__(self, other: object) -> bool:
        return bool(_touch("str.__eq__"))

    def __hash__(self) -> int:
        return int(_touch("str.__hash__"))

    def __str__(self) -> str:
        return str(_touch("str.__str__"))


class SpyArray(np.ndarray):  # type: ignore[type-arg]
    """A real ndarray whose reading protocols record."""

    def __iter__(self) -> Any:
        return _touch("ndarray.__iter__")

    def __bool__(self) -> bool:
        return bool(_touch("ndarray.__bool__"))

    def __len__(self) -> int:
        return int(_touch("ndarray.__len__"))

    def __eq__(self, other: object) -> Any:
        return _touch("ndarray.__eq__")

    def __getitem__(self, key: Any) -> Any:
        return _touch("ndarray.__getitem__")

    def item(self, *args: Any) -> Any:
        return _touch("ndarray.item")

    def tolist(self) -> Any:
        return _touch("ndarray.tolist")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return _touch("ndarray.__array__")

    def __array_ufunc__(self, *args: Any, **kwargs: Any) -> Any:
        return _touch("ndarray.__array_ufunc__")

    def __array_function__(self, *args: Any, **kwargs: Any) -> Any:
        return _touch("ndarray.__array_function__")


class SpyTensor(torch.Tensor):
    """A real tensor: every torch operation on it (bool, len, iter, ==, item, tolist, .cpu(),
    .shape ...) goes through __torch_function__, which records it."""

    armed: ClassVar[bool] = False

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if cls.armed:
            _touch(f"torch:{getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


def spy_array(values: list[str] | list[float]) -> SpyArray:
    return np.asarray(values).view(SpyArray)


def spy_tensor() -> SpyTensor:
    t = torch.tensor([1.0]).as_subclass(SpyTensor)
    assert isinstance(t, SpyTensor)
    return t


@pytest.fixture
def spies() -> Iterator[None]:
    TOUCHED.clear()
    SpyTensor.armed = True
    yield
    SpyTensor.armed = False
    assert TOUCHED == [], f"an illegal carrier was read: {TOUCHED}"


SPY_FACTORIES = {
    "object": (SpyObject, "other"),
    "list_subclass": (lambda: SpyList(["1"]), "list_subclass"),
    "ndarray": (lambda: spy_array(["1"]), "ndarray"),
    "ndarray_zero": (lambda: spy_array(["0"]), "ndarray"),
    "ndarray_float": (lambda: spy_array([1.0]), "ndarray"),
    "tensor": (spy_tensor, "tensor"),
    "list_with_spy_item": (lambda: ["1", SpyObject()], "list_non_str"),
}


# --- Marker carriers. -------------------------------------------------------------------------

TRUTHY = ["1", "true", "TRUE", "True", "yes", "YES", "on", "On", ["1"], ["on"], ["0", "yes"], ["TrUe"]]
FALSY = ["0", "false", "", "no", "off", " 1", "1 ", "truthy", "y", ["0"], [], ["no", "off"], None]


@pytest.mark.parametrize("where", ["nested", "flat"])
@pytest.mark.parametrize("marker", TRUTHY, ids=repr)
def test_truthy_legal_marker_is_sparse(marker: object, where: str) -> None:
    with NotCounted():
        out = adapt(sparse_dict(marker, ["b"], [pcm("b")], where=where))
    assert out.sparse_audio
    assert list(out.req_id) == ["b"]
    assert [p.pcm for p in out.audio] == [pcm("b")]


@pytest.mark.parametrize("where", ["nested", "flat"])
@pytest.mark.parametrize("marker", FALSY, ids=repr)
def test_falsy_legal_marker_or_none_is_dense(marker: object, where: str) -> None:
    # Payloads follow batch order; the id list is not consulted when the marker is falsy.
    with NotCounted():
        out = adapt(sparse_dict(marker, ["b"], [pcm(r) for r in BATCH], where=where))
    assert not out.sparse_audio
    assert list(out.req_id) == []
    assert [p.pcm for p in out.audio] == [pcm(r) for r in BATCH]


def test_numpy_str_marker_is_a_legal_string() -> None:
    out = adapt(sparse_dict(np.str_("Yes"), ["a"], [pcm("a")]))
    assert out.sparse_audio and list(out.req_id) == ["a"]


@pytest.mark.usefixtures("spies")
def test_str_subclass_marker_and_ids_are_read_with_str_code_only() -> None:
    out = adapt(sparse_dict(SpyStr("ON"), [SpyStr("a"), "c"], [pcm("a"), pcm("c")]))
    assert out.sparse_audio and list(out.req_id) == ["a", "c"]
    out = adapt(sparse_dict([SpyStr("no"), SpyStr("TRUE")], ["b"], [pcm("b")]))
    assert out.sparse_audio and list(out.req_id) == ["b"]


ILLEGAL_MARKERS: list[tuple[object, str]] = [
    (np.array(["1"]), "ndarray"),
    (np.array(["0"]), "ndarray"),
    (np.array([]), "ndarray"),
    (torch.tensor([1]), "tensor"),
    (torch.tensor(0), "tensor"),
    (1, "int"),
    (0, "int"),
    (1.0, "float"),
    (True, "bool"),
    (False, "bool"),
    (np.bool_(True), "bool"),
    (np.int64(1), "int"),
    (np.float32(1.0), "float"),
    (["1", 1], "list_non_str"),
    ([None], "list_non_str"),
    ([b"1"], "list_non_str"),
    ([["1"]], "list_non_str"),
    (("1",), "tuple"),
    ({"1"}, "set"),
    ({"value": "1"}, "dict"),
    (b"1", "bytes"),
    (bytearray(b"1"), "bytes"),
    (object(), "other"),
]


@pytest.mark.parametrize("where", ["nested", "flat"])
@pytest.mark.parametrize(("marker", "carrier"), ILLEGAL_MARKERS, ids=repr)
def test_illegal_marker_carrier_fails_closed(marker: object, carrier: str, where: str) -> None:
    # A perfectly aligned sparse declaration otherwise: only the carrier is wrong.
    with FailsClosed(SparseCause.ILLEGAL_MARKER, carrier):
        out = adapt(sparse_dict(marker, ["a"], [pcm("a")], where=where))
    assert_zero_audio(out)


@pytest.mark.usefixtures("spies")
@pytest.mark.parametrize("where", ["nested", "flat"])
@pytest.mark.parametrize("name", list(SPY_FACTORIES))
def test_illegal_marker_is_never_read_element_wise(name: str, where: str) -> None:
    factory, carrier = SPY_FACTORIES[name]
    with FailsClosed(SparseCause.ILLEGAL_MARKER, carrier):
        out = adapt(sparse_dict(factory(), ["a"], [pcm("a")], where=where))
    assert_zero_audio(out)


@pytest.mark.usefixtures("spies")
def test_spy_tensor_really_records() -> None:
    # Guards the spy itself: were __torch_function__ not hooked, the test above would prove nothing.
    t = spy_tensor()
    with pytest.raises(AssertionError):
        bool(t)
    with pytest.raises(AssertionError):
        t.item()
    with pytest.raises(AssertionError):
        len(t)
    assert TOUCHED
    TOUCHED.clear()


# --- Nested and flattened encodings. ---------------------------------------------------------


def test_flat_marker_with_nested_ids() -> None:
    raw = {"audio": [pcm("c")], "meta.sparse_audio": ["1"], "meta": {"req_id": ["c"]}}
    out = adapt(raw)
    assert out.sparse_audio and list(out.req_id) == ["c"]


def test_nested_marker_with_flat_ids() -> None:
    raw = {"audio": [pcm("c")], "meta": {"sparse_audio": "true"}, "meta.req_id": ["c"]}
    out = adapt(raw)
    assert out.sparse_audio and list(out.req_id) == ["c"]


def test_both_encodings_agreeing_are_valid() -> None:
    raw = {
        "audio": [pcm("c"), pcm("a")],
        "meta": {"sparse_audio": ["1"], "req_id": ["c", "a"]},
        "meta.sparse_audio": "YES",
        "meta.req_id": ["c", "a"],
    }
    out = adapt(raw)
    assert out.sparse_audio and list(out.req_id) == ["c", "a"]
    assert [p.pcm for p in out.audio] == [pcm("c"), pcm("a")]


def test_one_falsy_marker_and_one_absent_is_dense_not_a_conflict() -> None:
    raw = {"audio": [pcm(r) for r in BATCH], "meta": {"sparse_audio": "0"}, "meta.req_id": ["a"]}
    with NotCounted():
        out = adapt(raw)
    assert not out.sparse_audio


@pytest.mark.parametrize(
    ("nested", "flat", "carrier"),
    [
        (["1"], np.array(["1"]), "ndarray"),
        (torch.tensor([1]), ["1"], "tensor"),
        ("0", 0, "int"),
        (7, "no", "int"),
    ],
    ids=repr,
)
def test_illegal_carrier_on_either_side_wins_over_a_valid_other_side(
    nested: object, flat: object, carrier: str
) -> None:
    raw = {"audio": [pcm("a")], "meta": {"sparse_audio": nested, "req_id": ["a"]}, "meta.sparse_audio": flat}
    with FailsClosed(SparseCause.ILLEGAL_MARKER, carrier):
        out = adapt(raw)
    assert_zero_audio(out)


@pytest.mark.parametrize(("nested", "flat"), [("1", "0"), (["yes"], []), ("off", ["ON"]), ("true", "")])
def test_disagreeing_markers_fail_closed(nested: object, flat: object) -> None:
    raw = {"audio": [pcm("a")], "meta": {"sparse_audio": nested, "req_id": ["a"]}, "meta.sparse_audio": flat}
    with FailsClosed(SparseCause.MARKER_CONFLICT, "marker_conflict"):
        out = adapt(raw)
    assert_zero_audio(out)


@pytest.mark.parametrize(
    ("nested", "flat"), [(["a"], ["b"]), (["a", "b"], ["b", "a"]), (["a"], []), ([], ["a"])]
)
def test_disagreeing_id_lists_fail_closed(nested: list[str], flat: list[str]) -> None:
    raw = {"audio": [pcm("a")], "meta": {"sparse_audio": "1", "req_id": nested}, "meta.req_id": flat}
    with FailsClosed(SparseCause.REQ_ID_CONFLICT, "req_id_conflict"):
        out = adapt(raw)
    assert_zero_audio(out)


@pytest.mark.parametrize("ids", [["a", "a"], ["a", "b", "a"], ["z", "z"]])
def test_duplicate_ids_fail_closed(ids: list[str]) -> None:
    with FailsClosed(SparseCause.DUPLICATE_REQ_IDS, "req_id_duplicate"):
        out = adapt(sparse_dict("1", ids, [pcm(r) for r in ids]))
    assert_zero_audio(out)


# --- The id list. ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["nested", "flat"])
def test_marker_without_ids_fails_closed(where: str) -> None:
    raw: dict[str, Any] = {"audio": [pcm("a")]}
    if where == "nested":
        raw["meta"] = {"sparse_audio": ["1"]}
    else:
        raw["meta.sparse_audio"] = ["1"]
    with FailsClosed(SparseCause.UNUSABLE_REQ_IDS, "req_id_missing"):
        out = adapt(raw)
    assert_zero_audio(out)


UNUSABLE_IDS: list[tuple[object, str]] = [
    ("a", "req_id_str"),
    (("a",), "req_id_tuple"),
    (["a", 1], "req_id_list_non_str"),
    ([None], "req_id_list_non_str"),
    (np.array(["a"]), "req_id_ndarray"),
    (torch.tensor([1]), "req_id_tensor"),
    ({"a": 0}, "req_id_dict"),
    (1, "req_id_int"),
    (object(), "req_id_other"),
]


@pytest.mark.parametrize("where", ["nested", "flat"])
@pytest.mark.parametrize(("ids", "carrier"), UNUSABLE_IDS, ids=repr)
def test_unusable_id_list_fails_closed(ids: object, carrier: str, where: str) -> None:
    with FailsClosed(SparseCause.UNUSABLE_REQ_IDS, carrier):
        out = adapt(sparse_dict("1", ids, [pcm("a")], where=where))
    assert_zero_audio(out)


def test_unusable_id_list_on_one_side_wins_over_a_valid_other_side() -> None:
    raw = {"audio": [pcm("a")], "meta": {"sparse_audio": "1", "req_id": ["a"]}, "meta.req_id": "a"}
    with FailsClosed(SparseCause.UNUSABLE_REQ_IDS, "req_id_str"):
        out = adapt(raw)
    assert_zero_audio(out)


@pytest.mark.usefixtures("spies")
@pytest.mark.parametrize("name", list(SPY_FACTORIES))
def test_unusable_id_carrier_is_never_read_element_wise(name: str) -> None:
    factory, _ = SPY_FACTORIES[name]
    with FailsClosed(SparseCause.UNUSABLE_REQ_IDS, "req_id_" + SPY_FACTORIES[name][1]):
        out = adapt(sparse_dict(["1"], factory(), [pcm("a")]))
    assert_zero_audio(out)


@pytest.mark.usefixtures("spies")
def test_id_list_is_not_consulted_without_a_truthy_marker() -> None:
    with NotCounted():
        out = adapt(sparse_dict(["0"], SpyObject(), [pcm(r) for r in BATCH]))
    assert not out.sparse_audio and len(out.audio) == 3


# --- Outputs, meta and payload shapes. -----------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "carrier"),
    [(["sparse_audio"], "meta_list"), ("x", "meta_str"), (SpyObject(), "meta_other")],
    ids=repr,
)
def test_meta_that_is_not_a_dict_fails_closed(meta: object, carrier: str) -> None:
    TOUCHED.clear()
    with FailsClosed(SparseCause.ILLEGAL_META, carrier):
        out = adapt({"audio": [pcm(r) for r in BATCH], "meta": meta})
    assert_zero_audio(out)
    assert TOUCHED == []


@pytest.mark.parametrize(
    ("raw", "carrier"),
    [([b"ab"], "outputs_list"), (b"ab", "outputs_bytes"), (torch.zeros(3), "outputs_tensor")],
    ids=repr,
)
def test_outputs_that_are_not_a_dict_fail_closed(raw: object, carrier: str) -> None:
    with FailsClosed(SparseCause.ILLEGAL_OUTPUTS, carrier):
        out = adapt(raw)
    assert_zero_audio(out)


def test_no_outputs_is_the_zero_audio_shape_and_not_an_error() -> None:
    with NotCounted():
        assert_zero_audio(adapt(None))


def test_typed_message_is_returned_as_is() -> None:
    typed = worker_pb2.MultimodalOutputs(output_type=AUDIO, sparse_audio=True, req_id=["a", "a"])
    with NotCounted():
        assert adapt(typed) is typed
        assert adapt(typed, output_type=TEXT) is typed


def test_valid_sparse_keeps_declared_order_and_alignment() -> None:
    out = adapt(sparse_dict("1", ["c", "zz", "a"], [pcm("c"), pcm("zz"), pcm("a")]))
    assert out.output_type == AUDIO and out.sparse_audio
    assert list(out.req_id) == ["c", "zz", "a"]  # unknown ids are the router's business
    assert [p.pcm for p in out.audio] == [pcm("c"), pcm("zz"), pcm("a")]


def test_empty_sparse_id_list_is_valid_zero_audio() -> None:
    with NotCounted():
        out = adapt(sparse_dict(["1"], [], []))
    assert_zero_audio(out)


def test_valid_dense_keeps_batch_order() -> None:
    with NotCounted():
        out = adapt({"audio": [pcm(r) for r in BATCH]})
    assert not out.sparse_audio and list(out.req_id) == []
    assert [p.pcm for p in out.audio] == [pcm(r) for r in BATCH]


@pytest.mark.parametrize(("ids", "n"), [(["a"], 0), (["a"], 2), (["a", "b", "c"], 2), ([], 1)])
def test_sparse_payload_count_mismatch_fails_closed(ids: list[str], n: int) -> None:
    with FailsClosed(SparseCause.LENGTH_MISMATCH, "payload_count"):
        out = adapt(sparse_dict("1", ids, [pcm(f"x{i}") for i in range(n)]))
    assert_zero_audio(out)


@pytest.mark.parametrize("n", [0, 2, 4])
def test_dense_payload_count_mismatch_fails_closed(n: int) -> None:
    with FailsClosed(SparseCause.DENSE_COUNT_MISMATCH, "payload_count"):
        out = adapt({"audio": [pcm("x")] * n})
    assert_zero_audio(out)


def test_dense_without_audio_key_on_empty_batch_is_valid() -> None:
    with NotCounted():
        out = adapt({}, batch=[])
    assert out == worker_pb2.MultimodalOutputs(output_type=AUDIO)


# --- Non-audio steps never consult the declaration. ------------------------------------------------


@pytest.mark.usefixtures("spies")
@pytest.mark.parametrize("output_type", [TEXT, worker_pb2.OUTPUT_TYPE_UNSPECIFIED, 9])
def test_non_audio_step_never_consults_the_declaration(
    output_type: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(*args: object) -> None:
        raise AssertionError("the sparse declaration was consulted on a non-audio step")

    monkeypatch.setattr(sparse_adapter, "_resolve_req_ids", boom)
    monkeypatch.setattr(sparse_adapter, "_marker_is_set", boom)
    raw = {
        "audio": [pcm("x")],
        "meta": {"sparse_audio": spy_tensor(), "req_id": SpyObject()},
        "meta.sparse_audio": SpyObject(),
        "meta.req_id": spy_array(["a"]),
    }
    before = {c: invalid(c) for c in sparse.CARRIER_LABELS}
    with NotCounted(), caplog.at_level(logging.DEBUG):
        out = adapt(raw, output_type=output_type)
    assert out.output_type == output_type
    assert not out.sparse_audio and list(out.req_id) == []
    assert [p.pcm for p in out.audio] == [pcm("x")]
    assert {c: invalid(c) for c in sparse.CARRIER_LABELS} == before
    assert caplog.records == []


def test_non_audio_step_ignores_an_illegal_meta() -> None:
    with NotCounted():
        out = adapt({"audio": [pcm("x")], "meta": ["garbage"]}, output_type=TEXT)
    assert out.output_type == TEXT and [p.pcm for p in out.audio] == [pcm("x")]


def test_non_audio_step_with_unusable_payload_drops_it_without_counting() -> None:
    with NotCounted():
        out = adapt({"audio": ["not audio"]}, output_type=TEXT)
    assert out == worker_pb2.MultimodalOutputs(output_type=TEXT)


# --- Payload conversion. -------------------------------------------------------------------------------


def one_payload(item: object, fmt: common_pb2.AudioFormat | None = None) -> common_pb2.AudioPayload:
    out = adapt_multimodal_outputs(
        {"audio": [item]}, output_type=AUDIO, batch_req_ids=["a"], audio_format=fmt
    )
    assert not out.sparse_audio and len(out.audio) == 1, out
    return out.audio[0]


def s16(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i2").tobytes()


FLOATS = [-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, -3.0, float("nan"), float("inf")]
FLOATS_S16 = [-32767, -16384, 0, 16384, 32767, 32767, -32767, 0, 32767]


@pytest.mark.parametrize("item", [b"\x01\x02", bytearray(b"\x01\x02"), memoryview(b"\x01\x02")], ids=repr)
def test_bytes_payloads_pass_through(item: object) -> None:
    assert one_payload(item).pcm == b"\x01\x02"


@pytest.mark.parametrize(
    "item",
    [
        np.asarray(FLOATS, dtype=np.float32),
        np.asarray(FLOATS, dtype=np.float64),
        torch.tensor(FLOATS, dtype=torch.float32),
        torch.tensor(FLOATS, dtype=torch.float64),
    ],
    ids=["np32", "np64", "torch32", "torch64"],
)
def test_float_payloads_become_clipped_s16le(item: object) -> None:
    assert one_payload(item).pcm == s16(FLOATS_S16)


def test_half_precision_tensor_converts() -> None:
    assert one_payload(torch.tensor([0.5, -1.0], dtype=torch.bfloat16)).pcm == s16([16384, -32767])


@pytest.mark.parametrize(
    "item",
    [
        np.asarray([1, -2, 32767], dtype=np.int16),
        np.asarray([1, -2, 32767], dtype=">i2"),
        torch.tensor([1, -2, 32767], dtype=torch.int16),
    ],
    ids=["np", "np_be", "torch"],
)
def test_int16_payloads_become_s16le(item: object) -> None:
    assert one_payload(item).pcm == s16([1, -2, 32767])


def test_f32le_stream_format_is_honoured_and_tagged() -> None:
    fmt = common_pb2.AudioFormat(
        encoding=common_pb2.AUDIO_ENCODING_PCM_F32LE, sample_rate_hz=16000, channels=1
    )
    p = one_payload(np.asarray([0.25, -2.0], dtype=np.float32), fmt)
    assert p.pcm == np.asarray([0.25, -1.0], dtype="<f4").tobytes()
    assert p.format == fmt
    p = one_payload(np.asarray([16384], dtype=np.int16), fmt)
    assert p.pcm == np.asarray([0.5], dtype="<f4").tobytes()


def test_s16le_stream_format_tags_every_payload() -> None:
    fmt = common_pb2.AudioFormat(
        encoding=common_pb2.AUDIO_ENCODING_PCM_S16LE, sample_rate_hz=24000, channels=1
    )
    assert one_payload(b"\x00\x00", fmt).format == fmt
    assert not one_payload(b"\x00\x00").HasField("format")


@pytest.mark.parametrize(
    ("item", "carrier", "fmt"),
    [
        ("ab", "payload_str", None),
        (1, "payload_int", None),
        ([0.5], "payload_list", None),
        (None, "payload_none", None),
        (np.zeros((2, 2), dtype=np.float32), "payload_shape", None),
        (torch.zeros(1, 4), "payload_shape", None),
        (np.zeros(4, dtype=np.int32), "payload_dtype", None),
        (torch.zeros(4, dtype=torch.int64), "payload_dtype", None),
        (b"\x01", "payload_frame", None),
        (b"\x01\x02", "payload_frame", common_pb2.AudioFormat(channels=2)),
        (torch.zeros(4, device="meta"), "payload_error", None),
    ],
    ids=repr,
)
def test_unusable_payload_fails_closed(
    item: object, carrier: str, fmt: common_pb2.AudioFormat | None
) -> None:
    with FailsClosed(SparseCause.ILLEGAL_PAYLOAD, carrier):
        out = adapt_multimodal_outputs(
            {"audio": [item]}, output_type=AUDIO, batch_req_ids=["a"], audio_format=fmt
        )
    assert_zero_audio(out)


@pytest.mark.parametrize(
    ("audio", "carrier"),
    [(torch.zeros(1, 4), "audio_tensor"), (np.zeros((1, 4)), "audio_ndarray"), (b"ab", "audio_bytes")],
    ids=repr,
)
def test_audio_that_is_not_a_list_fails_closed(audio: object, carrier: str) -> None:
    with FailsClosed(SparseCause.ILLEGAL_PAYLOAD, carrier):
        out = adapt({"audio": audio}, batch=["a"])
    assert_zero_audio(out)


def test_audio_tuple_is_accepted() -> None:
    out = adapt({"audio": (pcm("a"),)}, batch=["a"])
    assert [p.pcm for p in out.audio] == [pcm("a")]
