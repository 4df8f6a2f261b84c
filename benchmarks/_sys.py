"""What every benchmark section shares without torch: process CPU time from /proc, the machine and
commit a run was made on, percentiles, and the one exception a section raises when it measured
nothing (``NoMeasurement``: the section exits non-zero with the reason, never prints a zero).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FRAME_MS = 32.0
"""One worker frame of both models: 512 samples at 16 kHz."""


class NoMeasurement(RuntimeError):
    """A benchmark stalled or measured nothing: the section fails with this reason."""


# ---------------------------------------------------------------------------------------------
# CPU time


def parse_stat_cpu(stat: str, ticks: int) -> float:
    """User + system CPU seconds from the text of ``/proc/PID/stat`` (all threads of the process).

    The command name (field 2) may hold spaces and parentheses: fields are counted after the last
    ``)``; utime and stime are fields 14 and 15 of the line."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def parse_stat_times(stat: str, ticks: int) -> tuple[float, float]:
    """(user, system) CPU seconds from the text of ``/proc/PID/stat``: time in the process's own
    code and time in the kernel on its behalf (syscalls, the loopback TCP path, scheduling)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def parse_status_switches(status: str) -> int:
    """Voluntary + involuntary context switches from the text of one thread's
    ``/proc/PID/task/TID/status``."""
    total = 0
    for line in status.splitlines():
        if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
            total += int(line.split(":", 1)[1])
    return total


def proc_detail(pid: int) -> dict[str, float] | None:
    """``user_s``, ``system_s`` and ``switches`` (context switches summed over the threads alive
    now: a thread that ended took its count with it) of a process, and ``main_s``: the CPU of its
    main thread alone (a service's event loop: what runs there is serving, never the model's
    compute, which has threads of its own); None once it is gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/stat") as f:
            user, system = parse_stat_times(f.read(), ticks)
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            main = parse_stat_cpu(f.read(), ticks)
        switches = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
                switches += parse_status_switches(f.read())
    except (OSError, ValueError, IndexError):
        return None
    return {"user_s": user, "system_s": system, "switches": float(switches), "main_s": main}


def cpu_seconds(pid: int | None = None) -> float | None:
    """CPU seconds a process has used (this one when ``pid`` is None); None once it is gone."""
    if pid is None:
        pid = os.getpid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat_cpu(f.read(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of the machine have been busy (``/proc/stat``: all but idle and
    iowait), for what others ran beside a benchmark."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        values = [int(x) for x in fields[1:]]
        busy = sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """CPU use of named processes over a window: ``start()``, then ``stop()`` gives % of a core.

    ``other`` in the result: what the rest of the machine used meanwhile (all cores' busy time
    from /proc/stat less the named processes'), % of a core: a shared machine's noise, shown."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = dict(pids)
        self._t0 = 0.0
        self._c0: dict[str, float | None] = {}
        self._busy0: float | None = None
        self.seconds: dict[str, float | None] = {}
        """CPU seconds each process used in the window."""
        self.detail: dict[str, dict[str, float] | None] = {}
        """Per process, over the window: ``user_s``, ``system_s`` (kernel) and ``switches``
        (context switches of its threads), None for one that went away."""
        self._d0: dict[str, dict[str, float] | None] = {}
        self.wall = 0.0

    def start(self) -> None:
        self._c0 = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._d0 = {name: proc_detail(pid) if pid else None for name, pid in self.pids.items()}
        self._busy0 = machine_busy_seconds()
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, float | None]:
        """% of one core per process over the window (None for a process that went away), and
        ``other``."""
        c1 = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        for name, pid in self.pids.items():
            d0, d1 = self._d0.get(name), proc_detail(pid) if pid else None
            self.detail[name] = None if d0 is None or d1 is None else {k: d1[k] - d0[k] for k in d1}
        busy1 = machine_busy_seconds()
        self.wall = time.monotonic() - self._t0
        out: dict[str, float | None] = {}
        for name in self.pids:
            a, b = self._c0.get(name), c1[name]
            self.seconds[name] = None if a is None or b is None else b - a
            sec = self.seconds[name]
            out[name] = None if sec is None or self.wall <= 0 else 100.0 * sec / self.wall
        ours = [v for v in self.seconds.values()]
        if self._busy0 is not None and busy1 is not None and self.wall > 0 and None not in ours:
            other = (busy1 - self._busy0) - sum(v or 0.0 for v in ours)
            out["other"] = max(0.0, 100.0 * other / self.wall)
        return out


# ---------------------------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float] | Any, q: float) -> float | None:
    """The ``q``-th percentile (0-100, nearest rank: a value that was observed); None if empty."""
    n = len(values)
    if n == 0:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * n))
    return float(ordered[rank - 1])


def summary_ms(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p90, p99 and max of a list of milliseconds, with its count."""
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values) if len(values) else None,
    }


# ---------------------------------------------------------------------------------------------
# where a run was made


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine: CPU model, cores (usable by this process / online), memory, Python, load."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu_model": cpu_model(),
        "cores": usable,
        "cores_online": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "loadavg_at_start": load,
    }


def git_info() -> dict[str, Any]:
    """Commit, branch and whether the tree had uncommitted changes (they change what ran)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(status),
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------------------------------------
# results


def write_result(path: str | os.PathLike[str] | None, section: str, data: dict[str, Any]) -> None:
    """Write a section's machine-readable result (``--json PATH``), with when it was made."""
    if not path:
        return
    out = {"section": section, "finished": now_iso(), **data}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=_json_default) + "\n")


def _json_default(obj: object) -> object:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def reap(proc: subprocess.Popen[str], timeout_s: float) -> None:
    """Wait for a child asked to stop; kill it if it has not ended within ``timeout_s``."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def fail(reason: str) -> int:
    """Print why a section measured nothing; the exit code that says so."""
    print(f"FAILED: {reason}", file=sys.stderr, flush=True)
    return 3


def ints(text: str) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def fmt(value: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def fmt_all(values: Iterable[float | None], spec: str = ".1f") -> list[str]:
    return [fmt(v, spec) for v in values]
