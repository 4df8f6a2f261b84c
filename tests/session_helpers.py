"""Helpers for session-service tests: the stack (in process, or as real processes), a small
client, content comparison, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import numpy as np
from prometheus_client import REGISTRY

from duplex.audio import PCM16K_MONO, PcmFormat, decode, encode, read_wav, resample, to_mono
from duplex.clock import MONOTONIC
from duplex.errors import DuplexError, from_rpc_error
from duplex.v1 import session_pb2, session_pb2_grpc, worker_pb2
from session_service.api.server import SessionServer
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import load_plugin
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.runner import Placer, RunnerDeps, SessionRunner
from session_service.trust.resume_tokens import ResumeKeys
from tests.fakes import ManualClock
from tests.procs import ServiceProcess, start_all, start_service
from worker_service.config import WorkerConfig
from worker_service.server import WorkerServer

FIXTURES = Path(__file__).parent / "fixtures"
PARROT = "session_service.plugins.parrot:ParrotPlugin"
SYNTHETIC = "session_service.plugins.synthetic:SyntheticPlugin"

Req = TypeVar("Req", session_pb2.ClientEvent, session_pb2.ClientBatch)


def worker_args(*extra: str, model: str = "parrot", port: int = 0, device: str | None = None) -> list[str]:
    """``duplex worker`` on ``127.0.0.1:PORT`` (0: a free one), one torch thread, then ``extra``."""
    return [
        "worker",
        "--model",
        model,
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-port",
        "0",
        *(("--device", device) if device is not None else ()),
        "--torch-threads",
        "1",
        *extra,
    ]


def session_args(workers: list[str], *extra: str, plugin: str = PARROT) -> list[str]:
    return [
        "session",
        "--plugin",
        plugin,
        "--workers",
        ",".join(workers),
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
        *extra,
    ]


@dataclass
class Stack:
    workers: list[ServiceProcess]
    session: ServiceProcess
    extra: list[ServiceProcess] = field(default_factory=list)

    def all(self) -> list[ServiceProcess]:
        return [*self.extra, self.session, *self.workers]


@contextlib.contextmanager
def running_stack(n_workers: int = 2, *session_extra: str) -> Iterator[Stack]:
    """Workers (started in parallel) and one session service; every process is gone afterwards."""
    started: list[ServiceProcess] = []
    try:
        workers = start_all([worker_args() for _ in range(n_workers)], started)
        session = start_service(session_args([w.grpc for w in workers], *session_extra))
        started.append(session)
        stack = Stack(workers, session)
        wait_metric(session.metrics, "duplex_session_workers_healthy", float(n_workers), timeout=30)
        yield stack
        started.extend(stack.extra)
    finally:
        for proc in reversed(started):
            proc.terminate(timeout=10)


@contextlib.contextmanager
def worker_and_session(
    worker: list[str], *session_extra: str, plugin: str, stop_timeout: float = 15.0
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """One worker (``worker``: its arguments) and a session service with ``plugin`` in front of it,
    once the session service has found the worker healthy; both are stopped afterwards."""
    worker_proc = start_service(worker)
    try:
        session = start_service(session_args([worker_proc.grpc], *session_extra, plugin=plugin))
        try:
            wait_metric(session.metrics, "duplex_session_workers_healthy", 1.0, timeout=30)
            yield worker_proc, session
        finally:
            session.terminate(timeout=stop_timeout)
    finally:
        worker_proc.terminate(timeout=stop_timeout)


# ---- the stack in this process ----------------------------------------------------------------
#
# Workers (``WorkerServer``) and session-service replicas (``SessionServer``) in the test's own
# event loop, each on a free port of 127.0.0.1: the same gRPC servers, links and engines as the
# processes, without their 2-4 s start. What only a process shows (signals, the CLI, its
# announcement) stays with ``running_stack`` and tests/procs.py.
#
# Metrics: in-process servers share ``prometheus_client.REGISTRY`` (every tier, every replica,
# every earlier test), and serve no /metrics unless ``metrics_port`` >= 0 is asked for. Compare
# ``sample``/``sample_sum`` before and after, and only where one tier alone writes the metric (or
# the check is "no change at all").


@dataclass
class InProcessStack:
    """Workers and session-service replicas running in this process."""

    workers: list[WorkerServer]
    sessions: list[SessionServer]
    resume_keys: ResumeKeys

    @property
    def session(self) -> SessionServer:
        """The first (usually the only) replica."""
        return self.sessions[0]

    @property
    def target(self) -> str:
        """``HOST:PORT`` of the first replica (what clients connect to)."""
        return self.session.address

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers]


class FastClock:
    """The session tier's clock (``duplex.clock.Clock``) running ``speed`` times faster than real
    time: silence continuation, idle timeouts and submit deadlines all scale with it. For tests
    whose replies are paced by silence continuation and that check events and content, not pace."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self._t0 = time.monotonic()

    def now(self) -> float:
        return self._t0 + (time.monotonic() - self._t0) * self.speed

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds / self.speed)

    def timeout(self, seconds: float) -> contextlib.AbstractAsyncContextManager[object]:
        return asyncio.timeout(seconds / self.speed)


