"""State nobody owns, and bad input, at the worker (in process, over gRPC): a new Run stream lists
what the worker holds for its owner, an Attach nobody uses expires, the session limit is finite
and refused retryably, and non-finite or wrong-typed ``params`` fail only their request."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import numpy as np
import pytest

from duplex.errors import DuplexError, ErrorCode, from_rpc_error
from duplex.v1 import worker_pb2, worker_pb2_grpc
from tests.session_helpers import sample
from tests.worker_helpers import (
    APPEND,
    FRAME,
    RunClient,
    error_codes,
    fence,
    pcm,
    sub,
    updates_of,
    wait_until,
    worker,
)
from worker_service.cli import build_parser, config_from_args
from worker_service.config import DEFAULT_MAX_SESSIONS, WorkerConfig
from worker_service.model import float_option, options_from_struct
from worker_service.models.synthetic import SyntheticOptions

RELEASED = "duplex_worker_orphaned_sessions_released_total"
LEASES = "duplex_worker_attach_leases_expired_total"


async def attach(stub: worker_pb2_grpc.DuplexWorkerStub, session: str, owner: str, epoch: int = 1) -> int:
    resp = await stub.Attach(
        worker_pb2.AttachRequest(session_id=session, epoch=epoch, owner=owner), timeout=5
    )
    return int(resp.epoch)


def noise(frames: int, seed: int = 0) -> bytes:
    return pcm((np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.2).astype(np.float32))


def consumed(request_id: str, seq: int):  # type: ignore[no-untyped-def]
    return lambda m: any(u.request_id == request_id and u.input_seq == seq for u in m.updates)


# ---- reconciliation: what a new Run stream is told ----------------------------------------------


async def test_a_new_run_stream_lists_what_the_worker_holds_for_its_owner() -> None:
    async with worker() as (server, stub):
        await attach(stub, "s1", "o1")
        await attach(stub, "s2", "o1", epoch=4)
        await attach(stub, "s3", "o2")
        one = RunClient(stub, "o1")
        assert sorted(await one.held_list()) == [("s1", 1), ("s2", 4)]
        two = RunClient(stub, "o2")
        assert await two.held_list() == [("s3", 1)]
        # An owner that holds nothing gets no list: its first message is its own news.
        three = RunClient(stub, "o3")
        three.send(sub("r9", "nope", APPEND, seq=1, data=noise(1)))
        first = await three.call.read()
        assert not first.held_sessions and error_codes([first], "r9") == ["unknown_session"]
        # The stream's first command is applied first: what it releases is not listed.
        one.close()
        await wait_until(lambda: sorted(server.owners()) == ["o2", "o3"])
        again = RunClient(stub, "o1", releases=(worker_pb2.Release(request_id="s1", fence=fence("s1", 1)),))
        assert await again.held_list() == [("s2", 4)]
        assert server.fences.owner_of("s1") is None
        for run in (two, three, again):
            run.close()


async def test_a_reconnecting_owner_releases_what_it_no_longer_holds() -> None:
    """The owner lost its stream and came back within the orphan grace (the worker no longer
    reaps its sessions): the list lets it release the one it closed meanwhile, exactly; the one
    it still holds goes on, model state and all."""
    async with worker(orphan_grace_s=60) as (server, stub):
        for s in ("gone", "kept"):
            await attach(stub, s, "o1")
        run = RunClient(stub, "o1")
        run.send(
            sub("gone", "gone", APPEND, seq=1, data=noise(2)),
            sub("kept", "kept", APPEND, seq=1, data=noise(2)),
        )
        seen: set[str] = set()

        def both(m: worker_pb2.StepOutput) -> bool:
            seen.update(u.request_id for u in m.updates if u.input_seq == 1)
            return seen >= {"gone", "kept"}

        await run.until(both)
        await wait_until(lambda: server.engine.active_requests == 2)
        run.close()
        await wait_until(lambda: server.owners() == [])
        back = RunClient(stub, "o1")
        held = {sid: epoch for sid, epoch in await back.held_list()}
        assert held == {"gone": 1, "kept": 1}
        # The owner releases what it no longer holds, echoing the listed fence.
        back.send(releases=(worker_pb2.Release(request_id="gone", fence=fence("gone", held["gone"])),))
        await wait_until(lambda: server.engine.active_requests == 1)
        assert server.fences.owner_of("gone") is None and server.fences.owner_of("kept") == "o1"
        back.send(sub("kept", "kept", APPEND, seq=2, data=noise(1)))
        await back.until(consumed("kept", 2))
        back.close()


async def test_a_superseded_stream_does_not_lose_the_list() -> None:
    """A second stream of the same owner (the first one half-open) ends the first and gets the
    list itself."""
    async with worker() as (_, stub):
        await attach(stub, "s1", "o1")
        old = RunClient(stub, "o1")
        assert await old.held_list() == [("s1", 1)]
        new = RunClient(stub, "o1")
        assert await new.held_list() == [("s1", 1)]
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await old.call.read()
        assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        new.close()


# ---- attach leases -------------------------------------------------------------------------------


async def test_an_attach_nobody_uses_is_released_after_the_lease() -> None:
    released, leases = sample(RELEASED), sample(LEASES)
    # Long enough that an attach and the stream opened after it always meet within the lease,
    # on a loaded machine too (the lease is a timer on the same loop as the stream's callbacks).
    lease = 2.0
    async with worker(attach_lease_s=lease, orphan_grace_s=60) as (server, stub):
        # An owner with a Run stream is not affected, even if it never submits (a client may
        # open a session and say nothing for a while).
        live = RunClient(stub, "live")
        live.send(sub("x", "nope", APPEND, seq=1, data=noise(1)))
        await live.until(lambda m: bool(error_codes([m], "x")))  # the stream is open at the worker
        await attach(stub, "l1", "live")
        # An owner that attached, used the session and then lost its stream: the orphan grace
        # (not the lease) decides.
        await attach(stub, "c1", "claimed")
        claimed = RunClient(stub, "claimed")
        claimed.send(sub("c1", "c1", APPEND, seq=1, data=noise(1)))
        await claimed.until(consumed("c1", 1))
        claimed.close()
        # An owner that attached with no stream and opened one later (without submitting): it
        # knows what it holds (the stream's list told it).
        await attach(stub, "t1", "late")
        late = RunClient(stub, "late")
        assert await late.held_list() == [("t1", 1)]
        # An owner that never opens a stream: released once the lease is up.
        await attach(stub, "g1", "ghost")
        await wait_until(lambda: server.fences.owner_of("g1") is None, within=10)
        assert sample(LEASES) - leases == 1
        assert sample(RELEASED) - released == 1
        for sid, owner in (("l1", "live"), ("c1", "claimed"), ("t1", "late")):
            assert server.fences.owner_of(sid) == owner, sid
        assert server.fences.live_sessions == 3
        # Re-attaching restarts the lease; a submission on a stream opened later claims it.
        await attach(stub, "g2", "ghost")
        ghost = RunClient(stub, "ghost")
        assert await ghost.held_list() == [("g2", 1)]
        ghost.send(sub("g2", "g2", APPEND, seq=1, data=noise(1)))
        await ghost.until(consumed("g2", 1))
        ghost.close()
        await wait_until(lambda: "ghost" not in server.owners())
        await asyncio.sleep(lease + 0.3)  # past g2's lease: claimed, so the orphan grace decides
        assert server.fences.owner_of("g2") == "ghost"
        assert sample(LEASES) - leases == 1
        for run in (live, late):
            run.close()


def test_the_attach_lease_is_configurable() -> None:
    assert WorkerConfig().attach_lease_s == 30.0
    assert config_from_args(build_parser().parse_args(["--attach-lease-s", "2.5"])).attach_lease_s == 2.5
    assert config_from_args(build_parser().parse_args([])).attach_lease_s == 30.0
    with pytest.raises(ValueError, match="attach_lease_s"):
        WorkerConfig(attach_lease_s=-1)


# ---- the session limit ---------------------------------------------------------------------------


def test_the_session_limit_is_finite_by_default() -> None:
    assert DEFAULT_MAX_SESSIONS == 1024
    assert WorkerConfig().max_sessions == DEFAULT_MAX_SESSIONS
    assert config_from_args(build_parser().parse_args([])).max_sessions == DEFAULT_MAX_SESSIONS
    assert config_from_args(build_parser().parse_args(["--max-sessions", "0"])).max_sessions == 0
    assert "capacity_exhausted" in build_parser().format_help()


async def test_the_worker_refuses_beyond_its_session_limit_retryably() -> None:
    async with worker() as (_, stub):
        d = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
        assert d.max_sessions == DEFAULT_MAX_SESSIONS
    async with worker(max_sessions=2) as (server, stub):
        await attach(stub, "s1", "o1")
        await attach(stub, "s2", "o2")
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await attach(stub, "s3", "o1")
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = from_rpc_error(full.value)
        assert (err.code, err.retryable) == (ErrorCode.CAPACITY_EXHAUSTED, True)
        # What exists is kept: re-attaching a held session is no new session.
        assert await attach(stub, "s1", "o1") == 1
        # Room again once one is released.
        run = RunClient(stub, "o2")
        await run.held_list()
        run.send(releases=(worker_pb2.Release(request_id="s2", fence=fence("s2", 1)),))
        await wait_until(lambda: server.fences.live_sessions == 1)
        assert await attach(stub, "s3", "o1") == 1
        run.close()


# ---- non-finite and wrong-typed params ----------------------------------------------------------


BAD_PARAMS: list[dict[str, Any]] = [
    {"silence_ms": math.nan},
    {"silence_ms": math.inf},
    {"pitch_semitones": -math.inf},
    {"threshold": "0.5"},
    {"auto_commit": 1.0},
    {"threshold": True},
    {"silence_ms": {"nested": [1.0, math.nan]}},
    {"silence_ms": None},
    {"silence_ms": 1e308 * 10},
]


@pytest.mark.parametrize("params", BAD_PARAMS, ids=[repr(p) for p in BAD_PARAMS])
async def test_bad_params_fail_only_their_request(params: dict[str, Any]) -> None:
    async with worker() as (_, stub):
        for s in ("s1", "s2"):
            await attach(stub, s, "o1")
        run = RunClient(stub, "o1")
        await run.held_list()
        # One command: the bad submission and another session's good one.
        run.send(
            sub("r1", "s1", APPEND, seq=1, data=noise(1), params=params),
            sub("r2", "s2", APPEND, seq=1, data=noise(1)),
        )
        # The rejection comes first (answered on command handling), the engine's step after it.
        got = await run.until(consumed("r2", 1))
        assert error_codes(got, "r1") == ["bad_submission"]
        assert not error_codes(got, "r2")
        # The stream and the refused session go on.
        run.send(sub("r1", "s1", APPEND, seq=1, data=noise(1), params={"silence_ms": 400.0}))
        after = await run.until(consumed("r1", 1))
        assert not error_codes(after, "r1")
        assert not [u for u in updates_of(after, "r2") if u.error.code]
        run.close()


def test_every_option_parser_refuses_non_finite_numbers() -> None:
    for value in (math.nan, math.inf, -math.inf, 10**400):
        with pytest.raises(DuplexError) as err:
            float_option({"x": value}, "x", 1.0, 0.0, 2.0)
        assert err.value.code == "bad_submission"
        with pytest.raises(DuplexError):
            SyntheticOptions.parse({"emit_every": value}, SyntheticOptions())
    from google.protobuf import struct_pb2

    st = struct_pb2.Struct()
    st.update({"a": 1.5, "b": [True, "x", None, {"c": 2.0}]})
    assert options_from_struct(st) == {"a": 1.5, "b": [True, "x", None, {"c": 2.0}]}
    st.update({"d": {"e": [math.inf]}})
    with pytest.raises(DuplexError) as err:
        options_from_struct(st)
    assert err.value.code == "bad_submission"
