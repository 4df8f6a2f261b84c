"""``duplex up``: the whole local stack -- one session service and N workers -- in one command.

``LocalStack`` is the reusable part (``duplex demo`` and the tests use it): it starts the
children on free loopback ports (port 0; each announces its address in one JSON line on
stdout), waits until the session service's gRPC health says SERVING, and stops them all
by pid. Children run in their own process groups (a terminal's Ctrl-C reaches only us, so
we can stop them in order) and, on Linux, get SIGTERM from the kernel if we die, even by
SIGKILL (PR_SET_PDEATHSIG), so no orphan outlives the stack. They are started by
``duplex.spawn.popen``: no Python runs between fork and exec, so a parent with gRPC's threads
running (a second stack, a client) cannot bring them down.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Self

import grpc
from grpc_health.v1 import health_pb2

from duplex import spawn
from duplex.serving import health_check
from duplex.tls import is_loopback

DEFAULT_PLUGIN = "session_service.plugins.parrot:ParrotPlugin"
#: The session plugin that drives each worker model (``duplex up --model M`` without ``--plugin``).
PLUGINS = {
    "parrot": DEFAULT_PLUGIN,
    "synthetic": "session_service.plugins.synthetic:SyntheticPlugin",
    "moshi": "session_service.plugins.moshi:MoshiPlugin",
}
#: Models served in stages (``duplex up --pipeline P``): the plugin, and each stage's worker model
#: in order (the first stage's workers are the session's ``--workers``, the others
#: ``--stage-workers STAGE=...``; each stage is named after its model).
PIPELINES = {
    "cascade": ("session_service.plugins.cascade:CascadePlugin", ("asr", "responder", "tts")),
    "chat": ("session_service.plugins.chat:ChatPlugin", ("asr", "chat", "tts")),
}
DEFAULT_SESSION_PORT = 50051
_PR_SET_PDEATHSIG = 1


class StackError(RuntimeError):
    """The stack could not start, or a child died."""


def _load_prctl() -> Callable[..., int] | None:
    # Resolved in the parent: the child between fork and exec should do as little as possible.
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """preexec_fn: ask the kernel for ``sig`` when the parent goes, then close the race (use
    ``functools.partial(die_with_parent, os.getpid())``).

    Unsafe in a parent with threads in gRPC: a preexec_fn makes CPython fork() (running gRPC's
    atfork handlers) and run Python in the child before exec, which can kill the child. Use
    ``duplex.spawn.popen(..., parent_death_signal=sig)`` instead (``LocalStack`` does)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@dataclass