async def wait_workers_healthy(
    server: SessionServer, n: int, *, within: float = 30.0, exactly: bool = False
) -> None:
    """Until ``n`` (at least, or ``exactly``) of the replica's worker links are healthy (the count
    its ``duplex_session_workers_healthy`` shows)."""
    changed = asyncio.Event()

    def listener(_ok: bool) -> None:
        changed.set()

    def done() -> bool:
        healthy = len(server.pool.healthy())
        return healthy == n if exactly else healthy >= n

    server.pool.health_listeners.append(listener)
    try:
        async with asyncio.timeout(within):
            while not done():
                changed.clear()
                await changed.wait()
    except TimeoutError:
        raise AssertionError(
            f"{len(server.pool.healthy())} healthy workers, want {'' if exactly else 'at least '}{n}, "
            f"after {within}s"
        ) from None
    finally:
        server.pool.health_listeners.remove(listener)


@contextlib.asynccontextmanager
async def worker_server(
    *, model: str = "parrot", model_options: Mapping[str, object] | None = None, **config: Any
) -> AsyncIterator[WorkerServer]:
    """One in-process worker on a free port, its model loaded; stopped afterwards.

    ``config``: ``WorkerConfig`` fields (defaults: a free port of 127.0.0.1, cpu, one torch
    thread, no /metrics, no real-time admission: its engine thread shares this process's GIL with
    the test, whose own work would show as tick load)."""
    config.setdefault("listen", "127.0.0.1:0")
    config.setdefault("max_tick_load", 0.0)
    config.setdefault("device", "cpu")
    config.setdefault("torch_threads", 1)
    config.setdefault("metrics_port", -1)
    config.setdefault("drain_grace_s", 0.2)
    server = WorkerServer(WorkerConfig(model=model, model_options=dict(model_options or {}), **config))
    try:
        await asyncio.wait_for(server.start(), 60)
        yield server
    finally:
        await asyncio.wait_for(server.stop(grace=0.2), 30)


