"""APPENDs in columns (``WorkerCommand.appends``) over gRPC against the real worker: fenced and
validated entry by entry like submissions, applied before the command's rows, and a column set
that does not line up refused as a whole."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from duplex.errors import from_rpc_error
from duplex.v1 import worker_pb2
from tests.worker_helpers import COMMIT, FRAME, RunClient, acks_of, error_codes, pcm, sub, updates_of, worker

SILENCE = pcm(np.zeros(FRAME, np.float32))


async def _attach(stub, session: str, owner: str, epoch: int = 1) -> None:
    await stub.Attach(worker_pb2.AttachRequest(session_id=session, epoch=epoch, owner=owner), timeout=5)


def _columns(*entries: tuple[str, str, int, int]) -> worker_pb2.AppendColumns:
    """(request id, session id, epoch, frames) each, seq 1, turn 0, silence."""
    cols = worker_pb2.AppendColumns()
    for rid, sid, epoch, frames in entries:
        cols.request_id.append(rid)
        cols.session_id.append(sid)
        cols.epoch.append(epoch)
        cols.turn_id.append(0)
        cols.seq.append(1)
        cols.frames.append(frames)
    cols.pcm = SILENCE * sum(e[3] for e in entries)
    return cols


async def test_appends_in_columns_are_fenced_and_answered_one_by_one_before_the_rows() -> None:
    async with worker() as (_, stub):
        for sid, epoch in (("s1", 1), ("s2", 1), ("s4", 3)):
            await _attach(stub, sid, "o1", epoch)
        run = RunClient(stub, "o1")
        cols = _columns(
            ("r1", "s1", 1, 2),
            ("r2", "s2", 1, 1),
            ("r3", "s3", 1, 1),  # never attached
            ("r4", "s4", 2, 1),  # below the session's epoch
            ("", "s1", 1, 1),  # no request id
            ("r6", "s2", 1, 0),  # no frame
            ("r7", "s1" * 200, 1, 1),  # an id over the bound
        )
        # The COMMIT of s1 is a row of the same command: applied after its APPEND in the columns.
        commit = sub("r1", "s1", COMMIT)
        run._out.put_nowait(worker_pb2.WorkerCommand(appends=cols, submit=[commit]))
        msgs = await run.until(lambda m: any(u.committed_samples for u in m.updates))
        msgs += await run.quiet(0.3)
        assert acks_of(msgs, "r1") == [1] and acks_of(msgs, "r2") == [1]
        assert [u.committed_samples for u in updates_of(msgs, "r1") if u.committed_samples] == [2 * FRAME]
        assert error_codes(msgs, "r3") == ["unknown_session"]
        assert error_codes(msgs, "r4") == ["stale_epoch"]
        assert error_codes(msgs, "") == ["bad_submission"]
        assert error_codes(msgs, "r6") == ["bad_submission"]
        assert error_codes(msgs, "r7") == ["bad_submission"]
        refused = next(u for u in updates_of(msgs, "r4") if u.error.code)
        assert (refused.fence.session_id, refused.fence.epoch) == ("s4", 2)
        # Nothing of a refused entry ran: its session got no step.
        assert not acks_of(msgs, "r3") and not acks_of(msgs, "r4") and not acks_of(msgs, "r6")
        run.close()


async def _ended_by(cols: worker_pb2.AppendColumns) -> tuple[grpc.StatusCode, str, str]:
    async with worker() as (_, stub):
        await _attach(stub, "s1", "o1")
        call = stub.Run()
        await call.write(worker_pb2.WorkerCommand(owner="o1"))
        await call.write(worker_pb2.WorkerCommand(appends=cols))
        try:
            while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code(), from_rpc_error(err).code, err.details() or ""
        raise AssertionError("the Run stream ended without an error")


async def test_columns_that_do_not_line_up_end_the_run_stream() -> None:
    uneven = _columns(("r1", "s1", 1, 1))
    uneven.seq.append(2)
    code, duplex_code, details = await _ended_by(uneven)
    assert (code, duplex_code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
    assert "unequal lengths" in details
    short = _columns(("r1", "s1", 1, 2))
    short.pcm = short.pcm[:-2]
    code, duplex_code, details = await _ended_by(short)
    assert (code, duplex_code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
    assert "for 2 frames" in details


async def test_the_worker_says_it_reads_appends_in_columns() -> None:
    async with worker() as (_, stub):
        desc = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
        assert desc.append_columns
