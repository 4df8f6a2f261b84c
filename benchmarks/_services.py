"""Real service processes for the benchmarks, on loopback: a stack (one worker + one session service,
``duplex.stack.LocalStack``) or a lone worker, with their logs kept in a file shown on failure, and
their /metrics read back (the worker's batch-size histogram).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import IO

from benchmarks._sys import reap
from duplex import spawn
from duplex.stack import Child, LocalStack

PLUGINS = {
    "parrot": "session_service.plugins.parrot:ParrotPlugin",
    "synthetic": "session_service.plugins.synthetic:SyntheticPlugin",
}


def worker_flags(*, device: str, torch_threads: int, max_batch: int | None = None) -> list[str]:
    """Flags every benchmark worker gets: the device and torch's threads passed through as given."""
    flags = ["--device", device]
    if torch_threads:
        flags += ["--torch-threads", str(torch_threads)]
    if max_batch is not None:
        flags += ["--max-batch", str(max_batch)]
    return flags


@contextlib.contextmanager
def stack(
    model: str,
    *,
    device: str,
    torch_threads: int,
    max_batch: int | None = None,
    worker_args: list[str] | None = None,
    session_args: list[str] | None = None,
    max_sessions: int = 2048,
) -> Iterator[LocalStack]:
    """One worker and one session service for ``model``; their stderr shown if the block fails."""
    wflags = worker_flags(device=device, torch_threads=torch_threads, max_batch=max_batch)
    # LocalStack passes --device itself; ours (the same value) comes later and wins.
    with tempfile.TemporaryFile("w+") as log:
        st = LocalStack(
            workers=1,
            model=model,
            plugin=PLUGINS[model],
            device=device,
            # No session bound and no real-time admission: the benchmarks find the limits themselves.
            worker_args=[*wflags, "--max-sessions", "0", "--max-tick-load", "0", *(worker_args or [])],
            session_args=[
                "--max-sessions",
                str(max_sessions),
                "--max-concurrent-rpcs",
                str(2 * max_sessions + 64),
                *(session_args or []),
            ],
            log=log,
        )
        try:
            with st:
                yield st
        except BaseException:
            show_log(log, model)
            raise


def show_log(log: IO[str], name: str, limit: int = 4000) -> None:
    with contextlib.suppress(OSError, ValueError):
        log.seek(0)
        tail = log.read()[-limit:]
        if tail:
            sys.stderr.write(f"--- service logs ({name}) ---\n{tail}\n")


@contextlib.contextmanager
def lone_worker(model: str, flags: list[str], *, timeout_s: float = 90.0) -> Iterator[Child]:
    """``duplex worker`` alone (no session service), stopped by its pid afterwards."""
    with tempfile.TemporaryFile("w+") as log:
        proc = spawn.popen(
            [
                sys.executable,
                "-m",
                "duplex",
                "worker",
                "--model",
                model,
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "0",
                "--worker-id",
                "bench-0",
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            parent_death_signal=signal.SIGTERM,  # gone with this section, even when it is killed
        )
        try:
            worker = _announce(proc, timeout_s)
            yield worker
        except BaseException:
            show_log(log, f"{model} worker")
            raise
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                reap(proc, 15)
            if proc.stdout is not None:
                proc.stdout.close()


def _announce(proc: subprocess.Popen[str], timeout_s: float) -> Child:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.25)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the worker exited with {proc.wait(5)} while starting")
            with contextlib.suppress(json.JSONDecodeError):
                msg = json.loads(line)
                if isinstance(msg, dict) and msg.get("event") == "listening":
                    return Child("worker", proc, str(msg["grpc"]), str(msg.get("metrics", "")))
        elif proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode} while starting")
    raise RuntimeError(f"the worker did not start within {timeout_s:g} s")


def scrape(metrics_address: str, timeout_s: float = 5.0) -> str:
    """The text of a process's /metrics (``HOST:PORT`` as the services announce it)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as resp:
        text: str = resp.read().decode()
    return text


def sample_value(text: str, name: str, labels: str = "") -> float | None:
    """One sample of Prometheus text format: ``NAME{LABELS} VALUE`` with ``labels`` as written
    there (``part="step"``), or an unlabelled ``NAME VALUE``; None when it is not there."""
    head = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(head):
            return float(line.split()[-1])
    return None


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """``NAME_sum`` and ``NAME_count`` of an unlabelled histogram in Prometheus text format."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum "):
            total = float(line.split()[1])
        elif line.startswith(f"{name}_count "):
            count = float(line.split()[1])
    return total, count
