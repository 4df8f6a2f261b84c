"""Pieces every gRPC server here shares: health, reflection, /metrics, port binding, the event
loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import signal
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from duplex.errors import CapacityError, ErrorCode, abort

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

#: Server options: never share a port with another process (tests bind port 0 and must
#: get a port of their own), and keep long-lived streams alive through idle periods.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]


def server_options(*, max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """``SERVER_OPTIONS`` with a smaller receive limit. A client-facing server caps messages at
    what a valid event can need: the message is parsed before any handler can check its size,
    on the event loop every session shares."""
    if max_receive_bytes is None:
        return list(SERVER_OPTIONS)
    opts = [(k, v) for k, v in SERVER_OPTIONS if k != "grpc.max_receive_message_length"]
    return [*opts, ("grpc.max_receive_message_length", max_receive_bytes)]


CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]


#: The health service name the liveness probe asks for. It says whether the process itself
#: still serves, whatever its dependencies do: SERVING from start until the process is broken (a
#: worker whose engine died) or stopping, and through a drain. The overall status ("") is the
#: readiness one: NOT_SERVING while loading, draining or (session tier) without a reachable
#: worker, none of which a restart would fix.
LIVENESS_SERVICE: Final = "duplex.v1.Liveness"

#: ``Health/Watch`` streams in progress at once from one client address (its port aside), and in
#: all (both ports of a process together). Beyond either a Watch is refused with
#: RESOURCE_EXHAUSTED ``too_many_calls``. Probes use ``Check``, which is not bounded here.
WATCHES_PER_PEER: Final = 16
MAX_WATCHES: Final = 256

#: The largest request the health-only listener reads: a ``HealthCheckRequest`` is a service name.
HEALTH_MAX_RECEIVE_BYTES: Final = 4096

_SERVICE_UNKNOWN: Final = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# The stubs (types-grpcio-health-checking) do not declare the List messages.
_health_pb2_untyped: Any = health_pb2
_HealthContext = grpc.aio.ServicerContext[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]


#: The longest service name a health Watch is kept for (longer ones name no service here).
MAX_SERVICE_NAME_CHARS: Final = 256


def peer_host(peer: str) -> str:
    """A call's ``context.peer()`` without its port: ``ipv4:127.0.0.1:5555`` -> ``ipv4:127.0.0.1``,
    ``ipv6:[::1]:5555`` -> ``ipv6:[::1]``; anything else (a Unix socket) as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        if sep and port.isdigit() and host not in ("ipv4", "ipv6"):
            return host
    return peer


