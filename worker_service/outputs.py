"""Engine results become ``StepOutput`` messages, on the way out to each owner.

Conversion happens in the owner's stream writer, after the step and as late as possible: output
stepped under a fence the session has since moved past (an older epoch, another owner now) is
stripped first and counted ``stale_output``, so once an abort or a takeover is processed no
older output reaches the owner, even if the engine stepped it a moment before. News of input
that outlived the owner's cancel (``FenceTable.input_current``: its consumption, VAD events and
turn ends) still goes, stripped of anything of the reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from duplex.fence import Fence
from duplex.v1 import common_pb2, worker_pb2
from worker_service.engine_types import OwnerStep, Update
from worker_service.fencing import FenceTable
from worker_service.metrics import FENCED, REQUEST_ERRORS

_NO_AUDIO = common_pb2.AudioPayload()
"""The payload a dense step keeps for a request whose input news goes and whose audio does not."""


def to_proto(
    fences: FenceTable, owner: str, item: OwnerStep, *, columns: bool = False
) -> worker_pb2.StepOutput | None:
    """Convert one owner's step, stripping output of fences the session has moved past.
    ``columns``: the owner reads ``StepOutput.columns`` (``WorkerCommand.step_columns``), so
    the batch and its acks go as arrays, not a message per request."""
    if item.held:
        return held_proto(fences, owner, item)
    is_current = fences.is_current
    if item.step:
        stale = {rid for rid, f in item.batch if not is_current(f.session_id, f.epoch, owner)}
        if stale:
            item = strip(
                item,
                stale,
                lambda f: is_current(f.session_id, f.epoch, owner),
                lambda f: fences.input_current(f.session_id, f.epoch, owner),
            )
            if not item.batch and not item.updates:
                return None
    out = worker_pb2.StepOutput(step=item.step)
    if columns:
        _columns(out.columns, item)
    else:
        for rid, fence in item.batch:
            fence.write_to(out.batch.add(request_id=rid).fence)
    if item.step:
        if item.next_tick_at:
            out.next_tick_us = max(0, int((item.next_tick_at - time.monotonic()) * 1e6))
            out.commands_applied = item.commands_applied
        mm = out.outputs
        mm.output_type = item.output_type
        mm.sparse_audio = item.sparse
        mm.req_id.extend(item.audio_ids)
        mm.audio.extend(item.audio)
    if columns or not any(item.input_seq):
        for upd in item.updates:
            _update(out.updates.add(request_id=upd.request_id), upd, 0)
    else:
        _rows(out, item)
    return out


def _rows(out: worker_pb2.StepOutput, item: OwnerStep) -> None:
    """The row form of a step's updates: a request's ack rides in its update with news, or goes
    alone; one update per request, in batch order, as the engine made them."""
    news: dict[str, list[Update]] = {}
    for upd in item.updates:
        news.setdefault(upd.request_id, []).append(upd)
    for (rid, fence), seq in zip(item.batch, item.input_seq, strict=True):
        mine = news.pop(rid, None)
        if mine is not None:
            for i, upd in enumerate(mine):
                _update(out.updates.add(request_id=rid), upd, seq if i == 0 else 0)
        elif seq:
            fence.write_to(out.updates.add(request_id=rid, input_seq=seq).fence)
    for rest in news.values():
        for upd in rest:
            _update(out.updates.add(request_id=upd.request_id), upd, 0)


def _columns(cols: worker_pb2.StepColumns, item: OwnerStep) -> None:
    """The batch and its acks as arrays (one pass; a call per column, not per request)."""
    rids: list[str] = []
    sids: list[str] = []
    epochs: list[int] = []
    turns: list[int] = []
    for rid, fence in item.batch:
        rids.append(rid)
        sids.append(fence.session_id)
        epochs.append(fence.epoch)
        turns.append(fence.turn_id)
    cols.request_id.extend(rids)
    cols.session_id.extend(sids)
    cols.epoch.extend(epochs)
    cols.turn_id.extend(turns)
    cols.input_seq.extend(item.input_seq)


def _update(ru: worker_pb2.RequestUpdate, upd: Update, input_seq: int) -> None:
    upd.fence.write_to(ru.fence)
    if upd.error is not None:
        REQUEST_ERRORS.labels(code=upd.error[0]).inc()
        ru.error.code, ru.error.message = upd.error
        return
    # Only what is set: most updates carry little, and each field set is a call.
    if input_seq:
        ru.input_seq = input_seq
    for kind, offset in upd.vad:
        ru.vad.add(kind=kind, sample_offset=offset)
    if upd.text:
        ru.text = upd.text
    if upd.turn_ended:
        ru.turn_ended = True
        ru.committed_samples = upd.committed_samples
    elif upd.committed_samples:
        ru.committed_samples = upd.committed_samples
    if upd.response_started:
        ru.response_started = True
    if upd.response_finished:
        ru.response_finished = True
    if upd.user_text:
        ru.user_text = upd.user_text
    if upd.user_transcript is not None:
        ru.user_transcript = upd.user_transcript
    for call in upd.tool_calls:
        ru.tool_calls.add(call_id=call.call_id, name=call.name, arguments=call.arguments, done=call.done)


def held_proto(fences: FenceTable, owner: str, item: OwnerStep) -> worker_pb2.StepOutput | None:
    """A reconciliation list: the listed sessions still held for ``owner``, at their fences
    now (a session released or taken over since the list was made is left out)."""
    out = worker_pb2.StepOutput(step=0)
    for sid in item.held:
        cur = fences.current(sid)
        if cur is not None and cur[1] == owner:
            out.held_sessions.add(session_id=sid, epoch=cur[0])
    return out if out.held_sessions else None


def strip(
    item: OwnerStep,
    stale: set[str],
    is_current: Callable[[Fence], bool],
    input_current: Callable[[Fence], bool] = lambda _f: False,
) -> OwnerStep:
    """``item`` without the ``stale`` requests' batch entries, audio and updates (counted), and
    without updates whose fence is no longer current; but a stale request whose input is still
    current (``input_current``: it outlived the owner's cancel) keeps its batch entry, its ack
    and the input news of its updates."""
    FENCED.labels(reason="stale_output").inc(len(stale))
    keep = [i for i, (rid, f) in enumerate(item.batch) if rid not in stale or input_current(f)]
    out = OwnerStep(
        step=item.step,
        output_type=item.output_type,
        sparse=item.sparse,
        next_tick_at=item.next_tick_at,
        commands_applied=item.commands_applied,
    )
    out.batch = [item.batch[i] for i in keep]
    out.input_seq = [item.input_seq[i] for i in keep]
    if item.sparse:
        pairs = [(rid, p) for rid, p in zip(item.audio_ids, item.audio, strict=True) if rid not in stale]
        out.audio_ids = [rid for rid, _ in pairs]
        out.audio = [p for _, p in pairs]
    elif item.audio:
        # Dense audio is aligned to the batch: a kept stale entry gets an empty payload.
        out.audio = [item.audio[i] if item.batch[i][0] not in stale else _NO_AUDIO for i in keep]
    out.updates = []
    for u in item.updates:
        if u.request_id not in stale and is_current(u.fence):
            out.updates.append(u)
        elif input_current(u.fence) and (news := _input_news(u)) is not None:
            out.updates.append(news)
    return out


def _input_news(u: Update) -> Update | None:
    """What of ``u`` is news of input (its consumption, VAD events, a turn end), without anything
    of a reply (text, its start and end) or an error of its own; None when nothing is left."""
    heard = u.user_text or u.user_transcript is not None
    if u.error is not None or not (u.vad or u.turn_ended or u.committed_samples or u.input_seq or heard):
        return None
    return Update(
        u.request_id,
        u.fence,
        vad=u.vad,
        input_seq=u.input_seq,
        turn_ended=u.turn_ended,
        committed_samples=u.committed_samples,
        user_text=u.user_text,
        user_transcript=u.user_transcript,
    )
