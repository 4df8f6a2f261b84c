"""The session tier against the baseline's commit, both measured now on this machine, in turn.

    python -m benchmarks.against_baseline [--base COMMIT] [--rounds 2] [--seconds 6] [--json PATH]

"At most half of today's" compares with a run made on another day, and this kind of shared
machine moves ±10 % from one run to the next and more over an hour. So this section takes the
baseline's own code (the commit ``benchmarks/baseline.json`` was recorded at, or ``--base``;
``git archive`` into a temporary directory) and measures it beside this tree's, in turn:

* **the baseline**: its own ``benchmarks.tiers`` in its own tree (its session service, its load
  generator, one ``Converse`` stream per session; its clients predate acks carried on output and
  take an ``input_ack`` event per append), one window;
* **this tree**: the same 32 sessions at real time (``benchmarks.tiers``' windows, one stack) as
  its clients hold them today (acks carried on output): one ``Converse`` stream per session, and
  the sessions as lanes of one ``ConverseMany`` stream per generator process.

Rounds are mirrored (baseline, streams, lanes; then lanes, streams, baseline; ...), so a steady
drift of the machine's speed weighs on every figure's ratio alike. Each round's ratios (this
tree's session service CPU per session-frame over the baseline's, minutes apart) are the
comparison; the figure is their median, against the target of 0.5.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._services import stack
from benchmarks._sys import REPO, NoMeasurement, fail, write_result
from benchmarks.tiers import compared_row, load_spec, load_window
from duplex import spawn

#: The session tier's target against the baseline: at most half its CPU per session-frame.
TARGET = 0.5

#: How long the baseline's whole ``tiers`` run may take (stack, window, its model and echo loops).
BASE_TIMEOUT_S = 240


def baseline_commit(baseline: Path) -> str:
    """The commit the baseline record was made at."""
    try:
        commit = json.loads(baseline.read_text())["run"]["git"]["commit"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NoMeasurement(f"{baseline} names no commit ({exc})") from exc
    if not isinstance(commit, str) or not commit:
        raise NoMeasurement(f"{baseline} names no commit")
    return commit


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoMeasurement(f"git could not be run ({exc})") from exc


def _last_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    lines = proc.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def checkout(commit: str, dest: Path, *, repo: Path = REPO) -> None:
    """The tree of ``commit`` into ``dest`` (``git archive``: no worktree left behind)."""
    # Resolved first, as a revision and nothing else (a name starting with "-" is no option).
    found = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}")
    if found.returncode != 0:
        if _git(repo, "rev-parse", "--git-dir").returncode != 0:
            raise NoMeasurement(f"{repo} is not a git clone ({_last_line(found)})")
        raise NoMeasurement(f"the baseline's commit {commit[:12]} is not in this clone; a full clone has it")
    proc = _git(repo, "archive", "--format=tar", found.stdout.decode().strip())
    if proc.returncode != 0:
        raise NoMeasurement(f"git archive of {commit[:12]} failed ({_last_line(proc)})")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(dest, filter="data")
        else:  # our own repository's archive
            tar.extractall(dest)


def base_window(
    tree: Path, *, sessions: int, seconds: float, device: str, torch_threads: int
) -> dict[str, Any]:
    """One window of the baseline's own ``tiers`` in its own tree: its CPU per session-frame."""
    out = tree / "build" / "against_baseline.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [
        sys.executable,
        "-m",
        "benchmarks.tiers",
        "--sessions",
        str(sessions),
        "--seconds",
        f"{seconds:g}",
    ]
    argv += ["--device", device, "--torch-threads", str(torch_threads), "--json", str(out)]
    try:
        # Killed with this process (a section's timeout): its stack and load die with it. Set
        # after exec (duplex.spawn): no Python between fork and exec in a threaded parent.
        child = spawn.popen(
            argv,
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            parent_death_signal=signal.SIGTERM,
        )
        try:
            stdout, stderr = child.communicate(timeout=BASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise
        proc = subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)
    except subprocess.TimeoutExpired as exc:
        raise NoMeasurement(f"the baseline's tiers ran past {BASE_TIMEOUT_S} s") from exc
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise NoMeasurement(f"the baseline's tiers failed (exit {proc.returncode}): {' / '.join(tail)}")
    return window_figures(json.loads(out.read_text()), "the baseline's")


