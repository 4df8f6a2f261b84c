"""The engine's per-request state, and what a step hands each owner: news and audio.

The engine thread builds one ``OwnerStep`` per owner from a batched step: ``route_audio`` slices
the step's payloads per owner (sparse stays sparse), ``collect_news`` turns the model's per-request
news into updates (a replayed frame's VAD and text are not reported twice). Only the engine
thread calls these.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from duplex.errors import DuplexError, ErrorCode, WorkerErrorCode
from duplex.fence import Fence
from duplex.sparse import InvalidSparseDeclaration, record_fail_closed, typed_audio_payloads
from duplex.v1 import worker_pb2
from worker_service.engine_types import OwnerStep, QueueCounter, Update, Work
from worker_service.model import AUDIO, RequestNews, StepModel

logger = logging.getLogger("worker_service.engine")


@dataclass(slots=True, eq=False)
class Request:
    """One request as the engine thread holds it (only that thread touches it)."""

    session_id: str
    owner: str
    request_id: str
    state: Any
    counter: QueueCounter
    queue: deque[Work] = field(default_factory=deque)
    epoch: int = 0
    input_fence: Fence | None = None
    reply_fence: Fence | None = None
    seq_done: int = 0
    seq_reported: int = 0
    input_replay: bool = False
    """The frame taken last came from a replayed APPEND."""
    tick: int = 0
    """The frame clock's tick it last stepped in (a late join steps only those it did not)."""
    unanswered: int | None = None
    """The committed samples of a turn the model ended that no RESPOND, COMMIT or CLEAR has
    answered yet (None: none). Told again to an owner that takes the session over: the news
    may have gone to an owner that died before acting on it."""

    def input_frames(self) -> int:
        """Input frames queued (the queue is a few submissions long)."""
        return sum(len(w.frames) - w.pos for w in self.queue if w.frames is not None)


def model_failure(work: Work, exc: Exception) -> Update:
    """The error update of a work the model failed on (details are logged, not sent)."""
    if not isinstance(exc, DuplexError):
        logger.exception("model failed on a request", exc_info=exc)
        exc = DuplexError(ErrorCode.MODEL_ERROR, "the model failed on this request")
    return Update(work.request_id, work.fence, error=(exc.code, exc.message))


def collect_news(
    model: StepModel[Any],
    batch: list[Request],
    fences: list[Fence],
    replayed: list[bool],
    step_news: list[RequestNews | None],
    per_owner: dict[str, OwnerStep],
) -> None:
    """Each request's ack (the input it consumed, in ``OwnerStep.input_seq``, aligned to the
    batch the caller built in the same order) and news (an update to its owner); the news of a
    replayed frame was reported by the worker that first heard it."""
    if len(step_news) != len(batch):
        raise RuntimeError(f"model returned news for {len(step_news)} of {len(batch)} requests")
    for req, fence, was_replay, n in zip(batch, fences, replayed, step_news, strict=True):
        out = per_owner[req.owner]
        if n is not None and n.turn_ended:
            req.unanswered = n.committed_samples
        if was_replay and n is not None and n.error is None:
            # The worker that first consumed this input reported what the model heard in it.
            n.vad, n.text, n.turn_ended, n.committed_samples = [], "", False, 0
            n.user_text, n.user_transcript = "", None
            if not (n.response_started or n.response_finished):
                n = None
        if n is not None and n.error is not None:
            logger.warning("model error on a request: %s", n.error)
            out.input_seq.append(0)  # set alone: the input is reported once the request goes on
            error = (ErrorCode.MODEL_ERROR.value, "the model failed on this request")
            if n.error_code == WorkerErrorCode.UPSTREAM_UNAVAILABLE:
                error = (n.error_code, n.error)  # the model's own words: no detail of the failure
            out.updates.append(Update(req.request_id, fence, error=error))
            if req.reply_fence is not None:
                model.cancel_response(req.state)
            continue
        if req.seq_done != req.seq_reported:
            out.input_seq.append(req.seq_done)
            req.seq_reported = req.seq_done
        else:
            out.input_seq.append(0)
        if n is not None:
            out.updates.append(
                Update(
                    req.request_id,
                    fence,
                    vad=n.vad,
                    text=n.text,
                    turn_ended=n.turn_ended,
                    committed_samples=n.committed_samples,
                    response_started=n.response_started,
                    response_finished=n.response_finished,
                    user_text=n.user_text,
                    user_transcript=n.user_transcript,
                    tool_calls=n.tool_calls,
                )
            )


def route_audio(
    outputs: worker_pb2.MultimodalOutputs, batch: list[Request], per_owner: dict[str, OwnerStep]
) -> None:
    """Slice the step's payloads per owner (sparse stays sparse, dense keeps positions).

    A typed declaration that does not line up fails closed here like a legacy one does in
    the adapter (``duplex.sparse.typed_audio_payloads`` is the check the session service's
    router runs too): the step routes no payload at all.
    """
    if outputs.output_type != AUDIO:
        return
    try:
        payloads = typed_audio_payloads(outputs, [r.session_id for r in batch])
    except InvalidSparseDeclaration as err:
        record_fail_closed(err, site="worker_engine")
        for out in per_owner.values():
            out.sparse, out.audio_ids, out.audio = True, [], []
        return
    if not outputs.sparse_audio:
        for out in per_owner.values():
            out.sparse = False
        for req in batch:
            per_owner[req.owner].audio.append(payloads[req.session_id])
        return
    for req in batch:
        payload = payloads.get(req.session_id)
        if payload is not None:
            out = per_owner[req.owner]
            out.audio_ids.append(req.request_id)
            out.audio.append(payload)
