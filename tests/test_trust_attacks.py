"""Availability attacks on the README's secure deployment, as an attacker would play them: real
processes (``tests.secure_stack``: workers with mutual TLS and ``--takeover-identities
duplex-session``, replicas with TLS, bearer tokens and mutual TLS towards the workers), a victim
conversation beside the attacker, and the victim's outcome checked.

1. A second service the tier CA signed poisons the worker a failover would land on (a closed
   tombstone, a fence at the highest epoch) and squats its capacity: it may not own sessions on
   a worker at all, so the failover is as clean as without it.
2. Idle calls: unauthenticated ones, and one principal's calls that never open, must not refuse
   another caller's open.
3. A session taken over and closed on another replica stays closed on the replica it left,
   whether or not audio was sent there, and that replica's stream hears of the takeover at once.
4. The open health port: ``List`` answers cleanly, ``Watch`` streams are bounded per address.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.audio import PCM16K_MONO
from duplex.errors import DuplexError, from_rpc_error
from duplex.serving import WATCHES_PER_PEER
from duplex.v1 import common_pb2, session_pb2, session_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.secure_stack import SecureStack, secure_stack
from tests.session_helpers import Conversation, open_event, speech, utterance_pcm
from tests.test_session_failover import Turn, restarted

pytestmark = pytest.mark.process

ATTACKER_IDENTITY = "other-service"
"""A second service's certificate identity, signed by the tier CA."""


async def _refused(call: object) -> DuplexError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return from_rpc_error(err.value)


def _resume(session_id: str, token: str) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(
        resume=session_pb2.SessionResume(session_id=session_id, resume_token=token)
    )