def window_figures(result: dict[str, Any], name: str) -> dict[str, Any]:
    """CPU per session-frame of the session service and the worker, the mean batch and whether
    the load held real time, from a ``tiers`` result or a compared row; refuses a window that
    measured no session CPU."""
    us = result.get("cpu_us_per_frame") or {}
    session = us.get("session")
    if not session:
        raise NoMeasurement(f"{name} window measured no session-service CPU")
    return {
        "session_us": session,
        "worker_us": us.get("worker"),
        "generator_us": us.get("generator"),
        "mean_batch": result.get("mean_batch"),
        "held_real_time": bool(result.get("held_real_time")),
    }


def head_windows(
    *, sessions: int, seconds: float, device: str, torch_threads: int, lanes_first: bool = False
) -> dict[str, Any]:
    """This tree's two windows on one stack: one stream per session and lanes, in that order or
    (``lanes_first``) the other."""
    out: dict[str, Any] = {}
    order = [("streams", False), ("lanes", True)]
    with stack("parrot", device=device, torch_threads=torch_threads) as st:
        for name, lanes in order[::-1] if lanes_first else order:
            spec = load_spec(sessions, seconds=seconds, lanes=lanes)
            out[name] = window_figures(
                compared_row(name, *load_window(st, spec), spec), f"this tree's {name}"
            )
    return out


def base_first(round_index: int) -> bool:
    """Whether round ``round_index`` (from 0) measures the baseline first: every other one."""
    return round_index % 2 == 0


def judge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's ratios to the baseline measured in it (written into the round, for the
    record), and their medians against ``TARGET``."""
    if not rounds:
        raise NoMeasurement("no round was measured")
    for r in rounds:
        base = r["base"]["session_us"]
        for name in ("streams", "lanes"):
            r[f"{name}_over_base"] = r[name]["session_us"] / base
    streams = statistics.median(r["streams_over_base"] for r in rounds)
    lanes = statistics.median(r["lanes_over_base"] for r in rounds)
    return {
        "target": TARGET,
        "streams_over_base": streams,
        "lanes_over_base": lanes,
        "streams_met": streams <= TARGET,
        "lanes_met": lanes <= TARGET,
        "held_real_time": all(r[k]["held_real_time"] for r in rounds for k in ("base", "streams", "lanes")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="", help="the commit to measure against (default: baseline.json's)")
    p.add_argument("--baseline", default=str(REPO / "benchmarks" / "baseline.json"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--seconds", type=float, default=6.0, help="each window's length")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        commit = args.base or baseline_commit(Path(args.baseline))
        print(
            f"against the baseline: {commit[:12]} and this tree, {args.sessions} parrot sessions, "
            f"{args.rounds} rounds of {args.seconds:g} s windows in turn",
            flush=True,
        )
        rounds: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="duplex-baseline-") as tmp:
            tree = Path(tmp)
            checkout(commit, tree)
            kw = {
                "sessions": args.sessions,
                "seconds": args.seconds,
                "device": args.device,
                "torch_threads": args.torch_threads,
            }
            for i in range(args.rounds):
                first = base_first(i)
                r: dict[str, Any] = {"base_first": first}
                if first:
                    r["base"] = base_window(tree, **kw)
                r.update(head_windows(**kw, lanes_first=not first))
                if not first:
                    r["base"] = base_window(tree, **kw)
                rounds.append(r)
                print(
                    f"  round {i + 1} ({'baseline first' if first else 'this tree first'}): session service "
                    f"µs per session-frame: baseline {r['base']['session_us']:.0f}, this tree "
                    f"{r['streams']['session_us']:.0f} (one stream per session), "
                    f"{r['lanes']['session_us']:.0f} (lanes)",
                    flush=True,
                )
        verdict = judge(rounds)
    except NoMeasurement as exc:
        return fail(str(exc))
    for i, r in enumerate(rounds):
        print(
            f"  round {i + 1}: over the baseline {r['streams_over_base']:.2f} (one stream per session), "
            f"{r['lanes_over_base']:.2f} (lanes)"
        )
    print(
        f"  median over {len(rounds)} rounds: one stream per session {verdict['streams_over_base']:.2f}x, "
        f"lanes {verdict['lanes_over_base']:.2f}x the baseline's session-service CPU per session-frame "
        f"(target ≤ {TARGET:g})",
        flush=True,
    )
    write_result(
        args.json,
        "against_baseline",
        {
            "base_commit": commit,
            "sessions": args.sessions,
            "window_s": args.seconds,
            "rounds": rounds,
            **verdict,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
