"""What one ``WorkerCommand`` carries, in the form its worker reads: APPENDs as columns
(``AppendColumns``) where the worker says it reads them (``WorkerDescription.append_columns``),
the rest as ``Submission`` rows.

The worker applies a command's aborts, then its columns, then its rows, then its releases. An
APPEND goes into the columns only where that keeps its session's order: no earlier submission
of the same session in this command is a row, and it carries no ``params`` (options apply in
order with the work around them). Anything the columns cannot say exactly (PCM that is not whole
frames) stays a row, for the worker to refuse with its usual error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from duplex.audio import PcmFormat
from duplex.v1 import worker_pb2

_APPEND = worker_pb2.SUBMISSION_KIND_APPEND

#: Submissions the worker applies as they come (not model steps).
CONTROL = frozenset(
    {
        worker_pb2.SUBMISSION_KIND_COMMIT,
        worker_pb2.SUBMISSION_KIND_RESPOND,
        worker_pb2.SUBMISSION_KIND_CLEAR,
        worker_pb2.SUBMISSION_KIND_TEXT,
    }
)


@dataclass(slots=True)
class Pending:
    """What a link's next WorkerCommand carries, and the futures of the submissions in it."""

    submit: list[worker_pb2.Submission] = field(default_factory=list)
    futures: list[asyncio.Future[None]] = field(default_factory=list)
    abort: list[worker_pb2.Abort] = field(default_factory=list)
    release: list[worker_pb2.Release] = field(default_factory=list)
    prompt: bool = False
    """A submission in it is answered to its client once written (an ``input_ack``, not one
    carried on output): against a worker that says ``commands_applied`` it goes at the mid-tick
    write point too, not only at the tick's (acks would otherwise wait up to a whole period)."""
    urgent: bool = False
    """A COMMIT, RESPOND or CLEAR is in it, for a worker that does not say ``commands_applied``:
    written at once, not at the tick's write point (a RESPOND's reply starts sooner; the worker
    applies control work as it comes)."""


def frame_bytes_of(desc: worker_pb2.WorkerDescription) -> int:
    """Bytes of one model frame of s16 PCM on the worker's stream; 0 when the worker does not
    read APPENDs in columns (or does not say its frame), so every submission stays a row."""
    if not desc.append_columns:
        return 0
    return desc.frame_samples * PcmFormat.from_proto(desc.audio_format).frame_bytes


def build_command(
    submit: Sequence[worker_pb2.Submission],
    abort: Sequence[worker_pb2.Abort],
    release: Sequence[worker_pb2.Release],
    *,
    frame_bytes: int,
) -> worker_pb2.WorkerCommand:
    """One command of ``submit``, ``abort`` and ``release``; with ``frame_bytes`` (the worker
    reads columns) its APPENDs in columns where the module's rule allows."""
    if not frame_bytes or not submit:
        return worker_pb2.WorkerCommand(submit=submit, abort=abort, release=release)
    rows: list[worker_pb2.Submission] = []
    in_rows: set[str] = set()
    request_id: list[str] = []
    session_id: list[str] = []
    epoch: list[int] = []
    turn_id: list[int] = []
    seq: list[int] = []
    frames: list[int] = []
    pcm: list[bytes] = []
    replay: list[bool] = []
    for sub in submit:
        fence = sub.fence
        sid = fence.session_id
        data = sub.pcm if sub.kind == _APPEND else b""
        if not data or len(data) % frame_bytes or sid in in_rows or sub.HasField("params"):
            rows.append(sub)
            in_rows.add(sid)
            continue
        request_id.append(sub.request_id)
        session_id.append(sid)
        epoch.append(fence.epoch)
        turn_id.append(fence.turn_id)
        seq.append(sub.seq)
        frames.append(len(data) // frame_bytes)
        pcm.append(data)
        replay.append(sub.replay)
    cmd = worker_pb2.WorkerCommand(submit=rows, abort=abort, release=release)
    if request_id:
        cols = cmd.appends
        cols.request_id.extend(request_id)
        cols.session_id.extend(session_id)
        cols.epoch.extend(epoch)
        cols.turn_id.extend(turn_id)
        cols.seq.extend(seq)
        cols.frames.extend(frames)
        cols.pcm = b"".join(pcm)
        if any(replay):
            cols.replay.extend(replay)
    return cmd
