"""The session service's lifecycle: bind, link to the workers, serve, drain, stop.

``SessionServer`` is the whole service in one object (like ``worker_service.server.WorkerServer``),
so a test or an embedding program runs it in its own event loop; ``serve`` adds what only a
process needs: the one-line "listening" announcement and SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from duplex.clock import MONOTONIC, Clock
from duplex.serving import (
    Health,
    MetricsServer,
    add_reflection,
    bind,
    run_service,
    running_loop_name,
    serve_metrics,
    server_options,
    settle_heap,
    split_host_port,
    stop_signals,
)
from duplex.tls import ChannelCredentials, server_credentials
from duplex.v1 import session_pb2_grpc
from session_service.api.admission import AdmissionInterceptor, CallLedger, CallLimits
from session_service.api.servicer import SERVICE_NAME, DuplexSessionServicer
from session_service.config import ServiceConfig
from session_service.plugin import DuplexModelPlugin, PluginLoadError, Stage
from session_service.session.manager import SessionManager
from session_service.trust.auth import authenticator_for
from session_service.workers.discovery import DnsTarget, WorkerDiscovery, parse_workers
from session_service.workers.eviction import Evictor
from session_service.workers.link import WorkerLink
from session_service.workers.placement import WorkerPool
from session_service.workers.step_routing import Router, SessionRegistry

log = logging.getLogger(__name__)


def _announce_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def later_stages(config: ServiceConfig, plugin: DuplexModelPlugin) -> list[tuple[Stage, tuple[str, ...]]]:
    """Each later stage of the plugin with its workers (``--stage-workers``); raises
    ``PluginLoadError`` for a stage without workers or workers of a stage the plugin lacks."""
    given = dict(config.stage_workers)
    later = plugin.stages[1:]
    unknown = sorted(set(given) - {stage.name for stage in later})
    if unknown:
        names = ", ".join(s.name for s in later) or "none: it is served by one model"
        raise PluginLoadError(
            f"--stage-workers names {', '.join(unknown)}, not a later stage of plugin "
            f"{plugin.plugin_id!r} (its later stages: {names})"
        )
    missing = [stage.name for stage in later if not given.get(stage.name)]
    if missing:
        raise PluginLoadError(
            f"plugin {plugin.plugin_id!r} is served in stages: give the workers of "
            + ", ".join(f"--stage-workers {name}=HOST:PORT" for name in missing)
        )
    return [(stage, given[stage.name]) for stage in later]


class SessionServer:
    """One session-service replica: gRPC server, worker links, health, reflection, /metrics."""

    def __init__(self, config: ServiceConfig, plugin: DuplexModelPlugin, *, clock: Clock = MONOTONIC) -> None:
        self.config = config
        self.plugin = plugin
        self._clock = clock
        # Who may call: loads the token and JWKS files, and refuses an unauthenticated API on
        # anything but loopback (without --insecure) before anything is made.
        self.auth = authenticator_for(config)
        self.calls = CallLedger(
            CallLimits(max_calls=config.concurrent_rpcs, max_calls_per_principal=config.calls_per_principal)
        )
        self.registry = SessionRegistry()
        self.router = Router(self.registry)
        self._discoveries: list[tuple[WorkerPool[WorkerLink], WorkerDiscovery]] = []
        # The workers: a static list, or a DNS name whose answers add and remove links; a plugin
        # served in stages has a pool per stage.
        self.pool, self.discovery = self._pool(config.workers, None)
        self.stage_pools: dict[str, WorkerPool[WorkerLink]] = {}
        for stage, workers in later_stages(config, plugin):
            self.stage_pools[stage.name] = self._pool(workers, stage)[0]
        # Placement for runners and resumes; a resumed session moved off the worker its token
        # names is evicted there.
        self.evictor = Evictor(
            self.pool,
            self.registry,
            limits=config.evictions,
            attach_timeout_s=config.attach_timeout_s,
            clock=clock,
        )
        self.manager = SessionManager(
            plugin=plugin,
            config=config,
            registry=self.registry,
            placer=self.evictor.place,
            stage_placers={name: pool.place for name, pool in self.stage_pools.items()},
            resume_max_age_s=config.resume_max_age_s,
            clock=clock,
        )
        self.port = 0
        self.metrics: MetricsServer | None = None
        self.draining = False
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        """The plaintext health-only listener's port (``health_listen``; 0 without one)."""
        self._health: Health | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _pool(
        self, listed: tuple[str, ...], stage: Stage | None
    ) -> tuple[WorkerPool[WorkerLink], WorkerDiscovery | None]:
        """The pool of the plugin's first (or only) model's workers, or of a later ``stage``'s."""
        config = self.config
        workers = parse_workers(listed, max_workers=config.max_workers)
        dns_target = workers if isinstance(workers, DnsTarget) else None
        # A discovered worker is dialled at its address; its certificate carries the name.
        tls_name = dns_target.host if dns_target is not None else None
        made: list[WorkerPool[WorkerLink]] = []  # the pool, for its links' claims (made after them)
        pool: WorkerPool[WorkerLink] = WorkerPool(
            () if isinstance(workers, DnsTarget) else workers,
            link_factory=lambda address, on_health: self._link(address, on_health, made, tls_name, stage),
            attach_timeout_s=config.attach_timeout_s,
        )
        made.append(pool)
        discovery = None
        if dns_target is not None:
            discovery = WorkerDiscovery(
                dns_target,
                pool.update,
                interval_s=config.workers_resolve_interval_s,
                max_workers=config.max_workers,
            )
            self._discoveries.append((pool, discovery))
        return pool, discovery

    def _link(
        self,
        address: str,
        on_health: Callable[[], None],
        pool: list[WorkerPool[WorkerLink]],
        tls_name: str | None,
        stage: Stage | None,
    ) -> WorkerLink:
        # Mutual TLS towards the workers: each link re-reads the files when it makes a channel.
        tls = self.config.worker_tls
        return WorkerLink(
            address,
            owner=self.config.replica_id,
            plugin=self.plugin,
            on_step=self.router.on_step,
            on_lost=self._link_lost,
            on_health=on_health,
            backoff_max_s=self.config.worker_backoff_max_s,
            stall_timeout_s=self.config.worker_stall_timeout_s,
            write_coalesce_s=self.config.worker_write_coalesce_ms / 1000,
            clock=self._clock,
            credentials=ChannelCredentials(tls) if tls is not None else None,
            tls_name=tls_name,
            # Late-bound: the pool calls this factory while it is being made.
            claim=lambda link, worker_id: pool[0].claim(link, worker_id),
            release=lambda link: pool[0].release(link),
            stage=stage,
        )

    def _pools(self) -> list[WorkerPool[WorkerLink]]:
        return [self.pool, *self.stage_pools.values()]

    def _link_lost(self, link: WorkerLink) -> None:
        self.router.on_link_lost(link)
        # The worker may have moved: look again now (not for a link discovery itself removed).
        for pool, discovery in self._discoveries:
            if pool.links.get(link.address) is link:
                discovery.nudge()

    @property
    def address(self) -> str:
        """``HOST:PORT`` clients reach it at (the bound port when port 0 was asked for)."""
        host, _ = split_host_port(self.config.listen)
        return f"{_announce_host(host)}:{self.port}"

    async def start(self) -> None:
        """Bind and serve (health NOT_SERVING until a worker of the plugin's model is reachable)."""
        # One client event is at most an append of max_append_bytes (plus its envelope) or a small
        # config; anything bigger is refused by gRPC before it is parsed (RESOURCE_EXHAUSTED).
        # Authentication is one interceptor in front of every service but health: a call
        # without valid credentials is refused before its handler runs (no session state).
        # Calls are counted where they cost (session_service.api.admission): per principal, in all,
        # and refused ones per peer address, each refused with too_many_calls beyond its bound
        # (not gRPC's own maximum_concurrent_rpcs, which counts every caller alike and refuses
        # with a bare status). Streams per connection are bounded by gRPC.
        server = self._server = grpc.aio.server(
            options=[
                *server_options(max_receive_bytes=self.plugin.max_append_bytes + 64 * 1024),
                ("grpc.max_concurrent_streams", self.config.streams_per_connection),
            ],
            interceptors=[AdmissionInterceptor(self.auth, self.calls)],
        )
        servicer = DuplexSessionServicer(
            self.manager, open_timeout_s=self.config.open_timeout_s, principal_of=self.auth.principal_of
        )
        session_pb2_grpc.add_DuplexSessionServicer_to_server(servicer, server)
        health = self._health = Health(server, [SERVICE_NAME])
        if self.config.reflection:
            add_reflection(server, [SERVICE_NAME])
        tls = self.config.tls
        self.port = bind(server, self.config.listen, server_credentials(tls) if tls is not None else None)
        if self.config.metrics_port >= 0:
            self.metrics = serve_metrics(self.config.metrics_host, self.config.metrics_port)
        await server.start()
        await health.set(False)
        # Liveness does not follow the workers: a worker outage must not restart the replicas.
        await health.set_alive(True)
        if self.config.health_listen:
            self._health_server, self.health_port = await health.serve_plaintext(self.config.health_listen)
        for pool in self._pools():
            pool.health_listeners.append(self._workers_changed)
            pool.start()
        for _, discovery in self._discoveries:
            discovery.start()
        log.info(
            "session service %s: plugin %s, workers %s, %s, %s",
            self.config.replica_id,
            self.plugin.plugin_id,
            ",".join(self.config.workers),
            "plaintext" if tls is None else "TLS" + (" with client certificates" if tls.client_ca else ""),
            self.auth.describe(),
        )

    async def wait_ready(self, within_s: float) -> bool:
        """Whether a worker of the plugin's model (of each of its stages) became reachable within
        ``within_s``."""
        deadline = self._clock.now() + within_s
        for pool in self._pools():
            if not await pool.wait_ready(max(0.0, deadline - self._clock.now())):
                return False
        return True

    def _workers_changed(self, ok: bool) -> None:
        # SERVING only with a reachable worker of the plugin's model (of each of its stages), and
        # never while draining.
        ok = ok and all(pool.ready for pool in self._pools())
        if self._health is not None:
            self._spawn(self._health.set(ok and not self.draining))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """NOT_SERVING, ``go_away`` to every client, let in-flight responses finish (up to
        ``drain_grace_s``), then close every session."""
        if self.draining:
            return
        log.info("draining")
        self.draining = True
        if self._health is not None:
            await self._health.set(False)
        try:
            await self.manager.drain(self.config.drain_grace_s)
        except Exception:
            log.exception("drain failed")

    async def stop(self, grace: float = 2.0) -> None:
        """Drain, then stop the server, the worker links and /metrics."""
        await self.drain()
        if self._health is not None:
            await self._health.set_alive(False)
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
        for _, discovery in self._discoveries:
            await discovery.close()
        await self.evictor.close()
        for pool in self._pools():
            await pool.close()
        for task in list(self._tasks):
            task.cancel()
        if self.metrics is not None:
            self.metrics.stop()


async def serve(cfg: ServiceConfig, plugin: DuplexModelPlugin) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit code."""
    server = SessionServer(cfg, plugin)
    await server.start()
    settle_heap()
    metrics_port = server.metrics.port if server.metrics is not None else 0
    announce = {
        "event": "listening",
        "grpc": server.address,
        "metrics": f"{_announce_host(cfg.metrics_host)}:{metrics_port}",
        "event_loop": running_loop_name(),
    }
    if server.health_port:
        announce["health"] = f"{_announce_host(split_host_port(cfg.health_listen)[0])}:{server.health_port}"
    print(json.dumps(announce), flush=True)
    with stop_signals() as stop:
        await stop.wait()
        await server.stop()
    return 0


def run(cfg: ServiceConfig, plugin: DuplexModelPlugin) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_service(serve(cfg, plugin), cfg.event_loop)
