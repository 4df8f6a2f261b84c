"""One load step: N real-time sessions from ``benchmarks.loadgen`` processes against a running
session service, the CPU of every process over the measurement window, the results merged and
judged.

The window: the generators open their sessions (``ready``), all start streaming at T0, the window
is [T0 + warmup, T0 + warmup + seconds], and they stream on for ``tail`` seconds after it (turns
ended in the window get to finish their replies) before closing. CPU is read from /proc at the
window's two ends, here, on the same monotonic clock the generators use.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._sys import FRAME_MS, CpuMeter, pct, summary_ms
from duplex import spawn


@dataclass
class LoadSpec:
    sessions: int
    append_ms: int = 20
    mode: str = "speech"
    model: str = "parrot"
    warmup_s: float = 3.0
    seconds: float = 8.0
    tail_s: float = 3.0
    generators: int = 0
    """Generator processes (0 = one per 64 sessions, at most the cores, at least one)."""
    cycle: int = 32
    seed: int = 1
    separate_acks: bool = False
    """Open without ``acks_on_output`` (every ack an event of its own, sent at hand-on)."""
    lanes: bool = False
    """Each generator's sessions on one ``ConverseMany`` stream, their events sent together."""
    flush_ms: float = 0.0
    """With ``lanes``: how often a generator sends its sessions' pending events (0 = every append)."""


@dataclass
class LoadResult:
    spec: LoadSpec
    merged: dict[str, Any]
    cpu_pct: dict[str, float | None]
    cpu_s: dict[str, float | None]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_detail: dict[str, dict[str, float] | None] = field(default_factory=dict)
    """Per process over the window: user and kernel CPU seconds and context switches
    (``CpuMeter.detail``; the generators summed)."""


def generator_count(spec: LoadSpec) -> int:
    if spec.generators > 0:
        return min(spec.generators, spec.sessions)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(spec.sessions / 64)))


