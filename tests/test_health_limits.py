"""The standard ``grpc.health.v1.Health`` service as both services serve it (``duplex.serving.Health``),
on the API port and on the plaintext health port, against what an unauthenticated caller may do:
``List`` answers (no error, no traceback in the log), Watch streams are bounded per client address
and in all (RESOURCE_EXHAUSTED ``too_many_calls`` beyond), a Watch that ended leaves nothing
behind, and status changes still reach the Watches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.errors import ErrorCode, from_rpc_error
from duplex.serving import (
    HEALTH_MAX_RECEIVE_BYTES,
    LIVENESS_SERVICE,
    MAX_SERVICE_NAME_CHARS,
    WATCHES_PER_PEER,
    Health,
    bind,
    peer_host,
    server_options,
)
from session_service.api.servicer import SERVICE_NAME
from tests.session_helpers import session_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
NAME = "duplex.test.Probe"
_health_pb2: Any = health_pb2


@dataclass
class _Served:
    health: Health
    api: str
    plaintext: str


@contextlib.asynccontextmanager
async def _served(**limits: int) -> AsyncIterator[_Served]:
    """A ``Health`` on a server of its own (loopback, port 0) and on its health-only listener."""
    server = grpc.aio.server(options=server_options())
    health = Health(server, [NAME], **limits)
    port = bind(server, "127.0.0.1:0")
    await server.start()
    plain: grpc.aio.Server | None = None
    try:
        await health.set(True)
        await health.set_alive(True)
        plain, plain_port = await health.serve_plaintext("127.0.0.1:0")
        yield _Served(health, f"127.0.0.1:{port}", f"127.0.0.1:{plain_port}")
    finally:
        if plain is not None:
            await plain.stop(None)
        await server.stop(None)


def _stub(ch: grpc.aio.Channel) -> Any:
    """``HealthStub``; the stubs (types-grpcio-health-checking) declare it without its methods."""
    return health_pb2_grpc.HealthStub(ch)


def _list_request() -> Any:
    return _health_pb2.HealthListRequest()  # not in the stubs either


def _watch(ch: grpc.aio.Channel, service: str = "") -> Any:
    return _stub(ch).Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)


async def _first(call: Any) -> int:
    async with asyncio.timeout(10):
        got: health_pb2.HealthCheckResponse = await call.read()
    return got.status


async def _refused(call: Any) -> str:
    """The stable code of a Watch that must be refused (its first read fails)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _first(call)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return from_rpc_error(info.value).code


async def _until_watching(health: Health | None, n: int = 0) -> None:
    """Until ``n`` Watch handlers are in progress (the server has seen the cancels), bounded:
    the test fails rather than hangs. At 0 the per-address counts must be gone too."""
    assert health is not None
    servicer = health._servicer
    async with asyncio.timeout(10):
        while servicer.watches.held != n or (n == 0 and servicer.watches.by_key):  # noqa: ASYNC110 (polled state)
            await asyncio.sleep(0.01)


async def test_list_answers_every_known_status_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with session_server(["127.0.0.1:1"], wait_workers=0, health_listen="127.0.0.1:0") as server:
        for target in (f"127.0.0.1:{server.health_port}", server.address):
            async with grpc.aio.insecure_channel(target) as ch:
                got = await _stub(ch).List(_list_request(), timeout=5)
            statuses = {name: resp.status for name, resp in got.statuses.items()}
            # No worker is reachable (port 1): alive, not ready.
            assert statuses == {"": NOT_SERVING, SERVICE_NAME: NOT_SERVING, LIVENESS_SERVICE: SERVING}
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert "Traceback" not in caplog.text
    assert "NotImplementedError" not in caplog.text


async def test_a_watch_beyond_the_per_peer_bound_is_refused_with_too_many_calls() -> None:
    async with session_server(["127.0.0.1:1"], wait_workers=0, health_listen="127.0.0.1:0") as server:
        health_target = f"127.0.0.1:{server.health_port}"
        async with (
            grpc.aio.insecure_channel(health_target) as ch,
            grpc.aio.insecure_channel(server.address) as api,
        ):
            calls = [_watch(ch) for _ in range(WATCHES_PER_PEER)]
            try:
                assert [await _first(c) for c in calls] == [NOT_SERVING] * WATCHES_PER_PEER
                assert await _refused(_watch(ch)) == ErrorCode.TOO_MANY_CALLS
                # One bound for the address, whichever port (and connection) the Watch comes in on.
                assert await _refused(_watch(api, LIVENESS_SERVICE)) == ErrorCode.TOO_MANY_CALLS
                # A Watch that ends gives its slot back.
                calls.pop().cancel()
                await _until_watching(server._health, WATCHES_PER_PEER - 1)
                calls.append(_watch(api, LIVENESS_SERVICE))
                assert await _first(calls[-1]) == SERVING
                # Check (what probes use) is not bounded by the Watches.
                got = await _stub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert got.status == NOT_SERVING
            finally:
                for c in calls:
                    c.cancel()
        await _until_watching(server._health)


