"""Start real service processes for tests and always clean them up by their own pid."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from duplex.spawn import popen

REPO = Path(__file__).resolve().parent.parent


@dataclass
class ServiceProcess:
    """A running ``duplex <command>`` child with the addresses it printed."""

    proc: subprocess.Popen[str]
    grpc: str
    metrics: str
    health: str = ""
    """The plaintext health-only listener's HOST:PORT (``--health-listen``; "" without one)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout)


def spawn(
    args: list[str], *, env: dict[str, str] | None = None, stderr: int | None = None
) -> subprocess.Popen[str]:
    """``python -m duplex ARGS`` in the repository, unbuffered, its stdout a text pipe.

    ``stderr`` None inherits it (pytest shows it on failure). Started by ``duplex.spawn.popen``:
    nothing in Python between fork and exec (tests start children while gRPC's threads run)."""
    # No parent_death_signal: start_all starts children from pool threads, and the kernel's
    # signal follows the thread that started the child, not the process.
    return popen(
        [sys.executable, "-m", "duplex", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def start_service(
    args: list[str],
    *,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    stderr: int | None = None,
) -> ServiceProcess:
    """Run ``python -m duplex ARGS`` and wait for its one-line JSON "listening" announcement.

    ``stderr``: a file descriptor for the child's stderr (None inherits it)."""
    proc = spawn(args, env=env, stderr=stderr)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{args[0]} did not announce itself within {timeout}s")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
            if proc.poll() is not None and not ready:
                raise RuntimeError(f"{args[0]} exited with {proc.returncode} before listening")
            if ready:
                line = proc.stdout.readline()
                if not line:  # EOF (select finds it readable for ever): it exited, or closed stdout
                    raise RuntimeError(f"{args[0]} exited with {proc.wait(10)} before listening")
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if msg.get("event") == "listening":
                    return ServiceProcess(proc, msg["grpc"], msg["metrics"], msg.get("health", ""))
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


_A = TypeVar("_A")
_S = TypeVar("_S", bound=ServiceProcess)


def start_all(
    arg_lists: Sequence[_A],
    started: list[_S],
    start: Callable[[_A], _S] = start_service,  # type: ignore[assignment]
) -> list[_S]:
    """``start`` (``start_service``) for each of ``arg_lists`` in parallel; returns them in that
    order.

    Each one that started is appended to ``started`` (for the caller to stop) even when another
    failed, whose error is then raised."""
    new: list[_S] = []
    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(start, args) for args in arg_lists]
        errors = []
        for f in futures:
            try:
                svc = f.result()
            except Exception as exc:  # keep the ones that started, to stop them
                errors.append(exc)
            else:
                started.append(svc)
                new.append(svc)
        if errors:
            raise errors[0]
    return new


@contextmanager
def running(args: list[str], **kwargs: object) -> Iterator[ServiceProcess]:
    """Context manager form of ``start_service``; the process is gone afterwards."""
    svc = start_service(args, **kwargs)  # type: ignore[arg-type]
    try:
        yield svc
    finally:
        svc.terminate()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