class Child:
    """One child process of the stack with what it announced."""

    name: str
    proc: subprocess.Popen[str]
    grpc: str = ""
    metrics: str = ""
    event_loop: str = ""
    """The event loop it announced it runs on (``uvloop`` or ``asyncio``)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics}/metrics" if self.metrics else ""

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pid": self.pid,
            "grpc": self.grpc,
            "metrics": self.metrics_url,
            "event_loop": self.event_loop,
        }


@dataclass
class LocalStack:
    """A session service and ``workers`` parrot workers on loopback, as child processes; with
    ``pipeline`` (``PIPELINES``), ``workers`` workers of each of its stages.

    Use as a context manager (``with LocalStack() as stack: stack.target``) or call
    ``start()`` / ``stop()``. ``log`` receives the children's stderr (default: ours).
    """

    workers: int = 1
    host: str = "127.0.0.1"
    session_port: int = 0
    model: str = "parrot"
    plugin: str = DEFAULT_PLUGIN
    pipeline: str | None = None
    """A model served in stages (``PIPELINES``): its plugin and a pool of workers per stage
    (``model`` and ``plugin`` are then the pipeline's)."""
    stage_counts: dict[str, int] = field(default_factory=dict)
    """With ``pipeline``: workers of a stage other than ``workers``, by stage."""
    device: str = "cpu"
    worker_args: list[str] = field(default_factory=list)
    stage_args: dict[str, list[str]] = field(default_factory=dict)
    """With ``pipeline``: more arguments for the workers of a stage, by stage (the chat stage's
    ``--llm-url`` and ``--llm-model``)."""
    session_args: list[str] = field(default_factory=list)
    realtime_port: int | None = None
    """Also start the Realtime edge (``duplex realtime``) on this port (0 = any free one)."""
    realtime_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 90.0
    log: IO[str] | int | None = None
    session: Child | None = field(default=None, init=False)
    realtime: Child | None = field(default=None, init=False)
    worker_children: list[Child] = field(default_factory=list, init=False)
    started_pids: list[int] = field(default_factory=list, init=False)
    """Every child process this stack started, kept after ``stop`` (to check none is left)."""

    @property
    def children(self) -> list[Child]:
        """Every child, workers first, the edge last."""
        return [
            *self.worker_children,
            *([self.session] if self.session else []),
            *([self.realtime] if self.realtime else []),
        ]

    @property
    def target(self) -> str:
        """``HOST:PORT`` of the session service (what clients connect to)."""
        if self.session is None:
            raise StackError("the stack is not running")
        return self.session.grpc

    @property
    def realtime_url(self) -> str:
        """``ws://HOST:PORT/v1`` of the Realtime edge: an OpenAI SDK's ``base_url`` (with http)."""
        if self.realtime is None:
            raise StackError("the stack runs no Realtime edge")
        return f"ws://{self.realtime.grpc}/v1"

    def _spawn(self, name: str, args: list[str]) -> Child:
        # No preexec_fn: this process has gRPC's threads running (a second stack, a client),
        # and Python between fork and exec can bring the child down (duplex.spawn).
        proc = spawn.popen(
            [sys.executable, "-m", "duplex", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            new_session=True,
            parent_death_signal=signal.SIGTERM,
        )
        child = Child(name, proc)
        self.started_pids.append(proc.pid)
        if name == "session":
            self.session = child
        elif name == "realtime":
            self.realtime = child
        else:
            self.worker_children.append(child)
        return child

    def _await_listening(self, children: list[Child], deadline: float) -> None:
        """Read each child's one JSON "listening" line; later stdout is passed on to stderr."""
        waiting = {c.proc.stdout: c for c in children if c.proc.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(c.name for c in waiting.values())
                raise StackError(f"{names} did not start within {self.startup_timeout_s:g}s")
            ready, _, _ = select.select(list(waiting), [], [], min(left, 0.25))
            for stream in ready:
                child = waiting[stream]
                line = stream.readline()
                if not line:
                    code = child.proc.wait(5)
                    raise StackError(f"{child.name} (pid {child.pid}) exited with code {code} while starting")
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    sys.stderr.write(line)
                    continue
                if isinstance(msg, dict) and msg.get("event") == "listening":
                    # The edge announces its WebSocket address as "realtime".
                    address = msg.get("grpc") or msg.get("realtime", "")
                    child.grpc, child.metrics = str(address), str(msg.get("metrics", ""))
                    child.event_loop = str(msg.get("event_loop", ""))
                    del waiting[stream]
                    _drain(stream)
            for child in waiting.values():
                if child.proc.poll() is not None:
                    raise StackError(
                        f"{child.name} (pid {child.pid}) exited with code {child.proc.returncode}"
                    )

    def start(self) -> Self:
        """Start the workers, then the session service pointed at them; wait until SERVING."""
        if self.children:
            raise StackError("already started")
        deadline = time.monotonic() + self.startup_timeout_s
        stages: tuple[str, ...] = (self.model,)
        if self.pipeline is not None:
            if self.pipeline not in PIPELINES:
                raise StackError(f"unknown pipeline {self.pipeline!r} (known: {', '.join(PIPELINES)})")
            self.plugin, stages = PIPELINES[self.pipeline]
            self.model = stages[0]
        try:
            for model in stages:
                for i in range(self.stage_counts.get(model, self.workers)):
                    prefix = "" if self.pipeline is None else f"{model}-"
                    self._spawn(
                        f"{prefix or 'worker-'}{i}",
                        [
                            "worker",
                            "--model",
                            model,
                            "--listen",
                            f"{self.host}:0",
                            "--metrics-port",
                            "0",
                            "--device",
                            self.device,
                            "--worker-id",
                            f"local-{prefix}{i}",
                            *self.worker_args,
                            *self.stage_args.get(model, []),
                        ],
                    )
            self._await_listening(self.worker_children, deadline)
            later = [
                arg
                for model in stages[1:]
                for arg in (
                    "--stage-workers",
                    f"{model}={','.join(w.grpc for w in self.stage_workers(model))}",
                )
            ]
            session = self._spawn(
                "session",
                [
                    "session",
                    "--plugin",
                    self.plugin,
                    "--workers",
                    ",".join(w.grpc for w in self.stage_workers(stages[0])),
                    *later,
                    "--listen",
                    f"{self.host}:{self.session_port}",
                    "--metrics-port",
                    "0",
                    *self.session_args,
                ],
            )
            self._await_listening([session], deadline)
            self.wait_serving(deadline - time.monotonic())
            if self.realtime_port is not None:
                edge = self._spawn(
                    "realtime",
                    [
                        "realtime",
                        "--session",
                        self.target,
                        "--listen",
                        f"{self.host}:{self.realtime_port}",
                        "--metrics-port",
                        "0",
                        *self.realtime_args,
                    ],
                )
                self._await_listening([edge], deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_serving(self, timeout_s: float) -> None:
        """Poll ``grpc.health.v1.Health/Check`` on the session service until SERVING."""
        deadline = time.monotonic() + max(timeout_s, 1.0)
        last = "no answer"
        with grpc.insecure_channel(self.target) as channel:
            check = health_check(channel)
            while time.monotonic() < deadline:
                dead = self.dead_child()
                if dead is not None:
                    raise StackError(f"{dead.name} (pid {dead.pid}) exited with code {dead.proc.returncode}")
                try:
                    resp = check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                except grpc.RpcError as exc:
                    last = f"{exc.code().name}: {exc.details()}"
                time.sleep(0.1)
        raise StackError(f"session service at {self.target} not SERVING ({last})")

    def stage_workers(self, model: str) -> list[Child]:
        """The workers of one stage of the pipeline (without one: of ``model``, all of them)."""
        if self.pipeline is None:
            return list(self.worker_children)
        return [w for w in self.worker_children if w.name.rsplit("-", 1)[0] == model]

    def dead_child(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.proc.poll() is not None:
                return child
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the edge and the session service (they drain their clients), then the workers;
        SIGKILL stragglers."""
        front = [c for c in (self.realtime, self.session) if c is not None]
        order = [*front, *self.worker_children]
        for group in (front, self.worker_children):
            for child in group:
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in group:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()
                    child.proc.wait(5)
        for child in order:
            if child.proc.stdout is not None:
                with contextlib.suppress(OSError):
                    child.proc.stdout.close()
        self.session = None
        self.realtime = None
        self.worker_children = []

    def describe(self) -> dict[str, object]:
        """Addresses and pids, as printed by ``duplex up --json``."""
        assert self.session is not None
        return {
            "event": "up",
            "target": self.target,
            "pid": os.getpid(),
            "session": self.session.describe(),
            **(
                {"realtime": self.realtime.describe(), "realtime_url": self.realtime_url}
                if self.realtime
                else {}
            ),
            "workers": [w.describe() for w in self.worker_children],
        }

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _drain(stream: IO[str]) -> None:
    """Keep reading a child's stdout after its announcement so the pipe never fills."""

    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                sys.stderr.write(line)

    threading.Thread(target=run, name="stack-stdout", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplex up",
        description=(
            "Start the local stack: one session service and N parrot workers on loopback (CPU). "
            "Ctrl-C or SIGTERM stops everything."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "exit codes: 0 stopped on request, 1 a child process died (the rest are stopped), "
            "2 bad arguments, 3 the stack did not start\n\n"
            "then, in another terminal:\n  duplex talk examples/hello.wav -o reply.wav"
        ),
    )
    p.add_argument("--workers", type=int, default=1, help="number of workers (default: %(default)s)")
    p.add_argument(
        "--session-port",
        type=int,
        default=DEFAULT_SESSION_PORT,
        metavar="P",
        help="session service port, 0 = any free one (default: %(default)s)",
    )
    p.add_argument(
        "--realtime-port",
        type=int,
        default=None,
        metavar="P",
        help="also serve the OpenAI Realtime API (WebSocket and WebRTC, and a page to talk in at /) on "
        "this port, 0 = any free one",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="let the stack listen in plaintext, unauthenticated, on a --host that is not loopback "
        "(it refuses otherwise: for a real deployment configure TLS and tokens on each service)",
    )
    p.add_argument("--model", default="parrot", help="worker model (default: %(default)s)")
    p.add_argument(
        "--plugin",
        default=None,
        help="session plugin, module:Class (default: the model's own: "
        + ", ".join(f"{m} -> {p}" for m, p in PLUGINS.items())
        + ")",
    )
    p.add_argument(
        "--pipeline",
        choices=sorted(PIPELINES),
        default=None,
        help="serve a model in stages instead, --workers workers of each stage (cascade: speech "
        "recognition -> responder -> speech synthesis, each on its own workers; chat: the same with "
        "a language model in the middle, see --llm-url)",
    )
    p.add_argument("--device", default="cpu", help="worker device (default: %(default)s)")
    moshi = p.add_argument_group("moshi model (--model moshi; see duplex worker --help)")
    moshi.add_argument("--checkpoint", default=None, metavar="REPO_OR_DIR", help="the workers' checkpoint")
    moshi.add_argument("--temperature", type=float, default=None, help="the workers' sampling temperature")
    moshi.add_argument("--top-k", type=int, default=None, help="the workers' top-k")
    moshi.add_argument(
        "--worker-max-sessions",
        type=int,
        default=None,
        metavar="N",
        help="each worker's sessions (moshi: slots)",
    )
    chat = p.add_argument_group(
        "chat pipeline (--pipeline chat; see duplex worker --help)",
        "its chat workers' language model: any OpenAI-compatible chat server. The API key comes "
        "from --llm-key-file or the environment variable DUPLEX_LLM_API_KEY",
    )
    chat.add_argument("--llm-url", default=None, metavar="URL", help="the server's API base URL")
    chat.add_argument("--llm-model", default=None, metavar="NAME", help="the model it serves")
    chat.add_argument("--llm-key-file", default=None, metavar="PATH", help="a file holding the API key")
    chat.add_argument(
        "--llm-timeout-s", type=float, default=None, metavar="S", help="the workers' --llm-timeout-s"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print one JSON line {"event": "up", ...} with addresses and pids on stdout '
        "(the text goes to stderr)",
    )
    return p


class _Interrupted(Exception):
    """SIGINT/SIGTERM while the stack is still starting."""


class _Stop:
    """Signal handler state: while starting, a signal aborts the start (which cleans up);
    once up, it asks the main loop for a clean stop."""

    def __init__(self) -> None:
        self.signum = 0
        self.starting = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        if self.starting:
            raise _Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("duplex up: --workers must be at least 1", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not args.insecure:
        print(
            f"duplex up: {args.host} is not a loopback address: the local stack is plaintext and "
            "unauthenticated; pass --insecure to expose it anyway",
            file=sys.stderr,
        )
        return 2
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    text = sys.stderr if args.json else sys.stdout
    stack = LocalStack(
        workers=args.workers, host=args.host, session_port=args.session_port, realtime_port=args.realtime_port
    )
    if args.insecure:
        stack.worker_args = [*stack.worker_args, "--insecure"]
        stack.session_args = [*stack.session_args, "--insecure"]
        stack.realtime_args = [*stack.realtime_args, "--insecure"]
    stack.model, stack.device, stack.pipeline = args.model, args.device, args.pipeline
    stack.plugin = args.plugin or PLUGINS.get(args.model, DEFAULT_PLUGIN)
    if args.pipeline is not None and args.plugin is not None:
        print("duplex up: --pipeline brings its own plugin: leave out --plugin", file=sys.stderr)
        return 2
    llm = (
        ("--llm-url", args.llm_url),
        ("--llm-model", args.llm_model),
        ("--llm-key-file", args.llm_key_file),
        ("--llm-timeout-s", args.llm_timeout_s),
    )
    if args.pipeline == "chat":
        if not args.llm_url or not args.llm_model:
            print("duplex up: --pipeline chat needs --llm-url URL and --llm-model NAME", file=sys.stderr)
            return 2
        stack.stage_args = {"chat": [a for flag, v in llm if v is not None for a in (flag, str(v))]}
    elif any(v is not None for _, v in llm):
        print("duplex up: --llm-* flags are for --pipeline chat", file=sys.stderr)
        return 2
    for flag, value in (
        ("--checkpoint", args.checkpoint),
        ("--temperature", args.temperature),
        ("--top-k", args.top_k),
        ("--max-sessions", args.worker_max_sessions),
    ):
        if value is not None:
            stack.worker_args = [*stack.worker_args, flag, str(value)]
    what = f"{args.model} worker(s)" if args.pipeline is None else f"worker(s) of each {args.pipeline} stage"
    print(f"starting {args.workers} {what} and a session service...", file=sys.stderr)
    try:
        stack.start()
    except StackError as exc:
        print(f"duplex up: {exc}", file=sys.stderr)
        return 3
    except _Interrupted as exc:
        print(f"duplex up: interrupted by {exc} while starting; stopped", file=sys.stderr)
        return 0
    stop.starting = False
    try:
        if args.json:
            print(json.dumps(stack.describe()), flush=True)
        assert stack.session is not None
        print(f"duplex stack is up: session service at {stack.target}", file=text)
        for child in stack.children:
            print(
                f"  {child.name:<9} pid {child.pid:<7} grpc {child.grpc:<21} {child.metrics_url}", file=text
            )
        print(f"try:  duplex talk examples/hello.wav -o reply.wav --target {stack.target}", file=text)
        if stack.realtime is not None:
            base_url = stack.realtime_url.replace("ws://", "http://")
            print(f"Realtime API: {stack.realtime_url}/realtime (OpenAI SDK base_url={base_url})", file=text)
            page = base_url.removesuffix("/v1") + "/"
            print(f"Talk in a browser: {page} (WebRTC: POST {base_url}/realtime/calls)", file=text)
        print("Ctrl-C stops the stack.", file=text, flush=True)
        while not stop.signum:
            dead = stack.dead_child()
            if dead is not None:
                print(
                    f"duplex up: {dead.name} (pid {dead.pid}) exited unexpectedly with code "
                    f"{dead.proc.returncode}; stopping the stack",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
        print(f"\nstopping ({signal.Signals(stop.signum).name})...", file=sys.stderr)
        return 0
    finally:
        stack.stop()
        print("stack stopped", file=sys.stderr)


def example_path(name: str) -> Path:
    """A file under the repository's ``examples/`` (the demo recording)."""
    return Path(__file__).resolve().parent.parent / "examples" / name


if __name__ == "__main__":
    sys.exit(main())
