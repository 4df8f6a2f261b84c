"""The benchmark suite: ``python -m benchmarks.run`` (what ``make bench`` runs).

Sections, each in its own Python process (torch settings and event loops of one cannot colour
the next), printed as they finish, each writing its figures as JSON under ``--out``:

1. ``model_steps``: the parrot model alone in a plain loop, per-step time at B = 1 ... 1024;
2. ``grpc_hop``: per-message cost of a grpc.aio bidi stream, one chunk per message vs packed;
3. ``hop_latency``: session -> worker -> session, an APPEND to its consumption report, at 1, 16,
   64 and 256 sessions against a real worker process;
4. ``e2e_bench``: the whole serving path (real processes) as a fraction of the model alone;
5. ``tiers``: CPU per session-frame of the session service and the worker under a fixed load of
   64 sessions, beside the model's own (the worker's overhead over it, the mean batch over the
   sessions), and the same from clients holding their sessions as lanes of one ``ConverseMany``
   stream;
6. ``against_baseline``: the session tier against the baseline's own code (the commit
   ``baseline.json`` was recorded at), both measured now on this machine, in turn;
7. ``worker_ceiling``: one worker's ``Run`` stream driven directly (commands built once), with the
   near-zero ``null`` model and with the parrot: the most real-time sessions per worker process and
   its CPU per session-frame at 64, 256 and 1,024 sessions;
8. ``moshi``: the moshi model (model-native full duplex) on a small checkpoint: its cost per
   session-frame as served against its own plain loop at 1, 8 and 32 slots, the sessions a worker
   holds at real time, and the ticks that missed their deadline;
9. ``capacity``: the most real-time parrot conversations one session service and one worker hold
   (20 and 40 ms appends; 20 ms from generators on lanes too), the same against ``--max-batch 1``
   (batching gain), the transport's floor at 20 ms appends (a bare gRPC echo) and a profile of the
   session service at capacity.

Then ``benchmarks.report`` writes ``BENCHMARKS.md``, ``benchmarks/latest.json`` and the plots
(for ``--device cuda``: under ``benchmarks/gpu/``), comparing with the committed baseline.

A section that stalls, fails or measures nothing makes the run exit non-zero, with the reason;
its figures are then missing from the report, never zeros. About 10 minutes on a 2-core machine.
``--quick`` is a short smoke run for developing the harness (its figures are not a record).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._sys import REPO, git_info, machine, machine_busy_seconds, now_iso


def _children_cpu() -> float:
    """CPU seconds of every finished child process (and their reaped descendants)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


#: With ``--budget-s``: seconds kept for the report at the end, and the least a section may get.
REPORT_RESERVE_S = 20.0
MIN_SECTION_S = 20.0

#: The worker ceiling's ramps (the null model's, the parrot's) and the lanes' capacity ramp: coarse,
#: so that the whole run stays near 10 minutes on a 2-core machine.
CEILING_STEPS = "64,256,512,1024,1536,2048"
CEILING_PARROT_STEPS = "64,256,512"
LANES_STEPS = "96,160,192,256"

Section = tuple[str, str, list[str], int]
"""(module, title, argv after ``python -m benchmarks.MODULE``, timeout in seconds)."""


