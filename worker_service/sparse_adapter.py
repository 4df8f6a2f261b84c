"""The one place that reads the legacy ``multimodal_outputs`` dict.

Model code written against vLLM-Omni's in-process contract returns a dict: payloads under
``"audio"`` and, for sparse steps, a declaration in ``meta.sparse_audio`` / ``meta.req_id``
(nested ``{"meta": {...}}`` and/or flattened ``{"meta.sparse_audio": ...}``). This module turns
it into the typed ``MultimodalOutputs`` the wire carries, with the contract's strict rules:

* the marker's legal carriers are a list of str or a bare str, truthy iff an item is one of
  ``1 true yes on`` (case-insensitive); ``None`` or absent means no marker;
* an illegal carrier (tensor, array, number, bool, a list with a non-str item, anything else) is
  rejected by its type alone, never read element-wise (no device sync, no producer code run);
* both encodings are read independently; an illegal carrier on either side wins over a valid
  other side; disagreeing markers or id lists, a marker without a usable id list, and duplicate
  ids are invalid;
* on an AUDIO step an invalid declaration fails closed (the zero-audio sparse shape: nothing is
  routed), is counted and reported; it never falls back to dense, which would give one
  request's audio to another;
* a non-audio step never consults the declaration at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from duplex.sparse import (
    FailClosedReporter,
    InvalidSparseDeclaration,
    SparseCause,
    carrier_kind,
    log_error_once,
    prefixed_carrier,
    record_fail_closed,
)
from duplex.v1 import common_pb2, worker_pb2

__all__ = ["adapt_multimodal_outputs"]

_AUDIO: Final = worker_pb2.OUTPUT_TYPE_AUDIO
_S16LE: Final = common_pb2.AUDIO_ENCODING_PCM_S16LE
_F32LE: Final = common_pb2.AUDIO_ENCODING_PCM_F32LE
_TRUTHY: Final = frozenset({"1", "true", "yes", "on"})
_SITE: Final = "worker_adapter"

_Dict = dict[str, object]


def adapt_multimodal_outputs(
    raw: object,
    *,
    output_type: worker_pb2.OutputType.ValueType,
    batch_req_ids: Sequence[str],
    audio_format: common_pb2.AudioFormat | None = None,
    reporter: FailClosedReporter | None = None,
) -> worker_pb2.MultimodalOutputs:
    """Convert a step's raw outputs into the typed ``MultimodalOutputs``.

    ``raw`` is a typed ``MultimodalOutputs`` (returned as is: a typed declaration is checked by
    ``duplex.sparse.typed_audio_payloads``, which the engine runs on every step before slicing
    it per owner and the session service's router runs again on what it receives), a legacy
    dict, or ``None`` (the step produced no outputs). ``output_type`` is the step's type.
    ``batch_req_ids`` is the step's batch, in order, that dense payloads align to.
    ``audio_format`` is the stream's PCM format: array payloads are encoded to it (s16le when
    absent) and every payload is tagged with it when given.

    Never raises for a bad declaration or payload: on an AUDIO step it fails closed.
    """
    if issubclass(type(raw), worker_pb2.MultimodalOutputs):
        return cast(worker_pb2.MultimodalOutputs, raw)
    if output_type != _AUDIO:
        return _adapt_non_audio(raw, output_type, audio_format)
    try:
        return _adapt_audio(raw, batch_req_ids, audio_format)
    except InvalidSparseDeclaration as err:
        record_fail_closed(err, site=_SITE, reporter=reporter)
        return _zero_audio()


def _zero_audio() -> worker_pb2.MultimodalOutputs:
    # The sparse shape with no request ids: a valid step that routes nothing.
    return worker_pb2.MultimodalOutputs(output_type=_AUDIO, sparse_audio=True)


def _adapt_non_audio(
    raw: object, otype: worker_pb2.OutputType.ValueType, fmt: common_pb2.AudioFormat | None
) -> worker_pb2.MultimodalOutputs:
    # The sparse declaration is deliberately not looked up: non-audio steps never consult it.
    out = worker_pb2.MultimodalOutputs(output_type=otype)
    if not issubclass(type(raw), dict):
        return out
    try:
        _fill_payloads(out, dict.get(cast(_Dict, raw), "audio"), fmt)
    except InvalidSparseDeclaration as err:
        # Logged, not counted: the fail-closed metrics are about AUDIO steps only.
        log_error_once(
            f"non_audio:{err.carrier}",
            "Unusable audio payload on a non-audio step (carrier=%s): payloads dropped. %s",
            err.carrier,
            err,
        )
        del out.audio[:]
    return out


def _adapt_audio(
    raw: object, batch_req_ids: Sequence[str], fmt: common_pb2.AudioFormat | None
) -> worker_pb2.MultimodalOutputs:
    if raw is None:
        return _zero_audio()
    if not issubclass(type(raw), dict):
        raise InvalidSparseDeclaration(
            SparseCause.ILLEGAL_OUTPUTS,
            prefixed_carrier("outputs_", raw),
            f"multimodal outputs must be a dict or MultimodalOutputs, got {_type_name(raw)}",
        )
    raw_dict = cast(_Dict, raw)
    req_ids = _resolve_req_ids(raw_dict)
    # dict.get, not raw.get: a dict subclass must not run its own code here.
    audio = _payload_list(dict.get(raw_dict, "audio"))
    out = worker_pb2.MultimodalOutputs(output_type=_AUDIO)
    if req_ids is not None:
        # Counts are checked before any conversion work is spent on a step that routes nothing.
        if len(audio) != len(req_ids):
            raise InvalidSparseDeclaration(
                SparseCause.LENGTH_MISMATCH,
                "payload_count",
                f"sparse step has {len(audio)} payloads for {len(req_ids)} request ids",
            )
        out.sparse_audio = True
        out.req_id.extend(req_ids)
    elif len(audio) != len(batch_req_ids):
        raise InvalidSparseDeclaration(
            SparseCause.DENSE_COUNT_MISMATCH,
            "payload_count",
            f"dense step has {len(audio)} payloads for a batch of {len(batch_req_ids)}",
        )
    _fill_payloads(out, audio, fmt)
    return out


def _type_name(value: object) -> str:
    # For log text only (never a label): the type's name, read from the type, not the value.
    return type(value).__qualname__


def _resolve_req_ids(raw: _Dict) -> list[str] | None:
    """The sparse request-id list, or None when the step is dense (no truthy marker)."""
    meta = dict.get(raw, "meta")
    if meta is not None and not issubclass(type(meta), dict):
        # A declaration may be inside; unreadable means it cannot be ruled out, so fail closed.
        raise InvalidSparseDeclaration(
            SparseCause.ILLEGAL_META,
            prefixed_carrier("meta_", meta),
            f"meta must be a dict, got {_type_name(meta)}",
        )
    meta_dict = cast(_Dict, meta) if meta is not None else {}
    nested_marker = dict.get(meta_dict, "sparse_audio")
    nested_ids = dict.get(meta_dict, "req_id")
    flat_marker = dict.get(raw, "meta.sparse_audio")
    flat_ids = dict.get(raw, "meta.req_id")

    # Both markers are classified, even when one alone would decide: an illegal carrier on
    # either side must fail closed rather than be masked by a valid other side.
    nested = _marker_is_set(nested_marker, "nested")
    flat = _marker_is_set(flat_marker, "flattened")
    if nested_marker is not None and flat_marker is not None and nested != flat:
        raise InvalidSparseDeclaration(
            SparseCause.MARKER_CONFLICT, "marker_conflict", "nested and flattened sparse markers disagree"
        )
    if not (nested or flat):
        return None

    lists = [
        _req_id_list(value, side)
        for side, value in (("nested", nested_ids), ("flattened", flat_ids))
        if value is not None
    ]
    if not lists:
        raise InvalidSparseDeclaration(
            SparseCause.UNUSABLE_REQ_IDS, "req_id_missing", "sparse marker set without meta.req_id"
        )
    req_ids = lists[0]
    if len(lists) == 2 and lists[1] != req_ids:
        raise InvalidSparseDeclaration(
            SparseCause.REQ_ID_CONFLICT,
            "req_id_conflict",
            "nested and flattened sparse request-id lists disagree",
        )
    if len(set(req_ids)) != len(req_ids):
        raise InvalidSparseDeclaration(
            SparseCause.DUPLICATE_REQ_IDS,
            "req_id_duplicate",
            "sparse request-id list names a request more than once",
        )
    return req_ids


def _marker_is_set(value: object, side: str) -> bool:
    """Classify one marker carrier: legal carriers by content, anything else by type alone."""
    if value is None:
        return False
    # str.lower(value), not value.lower(): a str subclass must not run its own code.
    if issubclass(type(value), str):
        return str.lower(cast(str, value)) in _TRUTHY
    if type(value) is list:
        # An exact list iterates with list's own C code, and items are checked by type alone.
        if all(issubclass(type(item), str) for item in value):
            return any(str.lower(item) in _TRUTHY for item in value)
        kind = "list_non_str"
    else:
        kind = carrier_kind(value)
    raise InvalidSparseDeclaration(
        SparseCause.ILLEGAL_MARKER,
        kind,
        f"illegal {side} sparse-audio marker carrier {_type_name(value)}: "
        'it must be a list of strings (e.g. ["1"]) or a string',
    )


def _req_id_list(value: object, side: str) -> list[str]:
    if type(value) is list and all(issubclass(type(item), str) for item in value):
        # Copied as plain str: a str subclass could override hashing or equality used below.
        return [str.__str__(item) for item in value]
    carrier = "req_id_list_non_str" if type(value) is list else prefixed_carrier("req_id_", value)
    raise InvalidSparseDeclaration(
        SparseCause.UNUSABLE_REQ_IDS,
        carrier,
        f"sparse marker set but the {side} meta.req_id is {_type_name(value)}, not a list of str",
    )


def _payload_list(audio: object) -> Sequence[object]:
    if audio is None:
        return ()
    if type(audio) is list or type(audio) is tuple:
        return cast(Sequence[object], audio)
    raise InvalidSparseDeclaration(
        SparseCause.ILLEGAL_PAYLOAD,
        prefixed_carrier("audio_", audio),
        f'"audio" must be a list of payloads, got {_type_name(audio)}',
    )


def _fill_payloads(
    out: worker_pb2.MultimodalOutputs, audio: object, fmt: common_pb2.AudioFormat | None
) -> None:
    items = _payload_list(audio)
    encoding = fmt.encoding if fmt is not None and fmt.encoding else _S16LE
    frame_bytes = (4 if encoding == _F32LE else 2) * (fmt.channels if fmt is not None and fmt.channels else 1)
    for item in items:
        pcm = _to_pcm(item, encoding)
        if len(pcm) % frame_bytes:
            raise InvalidSparseDeclaration(
                SparseCause.ILLEGAL_PAYLOAD,
                "payload_frame",
                f"payload of {len(pcm)} bytes is not a whole number of {frame_bytes}-byte frames",
            )
        payload = out.audio.add(pcm=pcm)
        if fmt is not None:
            payload.format.CopyFrom(fmt)


def _to_pcm(item: object, encoding: common_pb2.AudioEncoding.ValueType) -> bytes:
    kind = carrier_kind(item)
    if kind == "bytes":
        # Bytes are taken to be in the stream's format already.
        return bytes(cast(bytes, item))
    if kind not in ("tensor", "ndarray"):
        raise InvalidSparseDeclaration(
            SparseCause.ILLEGAL_PAYLOAD,
            "payload_" + kind,
            f"audio payload must be bytes, a numpy array or a torch tensor, got {_type_name(item)}",
        )
    try:
        arr = _tensor_to_numpy(item) if kind == "tensor" else item
        return _encode(cast(npt.NDArray[Any], arr), encoding)
    except InvalidSparseDeclaration:
        raise
    except Exception as exc:
        # A payload the engine cannot convert (e.g. on a meta device) must cost the step, never
        # the engine thread.
        raise InvalidSparseDeclaration(
            SparseCause.ILLEGAL_PAYLOAD,
            "payload_error",
            f"converting a {_type_name(item)} payload failed: {type(exc).__name__}",
        ) from exc


def _tensor_to_numpy(item: object) -> npt.NDArray[Any]:
    import torch  # already imported: the item is a tensor

    assert isinstance(item, torch.Tensor)
    t = item.detach()
    if t.is_floating_point():
        # bfloat16 and float16 have no (or a lossy) numpy path; float32 is what PCM needs.
        t = t.to(dtype=torch.float32)
    return t.cpu().numpy()


def _encode(arr: npt.NDArray[Any], encoding: common_pb2.AudioEncoding.ValueType) -> bytes:
    if arr.ndim != 1:
        raise InvalidSparseDeclaration(
            SparseCause.ILLEGAL_PAYLOAD, "payload_shape", f"audio payload must be 1-D, got {arr.ndim}-D"
        )
    if arr.dtype.kind == "f":
        # NaN/inf would become arbitrary int16 values: map them into range before scaling.
        x = np.clip(
            np.nan_to_num(arr.astype(np.float32, copy=False), nan=0.0, posinf=1.0, neginf=-1.0), -1, 1
        )
        if encoding == _F32LE:
            return bytes(x.astype("<f4", copy=False).tobytes())
        return bytes(np.rint(x * 32767.0).astype("<i2").tobytes())
    if arr.dtype.kind == "i" and arr.dtype.itemsize == 2:  # int16 of either byte order
        if encoding == _F32LE:
            return bytes((arr.astype("<f4") / np.float32(32768.0)).tobytes())
        return bytes(arr.astype("<i2", copy=False).tobytes())
    raise InvalidSparseDeclaration(
        SparseCause.ILLEGAL_PAYLOAD,
        "payload_dtype",
        f"audio payload dtype must be floating (in [-1, 1]) or int16, got {arr.dtype}",
    )