@contextlib.asynccontextmanager
async def session_server(
    workers: Sequence[str],
    *,
    plugin: str = PARROT,
    runner: RunnerConfig | Mapping[str, Any] | None = None,
    wait_workers: int | None = None,
    clock_speed: float = 1.0,
    **config: Any,
) -> AsyncIterator[SessionServer]:
    """One in-process session-service replica in front of ``workers``, once ``wait_workers``
    (default: all) of them are healthy; stopped afterwards (a test may drain or stop it first).

    ``config``: ``ServiceConfig`` fields (defaults: free port, no /metrics, a fresh replica id, a
    random resume secret, 1 s drain grace); ``runner``: a ``RunnerConfig`` or its fields;
    ``clock_speed``: the replica's clock runs that much faster than real time (``FastClock``)."""
    if runner is not None and not isinstance(runner, RunnerConfig):
        runner = RunnerConfig(**runner)
    config.setdefault("listen", "127.0.0.1:0")
    config.setdefault("metrics_port", -1)
    config.setdefault("replica_id", f"session-test-{uuid.uuid4().hex[:8]}")
    config.setdefault("resume_keys", ResumeKeys.single(os.urandom(32)))
    config.setdefault("drain_grace_s", 1.0)
    # The stall watchdog runs on the same clock: keep its real-time timeout what it always is.
    config.setdefault(
        "worker_stall_timeout_s", ServiceConfig(plugin="", workers=()).worker_stall_timeout_s * clock_speed
    )
    if runner is not None:
        config["runner"] = runner
    cfg = ServiceConfig(plugin=plugin, workers=tuple(workers), **config)
    clock = MONOTONIC if clock_speed == 1.0 else FastClock(clock_speed)
    server = SessionServer(cfg, load_plugin(plugin), clock=clock)
    try:
        await server.start()
        await wait_workers_healthy(server, len(set(workers)) if wait_workers is None else wait_workers)
        yield server
    finally:
        await asyncio.wait_for(server.stop(grace=1.0), 30)


@contextlib.asynccontextmanager
async def in_process_stack(
    n_workers: int = 1,
    *,
    model: str = "parrot",
    plugin: str = PARROT,
    model_options: Mapping[str, object] | None = None,
    worker: Mapping[str, Any] | None = None,
    service: Mapping[str, Any] | None = None,
    runner: RunnerConfig | Mapping[str, Any] | None = None,
    replicas: int = 1,
    clock_speed: float = 1.0,
) -> AsyncIterator[InProcessStack]:
    """``n_workers`` workers of ``model`` and ``replicas`` session-service replicas (``plugin``,
    one shared resume secret, each linked to every worker), in this process.

    ``worker``: ``WorkerConfig`` fields; ``service``: ``ServiceConfig`` fields; ``runner``:
    ``RunnerConfig`` fields; ``clock_speed``: see ``session_server``. Torn down in every case:
    the replicas first, then the workers."""
    service = dict(service or {})
    keys: ResumeKeys = service.pop("resume_keys", None) or ResumeKeys.single(os.urandom(32))
    async with contextlib.AsyncExitStack() as exits:
        workers = [
            await exits.enter_async_context(
                worker_server(model=model, model_options=model_options, **dict(worker or {}))
            )
            for _ in range(n_workers)
        ]
        addresses = [w.address for w in workers]
        sessions = [
            await exits.enter_async_context(
                session_server(
                    addresses,
                    plugin=plugin,
                    runner=runner,
                    resume_keys=keys,
                    clock_speed=clock_speed,
                    **service,
                )
            )
            for _ in range(replicas)
        ]
        yield InProcessStack(workers, sessions, keys)


def _registered(name: str) -> None:
    """Fail on a sample name no registered metric can produce (a typo would compare 0 with 0)."""
    suffixes = ("", "_total", "_created", "_count", "_sum", "_bucket")
    if not any(name == m.name + suffix for m in REGISTRY.collect() for suffix in suffixes):
        raise KeyError(f"no metric in the registry has samples called {name!r}")


def sample(name: str, labels: Mapping[str, str] | None = None) -> float:
    """A sample of the process-wide Prometheus registry (0 when it has none yet)."""
    _registered(name)
    return REGISTRY.get_sample_value(name, dict(labels or {})) or 0.0


def sample_sum(name: str) -> float:
    """Every sample called ``name`` in the process-wide registry, over all label values."""
    _registered(name)
    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
    return text


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return None


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.split()[-1])
    return total


def wait_metric(address: str, name: str, value: float, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = metric_value(metrics_text(address), name)
        if got == value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} is {got}, want {value}")
        time.sleep(0.1)