class Slots:
    """Slots held per key (a client address, a principal) and in all, each bounded (0 = no
    bound): what the services count calls and streams by, so that no one key holds them all."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self.held = 0
        """Slots held in all."""
        self.by_key: dict[str, int] = {}
        """Slots held per key; a key holding none has no entry."""

    def full(self, key: str | None) -> str | None:
        """Which bound a new slot of ``key`` would pass: ``"key"``, ``"total"``, or None. A slot
        of no key (None) counts in all only."""
        if key is not None and self.per_key and self.by_key.get(key, 0) >= self.per_key:
            return "key"
        if self.total and self.held >= self.total:
            return "total"
        return None

    def take(self, key: str | None) -> None:
        self.held += 1
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1

    def give(self, key: str | None) -> None:
        self.held -= 1
        if key is None:
            return
        left = self.by_key[key] - 1
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]


class _HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health``: Check, Watch and List, with Watch streams bounded.

    Replaces grpcio-health-checking's asyncio servicer, which has no ``List`` (the generated
    base's synchronous stub raises NotImplementedError, logged with a traceback per call) and
    does not bound Watch. A Watch holds no state of its own but its count (per peer address and
    in all), given back when its handler ends, however it ends (the client's cancel or a broken
    connection cancels it); all Watches wait on one event that every status change replaces."""

    def __init__(self, watches_per_peer: int, max_watches: int) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._changed = asyncio.Event()
        self._shutting_down = False
        self.watches = Slots(watches_per_peer, max_watches)
        """Watch streams in progress, per peer address (``peer_host``) and in all."""

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: _HealthContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: _HealthContext) -> Any:
        """The status of every service this process knows."""
        response = _health_pb2_untyped.HealthListResponse()
        for name, status in self._status.items():
            response.statuses[name].status = status
        return response

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: _HealthContext) -> None:
        if len(request.service) > MAX_SERVICE_NAME_CHARS:
            # No service has such a name, and a Watch would hold the name for as long as it runs.
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        peer = peer_host(context.peer() or "")
        watches = self.watches
        full = watches.full(peer)
        if full is not None:
            bound = f"{watches.per_key} per client address" if full == "key" else f"{watches.total} in all"
            await abort(
                context, CapacityError(ErrorCode.TOO_MANY_CALLS, f"at most {bound} health watches at once")
            )
        watches.take(peer)
        try:
            last: int | None = None
            while True:
                changed = self._changed  # taken first: a change during the write is not missed
                status = self._status.get(request.service, _SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                await changed.wait()
        finally:
            watches.give(peer)

    def set(self, service: str, status: int) -> None:
        """Set a service's status and wake the Watches (ignored once shutting down)."""
        if not self._shutting_down:
            self._set(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every status NOT_SERVING for good: later ``set`` calls are ignored."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in self._status:
            self._set(service, NOT_SERVING)

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class Health:
    """The ``grpc.health.v1`` servicer of one server, with the overall ("") status kept in step,
    and the liveness status (``LIVENESS_SERVICE``) kept apart from both.

    ``List`` answers every known status; Watch streams are bounded (``WATCHES_PER_PEER``,
    ``MAX_WATCHES``, shared by the API port and the health-only one)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        service_names: Iterable[str],
        *,
        watches_per_peer: int = WATCHES_PER_PEER,
        max_watches: int = MAX_WATCHES,
    ) -> None:
        self._servicer = _HealthServicer(watches_per_peer, max_watches)
        self._names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.serving = False
        self.alive = False

    async def set(self, serving: bool) -> None:
        """The overall status and that of each named service (not liveness)."""
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in self._names:
            self._servicer.set(name, status)

    async def set_alive(self, alive: bool) -> None:
        """The liveness status: True once the process serves; False only when it is broken or
        stopping (a liveness probe that fails restarts the container)."""
        self.alive = alive
        self._servicer.set(LIVENESS_SERVICE, SERVING if alive else NOT_SERVING)

    async def shutdown(self) -> None:
        self.serving = False
        self.alive = False
        self._servicer.enter_graceful_shutdown()

    async def serve_plaintext(self, listen: str) -> tuple[grpc.aio.Server, int]:
        """A second, plaintext listener that serves this health service and nothing else.

        For Kubernetes gRPC probes, which cannot speak TLS: when the API port requires (mutual)
        TLS, the probes point here. It answers SERVING / NOT_SERVING and exposes nothing else.
        Its connections get the keepalive of ``SERVER_OPTIONS`` (a Watch whose client vanished
        without closing its connection ends within a minute), and a request is at most
        ``HEALTH_MAX_RECEIVE_BYTES``. Returns the server (stop it with the main one) and its port."""
        server = grpc.aio.server(options=server_options(max_receive_bytes=HEALTH_MAX_RECEIVE_BYTES))
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        port = bind(server, listen)
        await server.start()
        return server, port


#: The standard health check's method path (what a generated ``HealthStub.Check`` calls).
HEALTH_CHECK_METHOD: Final = "/grpc.health.v1.Health/Check"


def health_check(
    channel: grpc.Channel,
) -> grpc.UnaryUnaryMultiCallable[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]:
    """``grpc.health.v1.Health/Check`` on a (sync) channel, typed.

    The same call as ``health_pb2_grpc.HealthStub(channel).Check``; built here because the
    stubs (types-grpcio-health-checking) declare ``HealthStub`` without its methods.
    """
    return channel.unary_unary(
        HEALTH_CHECK_METHOD,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Turn on server reflection so generic tools (grpcurl, grpcui) can explore the API."""
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)


def bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``HOST:PORT`` (port 0 = any free port), with TLS when ``credentials`` are given;
    returns the bound port."""
    if credentials is None:
        port: int = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    return port


@dataclass
class MetricsServer:
    """The Prometheus ``/metrics`` HTTP endpoint of a process."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Start ``/metrics`` on ``host:port`` (port 0 = any free port) in a daemon thread."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(port=server.server_port, _server=server, _thread=thread)


def split_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) to its parts; raises ValueError on anything else."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


#: ``--event-loop`` choices: ``auto`` is uvloop where it is installed, else asyncio's own.
EVENT_LOOPS: Final = ("auto", "uvloop", "asyncio")

_T = TypeVar("_T")


def event_loop_name(choice: str) -> str:
    """The loop ``choice`` (one of ``EVENT_LOOPS``) runs on: ``uvloop`` or ``asyncio``. Raises
    ValueError for an unknown choice, or for ``uvloop`` where it is not installed."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not have_uvloop:
        raise ValueError("--event-loop uvloop: uvloop is not installed")
    return "uvloop" if choice == "uvloop" or (choice == "auto" and have_uvloop) else "asyncio"


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop maker for ``choice``, or None (asyncio's own). ``auto`` falls back to asyncio
    when uvloop is there but does not import (a broken install)."""
    if event_loop_name(choice) == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":
            return None
        raise ValueError(f"--event-loop uvloop: uvloop does not import ({exc})") from exc
    return uvloop.new_event_loop


def run_service(main: Coroutine[Any, Any, _T], event_loop: str = "auto") -> _T:
    """Run a service's ``main`` to its end on the loop ``event_loop`` names (``event_loop_name``).

    uvloop (libuv's loop, in Cython) because a session-frame wakes several tasks, futures and
    timers, and gRPC's asyncio API hands every completed read and write to the loop through a
    socket: each of those costs less CPU there than in asyncio's pure-Python loop."""
    try:
        with asyncio.Runner(loop_factory=_loop_factory(event_loop)) as runner:
            return runner.run(main)
    finally:
        main.close()  # a no-op once it ran; otherwise no "coroutine was never awaited" warning


def settle_heap() -> None:
    """Move everything alive now out of the garbage collector's reach (``gc.freeze``); called
    once a service has started. The startup heap (modules, the model, torch, gRPC) never becomes
    garbage, yet every full collection scanned it: in a worker that was ~180k objects and a
    90-100 ms pause about once a second under load, every session's acks stalled behind it.
    Collections now scan only what serving created."""
    gc.collect()
    gc.freeze()


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: what the running event loop is (a service announces it)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


#: The signals a service drains and stops on.
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event that SIGTERM or SIGINT sets while the block runs (in the running loop). The
    handlers are given back at the block's end, while the loop still runs: uvloop's loop does
    not give them back once it has stopped, and a second Ctrl-C must still stop the process."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