def sections(
    device: str,
    torch_threads: int,
    *,
    quick: bool = False,
    model_batches: str = "",
    capacity_steps: str = "",
    capacity_seconds: float = 0.0,
    ceiling_steps: str = "",
    ceiling_parrot_steps: str = "",
) -> list[Section]:
    """Every section with its arguments; ``device`` and ``torch_threads`` go to every section that
    runs a model or starts a worker."""
    dev = ["--device", device, "--torch-threads", str(torch_threads)]
    model = ["--batches", model_batches] if model_batches else []
    cap = [*(["--steps", capacity_steps] if capacity_steps else [])]
    cap += ["--seconds", f"{capacity_seconds:g}"] if capacity_seconds else []
    ceiling = [
        "--model",
        "null,parrot",
        "--steps",
        ceiling_steps or CEILING_STEPS,
        "--steps-parrot",
        ceiling_parrot_steps or CEILING_PARROT_STEPS,
    ]
    if quick:
        return [
            (
                "model_steps",
                "the parrot model alone",
                [*dev, "--batches", "1,16,64", "--seconds", "0.2"],
                120,
            ),
            ("grpc_hop", "gRPC message cost", ["--streams", "16", "--chunks", "64", "--pack", "16"], 60),
            ("hop_latency", "hop latency", [*dev, "--sessions", "1,64", "--seconds", "2"], 120),
            (
                "e2e_bench",
                "the serving path vs the model alone",
                [*dev, "--batches", "1,64", "--seconds", "1"],
                240,
            ),
            (
                "tiers",
                "CPU per frame per tier",
                [*dev, "--sessions", "16", "--seconds", "3", "--compare-lanes"],
                120,
            ),
            (
                "against_baseline",
                "against the baseline's commit",
                [*dev, "--sessions", "16", "--rounds", "1", "--seconds", "3"],
                240,
            ),
            (
                "worker_ceiling",
                "the worker's ceiling",
                [
                    *dev,
                    "--model",
                    "null,parrot",
                    "--steps",
                    "64,256",
                    "--steps-parrot",
                    "64",
                    "--seconds",
                    "1",
                    "--warmup",
                    "0.5",
                    "--refine",
                    "0",
                ],
                120,
            ),
            (
                "realtime_edge",
                "the Realtime edge beside direct gRPC",
                [*dev, "--sessions", "8", "--turns", "1"],
                120,
            ),
            (
                "moshi",
                "the moshi model",
                [*dev, "--slots", "1,8", "--ramp", "1,8", "--seconds", "2", "--loop-seconds", "0.5"],
                240,
            ),
            (
                "capacity",
                "capacity",
                [
                    *dev,
                    "--steps",
                    "8,16",
                    "--seconds",
                    "3",
                    "--warmup",
                    "2",
                    "--tail",
                    "3",
                    "--profile-s",
                    "3",
                    "--lanes-append-ms",
                    "20",
                    "--lanes-steps",
                    "16",
                    "--floor-append-ms",
                    "20",
                    "--floor-seconds",
                    "2",
                ],
                500,
            ),
        ]
    return [
        ("model_steps", "the parrot model alone: per-step time at B = 1 ... 1024", [*dev, *model], 300),
        (
            "grpc_hop",
            "gRPC message cost: why the internal hop carries batches",
            ["--streams", "64", "--chunks", "256", "--pack", "64"],
            120,
        ),
        (
            "hop_latency",
            "hop latency: session -> worker -> session",
            [*dev, "--sessions", "1,16,64,256"],
            180,
        ),
        (
            "e2e_bench",
            "e2e_bench: the serving path vs the model alone",
            [*dev, "--seconds", "2", "--batches", "1,16,64"],
            300,
        ),
        (
            "tiers",
            "CPU per session-frame per tier",
            [*dev, "--sessions", "64", "--compare-lanes"],
            240,
        ),
        (
            "against_baseline",
            "the session tier against the baseline's commit, measured in turn",
            [*dev, "--rounds", "2", "--seconds", "6"],
            600,
        ),
        (
            "worker_ceiling",
            "the worker's ceiling: real-time sessions per worker process (null model, parrot)",
            [*dev, *ceiling, "--seconds", "2", "--warmup", "1", "--refine", "1"],
            300,
        ),
        (
            "realtime_edge",
            "the Realtime edge beside direct gRPC: CPU per session-frame, end of speech -> first audio",
            [*dev, "--sessions", "32", "--turns", "2"],
            180,
        ),
        (
            "moshi",
            "the moshi model: as served against its plain loop, sessions at real time",
            # On a GPU the real 7B layout (Moshiko when cached, random weights of its layout else).
            [
                *dev,
                "--checkpoint",
                "auto",
                "--ramp",
                "1,8,16,32,64,96,128",
                "--slots",
                "1,8,32",
                "--seconds",
                "8",
            ]
            if device.startswith("cuda")
            else [*dev, "--slots", "1,8,32", "--seconds", "8"],
            400,
        ),
        (
            "capacity",
            "capacity: real-time parrot conversations",
            [
                *dev,
                *cap,
                "--lanes-append-ms",
                "20",
                "--lanes-steps",
                LANES_STEPS,
                "--floor-append-ms",
                "20",
            ],
            800,
        ),
    ]