def speech(i: int) -> np.ndarray:
    """Fixture ``speech_{i}`` as 16 kHz mono float32."""
    x, rate = read_wav(FIXTURES / f"speech_{i:02d}.wav")
    return resample(to_mono(x), rate, 16000)


def utterance_pcm(x16k: np.ndarray, fmt: PcmFormat, *, lead_s: float = 0.2, tail_s: float = 1.2) -> bytes:
    """Silence, the utterance, silence (for turn detection), in ``fmt``."""
    z = np.zeros
    signal = np.concatenate([z(int(lead_s * 16000), np.float32), x16k, z(int(tail_s * 16000), np.float32)])
    return encode(resample(signal, 16000, fmt.sample_rate_hz), fmt)


def to_16k(pcm: bytes, fmt: PcmFormat) -> np.ndarray:
    return resample(to_mono(decode(pcm, fmt)), fmt.sample_rate_hz, 16000)


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Peak normalized cross-correlation over all lags (1.0 = same up to a shift)."""
    a = np.asarray(a, np.float64) - np.mean(a)
    b = np.asarray(b, np.float64) - np.mean(b)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 0.0
    n = _fft_size(len(a) + len(b) - 1)
    corr = np.fft.irfft(np.fft.rfft(a, n) * np.conj(np.fft.rfft(b, n)), n)
    return float(np.max(np.abs(corr)) / (na * nb))


def _fft_size(m: int) -> int:
    """The smallest 2^i 3^j 5^k >= ``m``: any FFT size >= ``m`` gives every lag of the linear
    correlation (no wrap-around), and these sizes are fast (a power of two can be twice as big)."""
    best = 1 << max(m - 1, 0).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            p = p35
            while p < m:
                p *= 2
            best = min(best, p)
            p35 *= 3
        p5 *= 5
    return best


def open_event(
    fmt: PcmFormat = PCM16K_MONO,
    *,
    model: str = "parrot",
    extra_body: dict[str, object] | None = None,
    turn_detection: session_pb2.TurnDetection | None = None,
) -> session_pb2.ClientEvent:
    cfg = session_pb2.SessionConfig(input_format=fmt.to_proto())
    if turn_detection is not None:
        cfg.turn_detection.CopyFrom(turn_detection)
    ev = session_pb2.ClientEvent(event_id="open", open=session_pb2.SessionOpen(model=model, config=cfg))
    if extra_body:
        ev.open.extra_body.update(extra_body)
    return ev


class _Call(Generic[Req]):
    """What both test clients share: the queue of messages to send, how the call ended."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = session_pb2_grpc.DuplexSessionStub(channel)
        self._out: asyncio.Queue[Req | None] = asyncio.Queue()
        self.error: DuplexError | None = None
        self.status: grpc.StatusCode | None = None
        self._changed = asyncio.Event()
        self._done = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None  # type: ignore[type-arg]

    async def _requests(self) -> AsyncIterator[Req]:
        while True:
            msg = await self._out.get()
            if msg is None:
                return
            yield msg

    def _begin(self, call: grpc.aio.StreamStreamCall) -> None:  # type: ignore[type-arg]
        """Read ``call`` in a task of its own until it ends."""
        self._call = call
        self._reader = asyncio.create_task(self._read())

    def _take(self, msg: Any) -> None:
        """Keep one server message (each client its own way)."""
        raise NotImplementedError

    async def _read(self) -> None:
        assert self._call is not None
        try:
            async for msg in self._call:
                self._take(msg)
                self._changed.set()
        except grpc.aio.AioRpcError as exc:
            self.status = exc.code()
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = from_rpc_error(exc)
        else:
            self.status = grpc.StatusCode.OK  # (a call cancelled here ends with neither)
        finally:
            self._done.set()
            self._changed.set()

    def half_close(self) -> None:
        self._out.put_nowait(None)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def wait_done(self, within: float = 10.0) -> None:
        async with asyncio.timeout(within):
            await self._done.wait()

    async def wait_until(self, done: Callable[[], bool], *, within: float = 10.0, what: str = "") -> None:
        """Until ``done()`` holds, looked at after every message (the call ending first fails)."""
        async with asyncio.timeout(within):
            while not done():
                if self._done.is_set():
                    raise AssertionError(
                        f"stream ended ({self.status}, {self.error}) before {what or done}{self._recent()}"
                    )
                self._changed.clear()
                await self._changed.wait()

    def _recent(self) -> str:
        """The last messages kept, for a failure's message."""
        return ""