async def test_a_watch_beyond_the_global_bound_is_refused() -> None:
    async with _served(watches_per_peer=10, max_watches=3) as s, grpc.aio.insecure_channel(s.api) as ch:
        calls = [_watch(ch) for _ in range(3)]
        try:
            assert [await _first(c) for c in calls] == [SERVING] * 3
            assert await _refused(_watch(ch, NAME)) == ErrorCode.TOO_MANY_CALLS
        finally:
            for c in calls:
                c.cancel()
        await _until_watching(s.health)


async def test_ended_watches_leave_nothing_behind() -> None:
    """Cancelled Watches, and Watches whose client closed its connection, give back all they held:
    the servicer's bookkeeping is empty again and the whole bound can be used again, round after
    round (nothing accumulates)."""
    bound = 4
    async with _served(watches_per_peer=bound, max_watches=bound) as s:
        servicer = s.health._servicer
        for round_ in range(3):
            async with grpc.aio.insecure_channel(s.plaintext) as ch:
                calls = [_watch(ch, f"{NAME}.{round_}.{i}") for i in range(bound)]
                assert [await _first(c) for c in calls] == [SERVICE_UNKNOWN] * bound
                assert servicer.watches.held == bound and servicer.watches.by_key == {"ipv4:127.0.0.1": bound}
                assert await _refused(_watch(ch)) == ErrorCode.TOO_MANY_CALLS
                if round_ % 2 == 0:
                    for c in calls:
                        c.cancel()
            # Odd rounds: the channel closes under its open Watches (the client went away).
            await _until_watching(s.health)
            assert servicer.watches.held == 0 and servicer.watches.by_key == {}
        # Nothing was kept for the names those Watches asked about either.
        async with grpc.aio.insecure_channel(s.api) as ch:
            got = await _stub(ch).List(_list_request(), timeout=5)
        assert set(got.statuses) == {"", NAME, LIVENESS_SERVICE}


async def test_status_changes_reach_a_watcher_and_shutdown_is_final() -> None:
    async with _served() as s, grpc.aio.insecure_channel(s.plaintext) as ch:
        overall, named, alive = _watch(ch), _watch(ch, NAME), _watch(ch, LIVENESS_SERVICE)
        unknown = _watch(ch, "no.such.Service")
        try:
            assert [await _first(c) for c in (overall, named, alive, unknown)] == [
                SERVING,
                SERVING,
                SERVING,
                SERVICE_UNKNOWN,
            ]
            await s.health.set(False)
            assert await _first(overall) == NOT_SERVING
            assert await _first(named) == NOT_SERVING
            await s.health.set(True)
            assert await _first(overall) == SERVING
            assert await _first(named) == SERVING
            await s.health.set_alive(False)
            assert await _first(alive) == NOT_SERVING
            await s.health.set_alive(True)
            assert await _first(alive) == SERVING

            await s.health.shutdown()
            assert [await _first(c) for c in (overall, named, alive)] == [NOT_SERVING] * 3
            await s.health.set(True)  # ignored from now on
            await s.health.set_alive(True)
            stub = _stub(ch)
            for name in ("", NAME, LIVENESS_SERVICE):
                got = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert got.status == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            for c in (overall, named, alive, unknown):
                c.cancel()
        await _until_watching(s.health)


async def test_the_health_port_reads_small_requests_only() -> None:
    async with _served() as s, grpc.aio.insecure_channel(s.plaintext) as ch:
        request = health_pb2.HealthCheckRequest(service="x" * (HEALTH_MAX_RECEIVE_BYTES + 1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _stub(ch).Check(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert s.health._servicer.watches.held == 0


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:5555", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:5555", "ipv6:[::1]"),
        ("ipv6:%5B::1%5D:5555", "ipv6:%5B::1%5D"),
        ("ipv6:[2001:db8::7]:443", "ipv6:[2001:db8::7]"),
        ("unix:/run/duplex.sock", "unix:/run/duplex.sock"),
        ("", ""),
    ],
)
def test_peer_host_strips_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


async def test_a_watch_of_an_overlong_service_name_is_refused_at_once() -> None:
    """A Watch holds its request for as long as it runs: a name no service can have is not kept."""
    async with (
        session_server(["127.0.0.1:1"], wait_workers=0) as server,
        grpc.aio.insecure_channel(server.address) as ch,
    ):
        stub = health_pb2_grpc.HealthStub(ch)
        call = stub.Watch(health_pb2.HealthCheckRequest(service="x" * (MAX_SERVICE_NAME_CHARS + 1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