def artifacts(device: str) -> dict[str, Path]:
    """Where a run's record goes: the CPU record at the top, a CUDA record under benchmarks/gpu/."""
    if device.startswith("cuda"):
        base = REPO / "benchmarks" / "gpu"
        return {
            "markdown": base / "BENCHMARKS.md",
            "latest": base / "latest.json",
            "baseline": base / "baseline.json",
            "plots": base / "plots",
        }
    return {
        "markdown": REPO / "BENCHMARKS.md",
        "latest": REPO / "benchmarks" / "latest.json",
        "baseline": REPO / "benchmarks" / "baseline.json",
        "plots": REPO / "benchmarks" / "plots",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i], auto: the worker's and the models' device")
    p.add_argument(
        "--torch-threads", type=int, default=1, help="torch intra-op threads of every model/worker"
    )
    p.add_argument("--only", default="", help="comma list of section modules to run, e.g. e2e_bench,tiers")
    p.add_argument("--quick", action="store_true", help="a short smoke run (not a record: no report written)")
    p.add_argument("--out", default=str(REPO / "build" / "bench"), help="where sections write their JSON")
    p.add_argument("--no-report", action="store_true", help="run the sections, write no report")
    p.add_argument("--model-batches", default="", help="model_steps: batch sizes (default 1,2,4,...,1024)")
    p.add_argument("--capacity-steps", default="", help="capacity: the ramp's session counts")
    p.add_argument("--capacity-seconds", type=float, default=0.0, help="capacity: each step's window")
    p.add_argument(
        "--ceiling-steps", default="", help=f"worker_ceiling: the null model's ramp (default {CEILING_STEPS})"
    )
    p.add_argument(
        "--ceiling-parrot-steps",
        default="",
        help=f"worker_ceiling: the parrot's ramp (default {CEILING_PARROT_STEPS})",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="the whole run's time budget: sections get what is left (capacity stops ramping in time, "
        "keeping its figures so far); a section that cannot fit is reported failed (0 = none)",
    )
    args = p.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = now_iso()
    meta: dict[str, Any] = {
        "started": started,
        "git": git_info(),
        "machine": machine(),
        "device": args.device,
        "torch_threads": args.torch_threads,
        "quick": args.quick,
        "sections": {},
    }
    failed: list[str] = []
    start = time.monotonic()
    plan = sections(
        args.device,
        args.torch_threads,
        quick=args.quick,
        model_batches=args.model_batches,
        capacity_steps=args.capacity_steps,
        capacity_seconds=args.capacity_seconds,
        ceiling_steps=args.ceiling_steps,
        ceiling_parrot_steps=args.ceiling_parrot_steps,
    )
    for module, title, cmd, timeout in plan:
        if only and module not in only:
            continue
        result = out / f"{module}.json"
        result.unlink(missing_ok=True)
        for extra in out.glob(f"{module}_*.json"):  # a section's further files (worker_ceiling_parrot)
            extra.unlink()
        print(f"\n=== {title} ===", flush=True)
        t0 = time.monotonic()
        if args.budget_s:
            left = args.budget_s - REPORT_RESERVE_S - (t0 - start)
            if left < MIN_SECTION_S:
                meta["sections"][module] = {
                    "seconds": 0,
                    "ok": False,
                    "reason": "skipped: the time budget is spent",
                }
                print(f"--- {module}: skipped, the time budget is spent", flush=True)
                failed.append(module)
                continue
            timeout = int(min(timeout, left))
            if module == "capacity":
                cmd = [*cmd, "--budget-s", f"{max(1.0, timeout - 20):.0f}"]
        argv_full = [sys.executable, "-m", f"benchmarks.{module}", *cmd, "--json", str(result)]
        busy0, ours0 = machine_busy_seconds(), _children_cpu()
        try:
            code = subprocess.call(argv_full, cwd=REPO, timeout=timeout)
            reason = "" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            code, reason = -1, f"stalled: still running after {timeout} s, stopped"
        elapsed = time.monotonic() - t0
        busy1, ours1 = machine_busy_seconds(), _children_cpu()
        other = None
        if busy0 is not None and busy1 is not None and elapsed > 0:
            other = max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / elapsed)
        if code == 0 and not result.exists():
            code, reason = -1, "wrote no result"
        meta["sections"][module] = {
            "seconds": round(elapsed, 1),
            "ok": code == 0,
            "reason": reason,
            "other_cores": None if other is None else round(other, 2),
        }
        print(
            f"--- {module}: {elapsed:.0f} s"
            + ("" if other is None else f" (the rest of the machine used {other:.2f} cores meanwhile)")
            + ("" if code == 0 else f"; FAILED ({reason})"),
            flush=True,
        )
        if code != 0:
            failed.append(module)
    meta["duration_s"] = round(time.monotonic() - start, 1)
    meta["failed"] = failed
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"\nbenchmarks done in {meta['duration_s']:.0f} s" + (f"; failed: {failed}" if failed else ""))
    if not args.no_report and not args.quick and not only:
        from benchmarks import report

        paths = artifacts(args.device)
        report.write_all(out, paths)
        print(f"wrote {paths['markdown'].relative_to(REPO)}, {paths['latest'].relative_to(REPO)} and plots")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
