"""The worker process's lifecycle: bind, load the model on the engine thread, serve, drain, stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import torch

from duplex.errors import BadRequestError, ErrorCode, InternalError
from duplex.serving import (
    SERVER_OPTIONS,
    Health,
    MetricsServer,
    add_reflection,
    bind,
    serve_metrics,
    split_host_port,
)
from duplex.tls import check_plaintext_listen, server_credentials
from duplex.v1 import worker_pb2_grpc
from worker_service.config import WorkerConfig
from worker_service.delivery import OutputHub
from worker_service.engine import Engine
from worker_service.fencing import FenceTable
from worker_service.metrics import ENGINE_FAILURES
from worker_service.model import StepModel
from worker_service.models import create_model
from worker_service.servicer import SERVICE_NAME, DuplexWorkerServicer
from worker_service.serving_state import ServingState

logger = logging.getLogger(__name__)

ModelFactory = Callable[[torch.device], StepModel[Any]]


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda`` -> the current CUDA device."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"bad device {spec!r}: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, f"device {spec!r} requested but CUDA is not available"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise BadRequestError(ErrorCode.INVALID_CONFIG, f"no CUDA device {index}")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"unsupported device {spec!r} (auto, cpu, cuda[:i])")
    return device


def listen_credentials(config: WorkerConfig) -> grpc.ServerCredentials | None:
    """The worker API's server credentials (None: plaintext).

    Whoever reaches the port can drive sessions unless callers are authenticated, so a worker
    without mutual TLS (plaintext, or TLS without a client CA) serves only on loopback unless
    ``insecure`` says otherwise."""
    host = split_host_port(config.listen)[0]
    if not config.mutual_tls:
        what = "the worker API" + (" without client certificates (--tls-client-ca)" if config.tls else "")
        check_plaintext_listen(host, insecure=config.insecure, what=what)
    if config.tls is None:
        return None
    try:
        return server_credentials(config.tls)
    except OSError as exc:  # a missing file (its contents are checked by duplex.tls)
        raise BadRequestError(
            ErrorCode.INVALID_CONFIG, f"cannot read {exc.filename}: {exc.strerror}"
        ) from exc


class WorkerServer:
    """One worker: gRPC server, health, reflection, /metrics, engine thread."""

    def __init__(self, config: WorkerConfig, model_factory: ModelFactory | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self._credentials = listen_credentials(config)
        self._model_factory = model_factory or (
            lambda device: create_model(config.model, device, config.model_options)
        )
        self.state = ServingState()
        self.port = 0
        self.metrics: MetricsServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        """The plaintext health-only listener's port (``health_listen``; 0 without one)."""
        self._health: Health | None = None
        self._engine: Engine | None = None
        self._hub: OutputHub | None = None
        self._servicer: DuplexWorkerServicer | None = None
        self._ready: asyncio.Future[StepModel[Any]] | None = None
        self._stopped = asyncio.Event()
        self._tasks: set[asyncio.Future[None]] = set()

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def engine(self) -> Engine:
        assert self._engine is not None
        return self._engine

    @property
    def fences(self) -> FenceTable:
        """The fencing authority's table (per session: highest epoch, owner; closed sessions)."""
        assert self._servicer is not None
        return self._servicer.fences

    def owners(self) -> list[str]:
        """The owner keys that have a Run stream open now."""
        assert self._hub is not None
        return self._hub.owners()

    async def start(self, *, wait_ready: bool = True) -> None:
        """Bind and serve (health NOT_SERVING), load the model, then report SERVING."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        server = self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._health = Health(server, [SERVICE_NAME])
        add_reflection(server, [SERVICE_NAME])
        self._hub = OutputHub(loop, self.config.max_output_steps)
        self._engine = Engine(
            lambda: self._model_factory(self.device),
            sink=self._hub.sink,
            max_batch=self.config.max_batch,
            on_ready=lambda model: loop.call_soon_threadsafe(self._model_ready, model),
            on_fatal=lambda exc: loop.call_soon_threadsafe(self._engine_failed, exc),
            torch_threads=self.config.torch_threads,
            step_interval_s=self.config.step_interval_ms / 1000.0,
            clock=self.config.clock,
        )
        fences = FenceTable(
            self.config.max_sessions,
            authorize=self.config.mutual_tls,
            tombstone_ttl_s=self.config.tombstone_ttl_s,
            max_closed=self.config.max_closed_sessions,
        )
        servicer = self._servicer = DuplexWorkerServicer(
            self.config, self.state, self._engine, self._hub, fences
        )
        worker_pb2_grpc.add_DuplexWorkerServicer_to_server(servicer, server)
        self.port = bind(server, self.config.listen, self._credentials)
        await server.start()
        await self._health.set(False)
        # Alive while the model loads; not alive once the engine has failed (see _engine_failed).
        await self._health.set_alive(True)
        if self.config.health_listen:
            self._health_server, self.health_port = await self._health.serve_plaintext(
                self.config.health_listen
            )
        if self.config.metrics_port >= 0:
            self.metrics = serve_metrics(self.config.metrics_host, self.config.metrics_port)
        self._engine.start()
        if wait_ready:
            await self.wait_ready()

    async def wait_ready(self) -> StepModel[Any]:
        assert self._ready is not None
        return await asyncio.shield(self._ready)

    def _model_ready(self, model: StepModel[Any]) -> None:
        self.state.model = model
        logger.info("model %s loaded on %s", model.model_id, model.device)
        assert self._health is not None and self._ready is not None
        if not self._ready.done():
            self._ready.set_result(model)
        if not self.state.draining:
            self._spawn(self._health.set(True))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _engine_failed(self, exc: BaseException) -> None:
        ENGINE_FAILURES.inc()
        self.state.failed = True
        assert self._health is not None and self._hub is not None and self._ready is not None
        if not self._ready.done():
            self._ready.set_exception(InternalError(ErrorCode.INTERNAL, f"model failed to load: {exc!r}"))
        self._spawn(self._health.set(False))
        # Broken for good: the liveness probe fails and the container restarts.
        self._spawn(self._health.set_alive(False))
        self._hub.close_all(InternalError(ErrorCode.INTERNAL, "the worker's engine failed"))

    async def drain(self) -> None:
        """Stop taking work, let in-flight work finish (up to the grace), end the streams."""
        if self.state.draining:
            return
        self.state.draining = True
        if self._health is not None:
            await self._health.set(False)
        engine = self._engine
        deadline = asyncio.get_running_loop().time() + self.config.drain_grace_s
        # The engine's idleness is thread-side state: polled, briefly, only while draining.
        while engine is not None and not engine.idle and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let the last outputs reach the streams
        if self._hub is not None:
            self._hub.close_all()

    async def stop(self, grace: float = 1.0) -> None:
        """Drain, then stop the server, the engine and /metrics."""
        await self.drain()
        if self._health is not None:
            await self._health.set_alive(False)
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self._servicer is not None:
            self._servicer.cancel_reapers()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)
        if self.metrics is not None:
            self.metrics.stop()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
