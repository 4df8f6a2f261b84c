"""The session service process: gRPC server, worker links, health, metrics, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

import grpc

from duplex.serving import Health, add_reflection, bind, serve_metrics, server_options, split_host_port
from duplex.v1 import session_pb2_grpc
from session_service.config import ServiceConfig
from session_service.placement import WorkerPool
from session_service.plugin import DuplexModelPlugin
from session_service.routing import Router, SessionRegistry
from session_service.servicer import SERVICE_NAME, DuplexSessionServicer
from session_service.sessions import SessionManager

log = logging.getLogger(__name__)


def _announce_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


async def serve(cfg: ServiceConfig, plugin: DuplexModelPlugin) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit code."""
    registry = SessionRegistry()
    router = Router(registry)
    pool = WorkerPool(
        cfg.workers,
        owner=cfg.replica_id,
        plugin=plugin,
        on_step=router.on_step,
        on_lost=router.on_link_lost,
        attach_timeout_s=cfg.attach_timeout_s,
        backoff_max_s=cfg.worker_backoff_max_s,
        stall_timeout_s=cfg.worker_stall_timeout_s,
    )
    manager = SessionManager(
        plugin=plugin,
        config=cfg,
        registry=registry,
        placer=pool.place,
        resume_max_age_s=cfg.resume_max_age_s,
    )

    # One client event is at most an append of max_append_bytes (plus its envelope) or a small
    # config; anything bigger is refused by gRPC before it is parsed (RESOURCE_EXHAUSTED).
    server = grpc.aio.server(options=server_options(max_receive_bytes=plugin.max_append_bytes + 64 * 1024))
    session_pb2_grpc.add_DuplexSessionServicer_to_server(
        DuplexSessionServicer(manager, open_timeout_s=cfg.open_timeout_s), server
    )
    health = Health(server, [SERVICE_NAME])
    add_reflection(server, [SERVICE_NAME])
    host, _ = split_host_port(cfg.listen)
    port = bind(server, cfg.listen)
    metrics = serve_metrics(cfg.metrics_host, cfg.metrics_port)
    await server.start()
    await health.set(False)

    draining = False
    health_tasks: set[asyncio.Task[None]] = set()

    def on_workers(ok: bool) -> None:
        # SERVING only with a reachable worker of the plugin's model, and never while draining.
        task = asyncio.create_task(health.set(ok and not draining))
        health_tasks.add(task)
        task.add_done_callback(health_tasks.discard)

    pool.health_listeners.append(on_workers)
    pool.start()

    print(
        json.dumps(
            {
                "event": "listening",
                "grpc": f"{_announce_host(host)}:{port}",
                "metrics": f"{_announce_host(cfg.metrics_host)}:{metrics.port}",
            }
        ),
        flush=True,
    )
    log.info(
        "session service %s: plugin %s, workers %s", cfg.replica_id, plugin.plugin_id, ",".join(cfg.workers)
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("draining")
    draining = True
    await health.set(False)
    try:
        await manager.drain(cfg.drain_grace_s)
    except Exception:
        log.exception("drain failed")
    await server.stop(grace=2.0)
    await pool.close()
    metrics.stop()
    return 0


def run(cfg: ServiceConfig, plugin: DuplexModelPlugin) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(cfg, plugin))
