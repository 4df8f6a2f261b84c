"""Routes one worker step's audio payloads to the requests they belong to.

The typed ``MultimodalOutputs`` can still be out of contract (a worker bug, a skewed version):
``duplex.sparse.typed_audio_payloads`` is the one check of it, shared with the worker's engine.
A declaration that does not line up on an AUDIO step FAILS CLOSED: the step routes no payload
at all, since guessing would give one caller's audio to another. A sparse payload naming a
request outside the batch (one already gone) is dropped and counted; the others still route, as
each names its own request. Non-audio steps never consult the sparse declaration.

This runs once per step per owner, so it does dict and set work only and never copies PCM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from duplex.sparse import (
    FailClosedReporter,
    InvalidSparseDeclaration,
    SparseCause,
    record_fail_closed,
    typed_audio_payloads,
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


def route_step(
    step: worker_pb2.StepOutput,
    batch_ids: tuple[str, ...] | None = None,
    *,
    reporter: FailClosedReporter | None = None,
) -> RoutedStep:
    """Route ``step``'s payloads; never raises for a bad declaration (it fails closed).
    ``batch_ids``: the step's requests in batch order, when the caller read them already (from
    ``StepOutput.columns`` or ``batch``); else they are read from ``batch``."""
    if batch_ids is None:
        batch_ids = tuple(entry.request_id for entry in step.batch)
    outputs = step.outputs
    if outputs.output_type != _AUDIO:
        # Dense by definition: the sparse fields are not even read.
        return RoutedStep(_NO_PAYLOADS, batch_ids, sparse=False, failed_closed=None)
    try:
        payloads = typed_audio_payloads(outputs, batch_ids)
    except InvalidSparseDeclaration as err:
        record_fail_closed(err, site=_SITE, reporter=reporter)
        return RoutedStep(_NO_PAYLOADS, (), sparse=outputs.sparse_audio, failed_closed=err.cause)
    downstream = tuple(rid for rid in batch_ids if rid in payloads) if payloads else ()
    return RoutedStep(payloads, downstream, sparse=outputs.sparse_audio, failed_closed=None)