class Conversation(_Call[session_pb2.ClientEvent]):
    """One Converse stream: send events, await the ones you expect, keep them all."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.events: list[session_pb2.ServerEvent] = []
        self.arrival: list[float] = []
        self.seq = 0
        self.sent_bytes = 0

    def start(self, first: session_pb2.ClientEvent | None = None) -> Conversation:
        if first is not None:
            self.send(first)
        self._begin(self._stub.Converse(self._requests()))
        return self

    def _take(self, msg: Any) -> None:
        self.events.append(msg)
        self.arrival.append(time.monotonic())

    def send(self, ev: session_pb2.ClientEvent) -> None:
        self._out.put_nowait(ev)

    def append(self, pcm: bytes, **kw: object) -> int:
        self.seq += 1
        self.sent_bytes += len(pcm)
        self.send(session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=self.seq, pcm=pcm, **kw)))  # type: ignore[arg-type]
        return self.seq

    async def stream(self, pcm: bytes, fmt: PcmFormat, *, chunk_ms: float = 20, speedup: float = 4.0) -> None:
        """Append ``pcm`` in chunks, faster than real time by ``speedup``."""
        step = fmt.bytes_for_ms(chunk_ms)
        for i in range(0, len(pcm), step):
            self.append(pcm[i : i + step])
            await asyncio.sleep(chunk_ms / 1000 / speedup)

    async def wait_for(
        self, pred: Callable[[session_pb2.ServerEvent], bool], *, within: float = 10.0, start: int = 0
    ) -> session_pb2.ServerEvent:
        """The first event from index ``start`` matching ``pred``."""
        i = start

        def found() -> bool:
            nonlocal i
            while i < len(self.events):
                if pred(self.events[i]):
                    return True
                i += 1
            return False

        await self.wait_until(found, within=within, what="the event")
        return self.events[i]

    def _recent(self) -> str:
        return f": {[str(e).replace(chr(10), ' ')[:120] for e in self.events[-4:]]}"

    async def wait_kind(self, kind: str, *, within: float = 10.0, start: int = 0) -> session_pb2.ServerEvent:
        return await self.wait_for(lambda e: e.WhichOneof("event") == kind, within=within, start=start)

    def of(self, kind: str) -> list[session_pb2.ServerEvent]:
        return [e for e in self.events if e.WhichOneof("event") == kind]

    def kinds(self) -> list[str]:
        return [e.WhichOneof("event") or "" for e in self.events]


class LaneCall(_Call[session_pb2.ClientBatch]):
    """One ConverseMany stream: send events of named lanes, await the ones you expect per lane."""

    def __init__(self, channel: grpc.aio.Channel, *, metadata: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(channel)
        self._metadata = tuple(metadata)
        self.events: dict[str, list[session_pb2.ServerEvent]] = {}
        """Events by lane, in arrival order ("" holds errors about the stream itself)."""
        self.ended: dict[str, list[session_pb2.LaneEnded]] = {}
        """How each lane ended (a name used again may end more than once)."""
        self.order: list[tuple[str, str]] = []
        """(lane, event kind or "ended") of every output, in arrival order."""
        self.batches = 0
        self.seq: dict[str, int] = {}

    def start(self) -> LaneCall:
        self._begin(self._stub.ConverseMany(self._requests(), metadata=self._metadata))
        return self

    def _take(self, msg: Any) -> None:
        self.batches += 1
        for out in msg.outputs:
            if out.HasField("ended"):
                self.ended.setdefault(out.lane, []).append(out.ended)
                self.order.append((out.lane, "ended"))
            else:
                self.events.setdefault(out.lane, []).append(out.event)
                self.order.append((out.lane, out.event.WhichOneof("event") or ""))

    def send(self, *events: tuple[str, session_pb2.ClientEvent]) -> None:
        """One ClientBatch of ``(lane, event)`` pairs."""
        batch = session_pb2.ClientBatch()
        for lane, ev in events:
            batch.events.add(lane=lane).event.CopyFrom(ev)
        self._out.put_nowait(batch)

    def append_event(self, lane: str, pcm: bytes) -> tuple[str, session_pb2.ClientEvent]:
        """The next append of ``lane`` (numbered per lane)."""
        self.seq[lane] = self.seq.get(lane, 0) + 1
        return lane, session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=self.seq[lane], pcm=pcm))

    def of(self, lane: str, kind: str) -> list[session_pb2.ServerEvent]:
        return [e for e in self.events.get(lane, []) if e.WhichOneof("event") == kind]

    async def wait_kind(
        self, lane: str, kind: str, *, within: float = 10.0, count: int = 1
    ) -> session_pb2.ServerEvent:
        await self.wait_until(
            lambda: len(self.of(lane, kind)) >= count, within=within, what=f"{lane}: {kind}"
        )
        return self.of(lane, kind)[count - 1]

    async def wait_ended(self, lane: str, *, within: float = 10.0) -> session_pb2.LaneEnded:
        await self.wait_until(lambda: lane in self.ended, within=within, what=f"{lane} ended")
        return self.ended[lane][-1]


class FakeLink:
    """A worker link for runners without processes: records what the runner hands to the worker;
    every write succeeds at once, unless ``fail_next`` says how many next ones fail."""

    address = "fake:1"

    def __init__(self, worker_id: str | None = "fake-worker") -> None:
        self.worker_id = worker_id
        self.healthy = True
        self.subs: list[worker_pb2.Submission] = []
        self.aborts: list[worker_pb2.Abort] = []
        self.releases: list[worker_pb2.Release] = []
        self.fail_next = 0

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail_next:
            self.fail_next -= 1
            fut.set_exception(ConnectionError("down"))
        else:
            self.subs.extend(subs)
            fut.set_result(None)
        return fut

    def abort(self, abort: worker_pb2.Abort) -> None:
        self.aborts.append(abort)

    def release(self, release: worker_pb2.Release) -> None:
        self.releases.append(release)

    def kinds(self) -> list[int]:
        return [s.kind for s in self.subs]


def drain(r: SessionRunner) -> list[session_pb2.ServerEvent]:
    """Take every event the runner has queued for its client (as a stream would)."""
    out = []
    while (ev := r.outbound.get_nowait()) is not None:
        out.append(ev)
    return out


def unit_runner(
    link: Any,
    *,
    session_id: str,
    pitch: float,
    placer: Placer,
    clock: ManualClock | None = None,
    **cfg: object,
) -> SessionRunner:
    """A started parrot ``SessionRunner`` on ``link`` (a ``FakeLink``) at epoch 1, on a manual
    clock, for unit tests of the runner. An ack per append unless ``coalesce_acks``: these
    tests read the ack window's every answer."""
    plugin = ParrotPlugin()
    r = SessionRunner(
        session_id=session_id,
        settings=plugin.default_settings(),
        runtime_config={"pitch_semitones": pitch, "silence_ms": None},
        link=link,
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=plugin.capabilities(max_sessions=4),
            config=RunnerConfig(**{"coalesce_acks": False, **cfg}),  # type: ignore[arg-type]
            placer=placer,
            clock=clock or ManualClock(),
        ),
    )
    r.start()
    return r
