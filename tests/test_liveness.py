"""The liveness health status (``duplex.serving.LIVENESS_SERVICE``), what the Kubernetes liveness
probes ask for: it must not follow the workers (a worker outage would restart every session
replica) nor a drain, and must fail when a worker's engine is dead (a restart is the cure)."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.serving import LIVENESS_SERVICE
from tests.session_helpers import session_server
from worker_service.config import WorkerConfig
from worker_service.server import WorkerServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        got = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(got.status)


async def _until(port: int, service: str, status: int, within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while (got := await _status(port, service)) != status:
        assert asyncio.get_running_loop().time() < deadline, (service, got)
        await asyncio.sleep(0.05)


async def test_a_session_replica_without_workers_is_alive_but_not_ready() -> None:
    # Nothing listens on port 1: the replica never reaches a worker.
    async with session_server(["127.0.0.1:1"], wait_workers=0, health_listen="127.0.0.1:0") as server:
        port = server.health_port
        assert await _status(port, "") == NOT_SERVING
        assert await _status(port, LIVENESS_SERVICE) == SERVING
        await server.drain()
        # Draining is deliberate: the drain must not be cut short by a liveness restart.
        assert await _status(port, LIVENESS_SERVICE) == SERVING
        assert await _status(port, "") == NOT_SERVING


async def test_a_worker_is_alive_while_loading_and_not_once_its_engine_failed() -> None:
    release = threading.Event()

    def failing_model(device: object) -> object:
        release.wait(10)
        raise RuntimeError("no model here")

    config = WorkerConfig(
        model="parrot", listen="127.0.0.1:0", device="cpu", metrics_port=-1, health_listen="127.0.0.1:0"
    )
    server = WorkerServer(config, model_factory=failing_model)  # type: ignore[arg-type]
    await server.start(wait_ready=False)
    try:
        port = server.health_port
        assert await _status(port, "") == NOT_SERVING  # loading: not ready
        assert await _status(port, LIVENESS_SERVICE) == SERVING  # but alive
        release.set()
        await _until(port, LIVENESS_SERVICE, NOT_SERVING)
        assert await _status(port, "") == NOT_SERVING
    finally:
        release.set()
        await asyncio.wait_for(server.stop(grace=0.2), 30)
