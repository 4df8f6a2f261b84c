"""Routes one worker step's audio payloads to the requests they belong to.

The typed ``MultimodalOutputs`` can still be out of contract (a worker bug, a skewed version):
sparse with ``req_id`` and ``audio`` of different lengths, duplicate ids, dense with a payload
count other than the batch size, or a batch that names a request twice. Any of these on an AUDIO
step FAILS CLOSED: the step routes no payload at all, since guessing would give one caller's
audio to another. A sparse payload naming a request outside the batch (one already gone) is
dropped and counted; the others still route, as each names its own request. Non-audio steps
never consult the sparse declaration.

This runs once per step per owner, so it does dict and set work only and never copies PCM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from duplex.sparse import (
    UNKNOWN_REQUEST_TOTAL,
    FailClosedReporter,
    InvalidSparseDeclaration,
    SparseCause,
    record_fail_closed,
)
from duplex.v1 import common_pb2, worker_pb2

__all__ = ["RoutedStep", "route_step"]

_AUDIO: Final = worker_pb2.OUTPUT_TYPE_AUDIO
_SITE: Final = "session_router"
_NO_PAYLOADS: Final[Mapping[str, common_pb2.AudioPayload]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RoutedStep:
    """Where one step's audio goes."""

    # Request id -> its audio this step; only ids in the step's batch.
    payloads: Mapping[str, common_pb2.AudioPayload]
    # The requests to deliver this step to, in batch order.
    downstream_req_ids: tuple[str, ...]
    # Whether the step was routed by its sparse declaration.
    sparse: bool
    # Set when the step's declaration was invalid and nothing was routed.
    failed_closed: SparseCause | None


def route_step(step: worker_pb2.StepOutput, *, reporter: FailClosedReporter | None = None) -> RoutedStep:
    """Route ``step``'s payloads; never raises for a bad declaration (it fails closed)."""
    batch_ids = tuple(entry.request_id for entry in step.batch)
    outputs = step.outputs
    if outputs.output_type != _AUDIO:
        # Dense by definition: the sparse fields are not even read.
        return RoutedStep(_NO_PAYLOADS, batch_ids, sparse=False, failed_closed=None)
    try:
        return _route_audio(outputs, batch_ids)
    except InvalidSparseDeclaration as err:
        record_fail_closed(err, site=_SITE, reporter=reporter)
        return RoutedStep(_NO_PAYLOADS, (), sparse=outputs.sparse_audio, failed_closed=err.cause)


def _route_audio(outputs: worker_pb2.MultimodalOutputs, batch_ids: tuple[str, ...]) -> RoutedStep:
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
        return RoutedStep(
            dict(zip(batch_ids, audio, strict=True)), batch_ids, sparse=False, failed_closed=None
        )

    req_ids = outputs.req_id
    if len(req_ids) != len(audio):
        raise InvalidSparseDeclaration(
            SparseCause.LENGTH_MISMATCH,
            "typed",
            f"sparse step has {len(audio)} payloads for {len(req_ids)} request ids",
        )
    # Each payload names its own request, so a payload for a request that is gone is dropped
    # alone; the rest still route.
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
    downstream = tuple(rid for rid in batch_ids if rid in payloads) if payloads else ()
    return RoutedStep(payloads, downstream, sparse=True, failed_closed=None)