def split(n: int, parts: int) -> list[int]:
    """``n`` sessions over ``parts`` processes, as even as possible."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def run_load(
    target: str,
    spec: LoadSpec,
    pids: dict[str, int],
    *,
    during_window: Any = None,
) -> LoadResult:
    """Run one load step; ``pids`` name the service processes whose CPU to read.
    ``during_window(a, b)``, if given, is called at the window's start (e.g. to start a profiler)."""
    counts = [c for c in split(spec.sessions, generator_count(spec)) if c]
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        outs = [Path(tmp) / f"gen{i}.json" for i in range(len(counts))]
        logs = [open(Path(tmp) / f"gen{i}.log", "w+") for i in range(len(counts))]
        try:
            first = 0
            for i, c in enumerate(counts):
                procs.append(
                    spawn.popen(
                        [
                            sys.executable,
                            "-m",
                            "benchmarks.loadgen",
                            "--target",
                            target,
                            "--sessions",
                            str(c),
                            "--total",
                            str(spec.sessions),
                            "--first-index",
                            str(first),
                            "--append-ms",
                            str(spec.append_ms),
                            "--mode",
                            spec.mode,
                            "--model",
                            spec.model,
                            "--cycle",
                            str(spec.cycle),
                            "--seed",
                            str(spec.seed),
                            "--out",
                            str(outs[i]),
                            *(["--separate-acks"] if spec.separate_acks else []),
                            *(["--lanes", "--flush-ms", f"{spec.flush_ms:g}"] if spec.lanes else []),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=logs[i],
                        text=True,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                        parent_death_signal=signal.SIGTERM,  # gone with this section, even killed
                    )
                )
                first += c
            _await_event(procs, "ready", timeout_s=60.0 + 0.25 * spec.sessions, logs=logs)
            t0 = time.monotonic() + 0.3
            a = t0 + spec.warmup_s
            b = a + spec.seconds
            end = b + spec.tail_s
            go = json.dumps({"start": t0, "window": [a, b], "end": end}) + "\n"
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(go)
                p.stdin.flush()
            meter = CpuMeter({**pids, **{f"generator{i}": p.pid for i, p in enumerate(procs)}})
            time.sleep(max(0.0, a - time.monotonic()))
            meter.start()
            if during_window is not None:
                during_window(a, b)
            time.sleep(max(0.0, b - time.monotonic()))
            cpu = meter.stop()
            _await_event(procs, "done", timeout_s=spec.tail_s + 30.0, logs=logs)
            for p in procs:
                p.wait(15)
            results = [json.loads(o.read_text()) for o in outs]
        except BaseException:
            for i, log in enumerate(logs):
                with contextlib.suppress(OSError, ValueError):
                    log.seek(0)
                    text = log.read()[-2000:]
                    if text:
                        sys.stderr.write(f"--- generator {i} ---\n{text}\n")
            raise
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
                for stream in (p.stdin, p.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
            for log in logs:
                log.close()
    merged = merge(results)
    gens = [k for k in cpu if k.startswith("generator")]
    cpu_pct = {k: v for k, v in cpu.items() if not k.startswith("generator") and k != "other"}
    cpu_pct["generator"] = None if any(cpu[g] is None for g in gens) else sum(cpu[g] or 0.0 for g in gens)
    cpu_pct["other"] = cpu.get("other")
    cpu_s = {k: v for k, v in meter.seconds.items() if not k.startswith("generator")}
    cpu_s["generator"] = (
        None if any(meter.seconds[g] is None for g in gens) else sum(meter.seconds[g] or 0.0 for g in gens)
    )
    merged["generators"] = len(procs)
    detail = {k: v for k, v in meter.detail.items() if not k.startswith("generator")}
    gen_detail = [meter.detail.get(g) for g in gens]
    detail["generator"] = (
        None
        if not gen_detail or any(d is None for d in gen_detail)
        else {k: sum(d[k] for d in gen_detail if d is not None) for k in ("user_s", "system_s", "switches")}
    )
    return LoadResult(
        spec=spec, merged=merged, cpu_pct=cpu_pct, cpu_s=cpu_s, wall_s=meter.wall, cpu_detail=detail
    )


def _await_event(
    procs: list[subprocess.Popen[str]], event: str, *, timeout_s: float, logs: list[Any]
) -> None:
    """Read each generator's stdout until it says ``event``; raise with its reason otherwise."""
    waiting = {p.stdout: p for p in procs if p.stdout is not None}
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{len(waiting)} load generator(s) did not say {event!r} within {timeout_s:.0f} s"
            )
        ready, _, _ = select.select(list(waiting), [], [], min(left, 0.5))
        for stream in ready:
            line = stream.readline()
            if not line:
                p = waiting[stream]
                raise RuntimeError(f"a load generator exited with {p.wait(5)} before {event!r}")
            with contextlib.suppress(json.JSONDecodeError):
                msg = json.loads(line)
                if msg.get("event") == "error":
                    raise RuntimeError(f"load generator: {msg.get('reason')}")
                if msg.get("event") == event:
                    del waiting[stream]


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The generators' results as one: latency lists joined, counts summed."""
    out: dict[str, Any] = {
        "sessions": 0,
        "ack_ms": [],
        "late_ms": [],
        "first_audio_ms": [],
        "turns": 0,
        "answered": 0,
        "unanswered": {},
        "reply_frames": 0.0,
        "per_session": [],
        "errors": {},
        "closed": {},
        "failures": [],
        "failed_sessions": 0,
        "cancelled": 0,
    }
    for r in results:
        out["window_s"] = r["window_s"]
        out["append_ms"] = r["append_ms"]
        for key in ("sessions", "turns", "answered", "reply_frames", "failed_sessions", "cancelled"):
            out[key] += r[key]
        for key in ("ack_ms", "late_ms", "first_audio_ms", "per_session", "failures"):
            out[key] += r[key]
        for key in ("unanswered", "errors", "closed"):
            for k, v in r[key].items():
                out[key][k] = out[key].get(k, 0) + v
    return out


# ---------------------------------------------------------------------------------------------
# judging one step of the capacity ramp


@dataclass(frozen=True)
class Criteria:
    """What a step must hold for its N sessions to count as real-time conversations."""

    ack_p99_ms: float = FRAME_MS
    """p99 of append -> input_ack below one frame period."""
    late_p99_ms: float = FRAME_MS
    """The generator kept its schedule: p99 lateness of an append below one frame period."""
    min_acked_share: float = 0.95
    """Every session: appends acknowledged / appends written in the window."""
    max_unacked_ms: float = 4 * FRAME_MS
    """Every session: audio written but not acknowledged at the window's end."""


def judge(m: dict[str, Any], criteria: Criteria = Criteria(), *, turns: bool = True) -> list[str]:
    """Why a step fails (empty: it passes). ``m`` is a merged load result; ``turns``: every turn
    ended in the window must be answered (and at least one must end)."""
    why: list[str] = []
    if not m["ack_ms"]:
        why.append("no append was acknowledged in the window")
        return why
    ack99 = pct(m["ack_ms"], 99)
    assert ack99 is not None
    if ack99 >= criteria.ack_p99_ms:
        why.append(f"ack p99 {ack99:.1f} ms >= {criteria.ack_p99_ms:g} ms")
    late99 = pct(m["late_ms"], 99)
    if late99 is not None and late99 >= criteria.late_p99_ms:
        why.append(
            f"generator behind its schedule: p99 lateness {late99:.1f} ms >= {criteria.late_p99_ms:g} ms"
        )
    shares = [s["acked"] / s["sent"] for s in m["per_session"] if s["sent"]]
    if len(shares) < len(m["per_session"]):
        why.append(f"{len(m['per_session']) - len(shares)} session(s) sent nothing in the window")
    if shares and min(shares) < criteria.min_acked_share:
        why.append(f"acks behind: a session had {min(shares):.0%} of its window's appends acknowledged")
    append_ms = m.get("append_ms", 20)
    worst = max((s["unacked_at_end"] for s in m["per_session"]), default=0) * append_ms
    if worst > criteria.max_unacked_ms:
        why.append(f"acks behind: {worst:.0f} ms of a session's audio unacknowledged at the window's end")
    if m["errors"]:
        why.append(f"error events {m['errors']}")
    if m["closed"]:
        why.append(f"sessions closed {m['closed']}")
    if m["failed_sessions"]:
        why.append(f"{m['failed_sessions']} session stream(s) failed: {m['failures'][:2]}")
    if turns:
        if m["turns"] == 0:
            why.append("no turn ended in the window")
        elif m["answered"] < m["turns"]:
            why.append(f"{m['turns'] - m['answered']} of {m['turns']} turns unanswered {m['unanswered']}")
    return why


def step_row(r: LoadResult, why: list[str]) -> dict[str, Any]:
    """One ramp step as reported: latencies, turns, CPU, verdict."""
    m = r.merged
    return {
        "sessions": r.spec.sessions,
        "append_ms": r.spec.append_ms,
        "ack_ms": summary_ms(m["ack_ms"]),
        "first_audio_ms": summary_ms(m["first_audio_ms"]),
        "late_ms": summary_ms(m["late_ms"]),
        "turns": m["turns"],
        "answered": m["answered"],
        "unanswered": m["unanswered"],
        "errors": m["errors"],
        "closed": m["closed"],
        "failed_sessions": m["failed_sessions"],
        "min_acked_share": min((s["acked"] / s["sent"] for s in m["per_session"] if s["sent"]), default=None),
        "max_unacked_ms": max((s["unacked_at_end"] for s in m["per_session"]), default=0) * r.spec.append_ms,
        "acked_frames_per_s": sum(s["acked"] for s in m["per_session"])
        * r.spec.append_ms
        / FRAME_MS
        / m["window_s"],
        "reply_frames_per_s": m["reply_frames"] / m["window_s"],
        "cpu_pct": r.cpu_pct,
        "generators": m["generators"],
        "pass": not why,
        "why": why,
    }
