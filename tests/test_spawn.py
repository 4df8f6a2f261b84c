"""Children started while gRPC's threads are busy survive: no Python, and no fork handler, runs
between fork and exec (``duplex.spawn``, used by ``duplex up``, the benchmarks and the tests).

Each test runs a parent of its own (so pytest's process never forks): a grpc.aio server with
eight clients calling it without pause on a thread, while the main thread starts children the
way under test. The parent counts the before-fork hooks Python ran (``os.register_at_fork``:
CPython runs them only when it forks to run Python in the child, the way gRPC's own handlers
are reached) and gRPC's own fork handlers' complaints on its stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from duplex import spawn
from tests.procs import REPO, pid_alive

pytestmark = pytest.mark.process

PARENT = r"""
import asyncio, functools, json, os, signal, subprocess, sys, threading
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

mode, n = sys.argv[1], int(sys.argv[2])
forks = [0]
os.register_at_fork(before=lambda: forks.__setitem__(0, forks[0] + 1))

async def busy(ready, stop):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest())
        ready.set()
        async def client():
            while not stop.is_set():
                await stub.Check(health_pb2.HealthCheckRequest())
        await asyncio.gather(*(client() for _ in range(8)))
    await server.stop(0)

ready, stop = threading.Event(), threading.Event()
thread = threading.Thread(target=lambda: asyncio.run(busy(ready, stop)))
thread.start()
ready.wait(30)
child = [sys.executable, "-S", "-c", "pass"]
codes = []
try:
    for _ in range(n):
        if mode == "spawn":  # what duplex.stack, the benchmarks and tests/procs.py do now
            proc = __import__("duplex.spawn").spawn.popen(
                child, new_session=True, parent_death_signal=signal.SIGTERM
            )
        elif mode == "stack":  # LocalStack's own spawn (`python -m duplex --help` exits 0)
            from duplex.stack import LocalStack
            proc = LocalStack(log=subprocess.DEVNULL)._spawn("worker-0", ["--help"]).proc
            proc.stdout.read()  # its help, to the end (a closed pipe would fail its write)
            proc.stdout.close()
        else:  # "preexec": the old way, a preexec_fn
            from duplex.stack import die_with_parent
            proc = subprocess.Popen(
                child, start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid())
            )
        codes.append(proc.wait(60))
finally:
    stop.set()
    thread.join(30)
print(json.dumps({"codes": codes, "python_forks": forks[0]}), flush=True)
"""


def run_parent(mode: str, n: int) -> tuple[dict[str, object], str]:
    """The busy parent starting ``n`` children the ``mode`` way: its report and its stderr."""
    env = {**os.environ, "GRPC_VERBOSITY": "INFO"}  # gRPC's fork handlers log at INFO
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)  # the wheel's default: fork support on
    proc = subprocess.run(
        [sys.executable, "-c", PARENT, mode, str(n)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, proc.stderr


GRPC_FORK_HANDLER = "fork() handlers"
"""What gRPC's pthread_atfork handler logs when it runs while other threads are inside gRPC."""


def test_children_survive_a_parent_busy_in_grpc() -> None:
    report, stderr = run_parent("spawn", 30)
    assert report["codes"] == [0] * 30  # a child brought down before exec dies by a signal (< 0)
    assert report["python_forks"] == 0  # no fork that runs Python in the child
    assert GRPC_FORK_HANDLER not in stderr  # gRPC's atfork handlers never ran


def test_local_stack_children_start_without_fork_handlers() -> None:
    report, stderr = run_parent("stack", 3)
    assert report["codes"] == [0] * 3
    assert report["python_forks"] == 0
    assert GRPC_FORK_HANDLER not in stderr


def test_the_old_way_runs_fork_handlers_in_a_busy_grpc_parent() -> None:
    """The control: a preexec_fn (what LocalStack did) forks with Python's and gRPC's handlers,
    every time; the children it killed that way now and then are what the tests above rule out."""
    report, stderr = run_parent("preexec", 5)
    assert report["python_forks"] == 5
    assert GRPC_FORK_HANDLER in stderr


def test_parent_death_signal_reaches_the_child_of_a_killed_parent() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys; from duplex import spawn\n"
            "p = spawn.popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
            " new_session=True, parent_death_signal=signal.SIGTERM)\n"
            "print(p.pid, flush=True); p.wait()",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while b"time.sleep(120)" not in _cmdline(child) and time.monotonic() < deadline:
            time.sleep(0.02)  # the trampoline has asked for the signal and exec'd, in place
        assert b"time.sleep(120)" in _cmdline(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 30
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_missing_program_fails_in_the_parent() -> None:
    with pytest.raises(FileNotFoundError):
        spawn.popen(["duplex-no-such-program"], parent_death_signal=signal.SIGTERM)