async def _poison(stack: SecureStack, worker: int, session_id: str) -> list[str]:
    """What the attack of issue 26 did as ``other-service`` on ``worker``: attach the victim's
    session there (plainly, at the top epoch, as a takeover), close it for good over a Run
    stream, and fill the worker's capacity. Returns the codes it was answered with."""
    codes: list[str] = []
    async with stack.worker_channel(worker, ATTACKER_IDENTITY) as ch:
        stub = worker_pb2_grpc.DuplexWorkerStub(ch)
        attempts = [(session_id, 1, False), (session_id, 2**64 - 1, False), (session_id, 7, True)]
        attempts += [(f"squat-{i}", 1, False) for i in range(12)]
        for sid, epoch, takeover in attempts:
            req = worker_pb2.AttachRequest(session_id=sid, epoch=epoch, owner="mallory", takeover=takeover)
            codes.append((await _refused(stub.Attach(req, timeout=5))).code)
        run = stub.Run()
        fence = common_pb2.Fence(session_id=session_id, epoch=1)
        await run.write(
            worker_pb2.WorkerCommand(
                owner="mallory", release=[worker_pb2.Release(request_id=session_id, fence=fence, closed=True)]
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run.read()
        codes.append(from_rpc_error(err.value).code)
    return codes


async def test_failover_after_a_poisoning_attempt_is_as_clean_as_without_it(tmp_path: Path) -> None:
    """The victim's worker hangs mid-reply; the failover lands on the worker the attacker tried
    to poison, and the reply restarts there and completes, with no error."""
    with secure_stack(
        tmp_path,
        workers=2,
        worker_args=["--max-sessions", "8"],
        session_args=["--worker-stall-timeout-s", "1"],
    ) as stack:
        async with stack.api_channel(0, principal="victim") as ch:
            conv = Conversation(ch).start(open_event())
            sid = (await conv.wait_kind("opened", within=10)).opened.session_id
            home = stack.worker_for(sid)
            other = 1 - home
            codes = await _poison(stack, other, sid)
            assert set(codes) == {"identity_not_allowed"}, codes

            turn = await Turn.speak(conv, speech(0))
            await conv.wait_kind("audio_delta", start=turn.start, within=15)
            stack.stop(stack.workers[home])
            try:
                first = await conv.wait_kind("response_done", start=turn.start, within=10)
                second = await conv.wait_kind("response_done", start=conv.events.index(first) + 1, within=20)
            finally:
                stack.cont(stack.workers[home])
            assert second.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED, conv.kinds()
            restarted(turn)  # the same turn, restarted on the other worker
            assert conv.of("error") == [], conv.of("error")
            conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await conv.wait_done()
    for p in stack.processes:
        assert "Traceback" not in p.log_text(), p.name


async def _flood(
    stack: SecureStack, channels: contextlib.AsyncExitStack, principal: str | None, connections: int, per: int
) -> list[grpc.aio.StreamStreamCall]:  # type: ignore[type-arg]
    """``connections`` x ``per`` Converse calls that never send anything, as ``principal``
    (None: no credentials), each connection its own (HTTP/2 bounds the streams of one)."""
    calls = []
    for _ in range(connections):
        ch = await channels.enter_async_context(
            stack.api_channel(0, principal=principal, own_connection=True)
        )
        stub = session_pb2_grpc.DuplexSessionStub(ch)
        calls += [stub.Converse() for _ in range(per)]
    await asyncio.gather(*(c.wait_for_connection() for c in calls), return_exceptions=True)
    return calls


async def _ended(calls: list[grpc.aio.StreamStreamCall], n: int, within: float = 10) -> None:  # type: ignore[type-arg]
    """Until at least ``n`` of ``calls`` have ended."""
    waiting = {asyncio.ensure_future(c.code()) for c in calls}
    try:
        async with asyncio.timeout(within):
            while len(calls) - len(waiting) < n:
                _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiting:
            w.cancel()


async def _opens(stack: SecureStack, principal: str, n: int) -> list[str]:
    """``n`` opens by ``principal`` at once: the outcome of each ("opened" or the error code)."""
    async with stack.api_channel(0, principal=principal) as ch:
        convs = [Conversation(ch).start(open_event()) for _ in range(n)]
        outcomes: list[str] = []
        for conv in convs:
            with contextlib.suppress(AssertionError, TimeoutError):
                await conv.wait_kind("opened", within=10)
            outcomes.append("opened" if conv.of("opened") else (conv.error.code if conv.error else "?"))
        for conv in convs:
            conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        for conv in convs:
            with contextlib.suppress(TimeoutError):
                await conv.wait_done()
        return outcomes


async def test_no_callers_idle_calls_refuse_another_callers_open(tmp_path: Path) -> None:
    """With a replica of 8 sessions (80 call slots): 300 unauthenticated calls held open from one
    address, then one principal's 200 calls that never send open. Before, both took every slot:
    the victim's opens were refused with gRPC's bare "Concurrent RPC limit exceeded!"."""
    with secure_stack(tmp_path, workers=1, session_args=["--max-sessions", "8"]) as stack:
        # Unauthenticated, 20 on each of 15 connections: refused (after a short wait for their
        # first message, a few per address at a time; the others at once).
        async with contextlib.AsyncExitStack() as channels:
            calls = await _flood(stack, channels, None, 15, 20)
            try:
                assert await _opens(stack, "victim", 4) == ["opened"] * 4
                await _ended(calls, len(calls))
                codes = {from_rpc_error(await _as_error(c)).code for c in calls}
                assert codes <= {"unauthenticated", "too_many_calls"}, codes
            finally:
                for c in calls:
                    c.cancel()
        # One principal's unopened calls, 20 on each of 10 connections: counted against that
        # principal only (its bound: 8 + 16 calls).
        async with contextlib.AsyncExitStack() as channels:
            calls = await _flood(stack, channels, "attacker", 10, 20)
            try:
                await _ended(calls, 200 - 24)
                refused = [from_rpc_error(await _as_error(c)) for c in calls if c.done()]
                assert {(e.status, e.code) for e in refused} == {
                    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_calls")
                }
                assert len(refused) == 200 - 24
                assert await _opens(stack, "victim", 4) == ["opened"] * 4
            finally:
                for c in calls:
                    c.cancel()
    for p in stack.processes:
        assert "Traceback" not in p.log_text(), p.name


async def _as_error(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:  # type: ignore[type-arg]
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("audio", [False, True], ids=["no_audio", "audio"])
async def test_a_session_closed_elsewhere_stays_closed_on_the_replica_it_left(
    tmp_path: Path, audio: bool
) -> None:
    with secure_stack(tmp_path, workers=1, replicas=2) as stack:
        async with (
            stack.api_channel(0, principal="victim") as ch_a,
            stack.api_channel(1, principal="victim") as ch_b,
        ):
            old = Conversation(ch_a).start(open_event())
            opened = (await old.wait_kind("opened", within=10)).opened
            if audio:
                old.append(utterance_pcm(speech(0), PCM16K_MONO)[:3200])
                await old.wait_kind("input_ack", within=10)
            new = Conversation(ch_b).start(_resume(opened.session_id, opened.resume_token))
            await new.wait_kind("opened", within=10)
            # The replica that lost the session hears of it at once, not at its next append.
            assert (await old.wait_kind("closed", within=3)).closed.reason == "resumed_elsewhere"
            new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await new.wait_done()
            again = Conversation(ch_a).start(_resume(opened.session_id, opened.resume_token))
            await again.wait_done()
            assert again.status == grpc.StatusCode.NOT_FOUND, (again.status, again.error, again.kinds())
            assert again.error is not None and again.error.code == "session_closed"


async def test_health_list_answers_and_watch_streams_are_bounded_on_both_tiers(tmp_path: Path) -> None:
    """``List`` answered an error with a 12-line traceback per call; 2,000 ``Watch`` streams
    were all taken (and their memory kept by the allocator after they ended)."""
    with secure_stack(tmp_path, workers=1) as stack:
        for proc in (stack.replicas[0], stack.workers[0]):
            async with grpc.aio.insecure_channel(proc.health) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                for _ in range(3):
                    listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
                    assert listed.statuses[""].status == health_pb2.HealthCheckResponse.SERVING
                watches = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(40)]
                try:
                    outcomes = await asyncio.gather(*(w.read() for w in watches), return_exceptions=True)
                    served = [o for o in outcomes if isinstance(o, health_pb2.HealthCheckResponse)]
                    refused = [from_rpc_error(o) for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
                    assert len(served) == WATCHES_PER_PEER, outcomes
                    assert {(e.status, e.code) for e in refused} == {
                        (grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_calls")
                    }
                finally:
                    for w in watches:
                        w.cancel()
            assert "Traceback" not in proc.log_text(), proc.name
