"""How many real-time parrot conversations one session service and one worker hold.

    python -m benchmarks.capacity [--append-ms 20,40] [--steps 16,24,32,...] [--batch1-append-ms 40]
                                  [--profile-s 8] [--device cpu] [--json PATH]

One worker process and one session-service process (``duplex worker``/``duplex session``, real
processes on loopback) and, in processes of their own, the load generators
(``benchmarks.loadgen``, speech mode): N sessions, each streaming the espeak fixtures looped with
pauses at real-time pace, in appends of 20 ms or 40 ms, with the server's turn detection ending
each utterance and the parrot's reply playing in the pause.

A step of N **holds** when, over its measurement window (``benchmarks._load.judge``):

* the p99 of append -> ``input_ack`` (client side) is under one frame period (32 ms);
* every session's input keeps real time: the generators keep their schedule (p99 lateness < 32 ms),
  every session has >= 95 % of its window's appends acknowledged in the window and at most 128 ms
  of audio unacknowledged at its end;
* nothing is dropped: no ``error`` event, no session closed or stream broken, and every turn that
  ended in the window (``committed``) answered by a completed response with audio.

A step that does not hold is run once more, and the second verdict counts (``--no-confirm``: not):
on a shared machine a spike of someone else's work should not end the ramp; a real limit fails twice.

N is ramped over ``--steps`` (one fresh stack per ramp) and the ramp stops at the first step that
does not hold; capacity is the last one that held. When the first step does not hold, N is halved
down to 1; when not even one session holds, the benchmark fails (exit 3) with the reason.

Also, each ramp's rows: ack latency p50/p99, end-of-turn (``committed``) -> first reply audio
p50/p99, CPU of the session service, the worker, the generators and the rest of the machine (% of
a core, /proc). Then:

* **batching gain**: the same ramp at ``--batch1-append-ms`` against ``duplex worker --max-batch 1``,
  capacity with batching over capacity without;
* **profile**: ``py-spy record`` of the session service during one more step at the capacity N of
  the first append size: its top functions;
* with ``--lanes-append-ms``: a ramp at that append size from generators that hold their sessions
  as lanes of one ``ConverseMany`` stream each (``--lanes-steps``);
* with ``--floor-append-ms``: the transport's floor at that append size: a bare grpc.aio echo
  (``benchmarks.grpc_echo``) with one stream per session at the capacity found, one message each
  way per append; the sessions one core could hold at that cost per append
  (``floor_sessions``), and the capacity on per-session streams as a fraction of it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import _profile, grpc_echo
from benchmarks._load import LoadSpec, judge, run_load, step_row
from benchmarks._services import stack
from benchmarks._sys import NoMeasurement, fail, fmt, ints, write_result

Row = dict[str, Any]


def ramp(
    steps: list[int],
    run: Callable[[int], Row],
    out_of_time: Callable[[], bool] = lambda: False,
    *,
    confirm: bool = True,
    smallest: int = 1,
) -> tuple[int | None, list[Row], bool]:
    """Run ascending ``steps`` until one does not hold; (capacity, rows run, stopped by the time
    budget). With ``confirm`` a step that does not hold is run once more and the second verdict
    counts (a spike of someone else's load on a shared machine does not end the ramp; a real limit
    fails twice). When the first step does not hold, N is halved down to ``smallest`` (1); capacity
    None when even that fails. ``out_of_time()`` is asked before each step: when it says so, the
    ramp stops there (capacity is then a lower bound)."""
    rows: list[Row] = []

    def holds(n: int) -> bool | None:
        for attempt in range(2 if confirm else 1):
            if out_of_time():
                return None
            row = run(n)
            row["attempt"] = attempt + 1
            rows.append(row)
            if row["pass"]:
                return True
        return False

    capacity: int | None = None
    for n in steps:
        verdict = holds(n)
        if verdict is None:
            return capacity, rows, True
        if not verdict:
            break
        capacity = n
    if capacity is None:
        n = steps[0] // 2
        while n >= max(1, smallest):
            verdict = holds(n)
            if verdict is None:
                return capacity, rows, True
            if verdict:
                capacity = n
                break
            n //= 2
    return capacity, rows, False


def print_row(label: str, row: Row) -> None:
    a, f, cpu = row["ack_ms"], row["first_audio_ms"], row["cpu_pct"]
    print(
        f"  {label:<14} N={row['sessions']:>4}  ack p50/p99 {fmt(a['p50']):>6}/{fmt(a['p99']):>7} ms  "
        f"first audio p50/p99 {fmt(f['p50'], '.0f'):>5}/{fmt(f['p99'], '.0f'):>5} ms  "
        f"turns {row['answered']}/{row['turns']}  cpu s/w/g/other "
        f"{fmt(cpu.get('session'), '.0f')}/{fmt(cpu.get('worker'), '.0f')}/"
        f"{fmt(cpu.get('generator'), '.0f')}/{fmt(cpu.get('other'), '.0f')} %  "
        + ("holds" if row["pass"] else "FAILS: " + "; ".join(row["why"])),
        flush=True,
    )


def run_ramp(
    args: argparse.Namespace,
    *,
    append_ms: int,
    max_batch: int | None,
    label: str,
    profile_s: int = 0,
    profile_n: Callable[[int | None], int] | None = None,
    out_of_time: Callable[[], bool] = lambda: False,
    lanes: bool = False,
    steps: list[int] | None = None,
    confirm: bool | None = None,
    smallest: int = 1,
) -> dict[str, Any]:
    """One stack, one ramp (and optionally the profiled step on the same stack); ``lanes``: the
    generators hold their sessions as lanes of one ConverseMany stream (also with ``--lanes``)."""
    lanes = lanes or args.lanes
    with stack(
        "parrot",
        device=args.device,
        torch_threads=args.torch_threads,
        max_batch=max_batch,
        worker_args=args.worker_args.split(),
        session_args=args.session_args.split(),
    ) as st:
        assert st.session is not None
        pids = {"session": st.session.pid, "worker": st.worker_children[0].pid}

        def step(n: int, during: Any = None) -> Row:
            spec = LoadSpec(
                sessions=n,
                append_ms=append_ms,
                warmup_s=args.warmup,
                seconds=args.seconds,
                tail_s=args.tail,
                generators=args.generators,
                separate_acks=not args.carried_acks,
                lanes=lanes,
                flush_ms=args.flush_ms,
            )
            r = run_load(st.target, spec, pids, during_window=during)
            dead = st.dead_child()
            if dead is not None:
                raise RuntimeError(f"{dead.name} died during the step (exit {dead.proc.returncode})")
            row = step_row(r, judge(r.merged))
            print_row(label, row)
            return row

        capacity, rows, stopped = ramp(
            steps or args.steps,
            step,
            out_of_time,
            confirm=args.confirm if confirm is None else confirm,
            smallest=smallest,
        )
        out: dict[str, Any] = {
            "append_ms": append_ms,
            "max_batch": max_batch,
            "lanes": lanes,
            "smallest": smallest,
            "capacity": capacity,
            "stopped_by_budget": stopped,
            "steps": rows,
        }
        if stopped:
            print(
                f"  {label}: the time budget is spent: the ramp stopped (capacity >= {capacity})", flush=True
            )
        at = next((r for r in reversed(rows) if r["sessions"] == capacity and r["pass"]), None)
        out["at_capacity"] = at
        if profile_s and profile_n is not None:
            if out_of_time():
                out["profile"] = {"skipped": "the time budget is spent"}
            else:
                out["profile"] = profile_step(step, st.session.pid, profile_n(capacity), profile_s)
    return out


def profile_step(step: Callable[..., Row], pid: int, n: int, seconds: int) -> dict[str, Any]:
    """One more step of ``n`` sessions with py-spy recording the session service in its window,
    twice at once: every thread, Python frames only, without stopping it (where its threads spend
    their samples), and only the thread holding the GIL with native frames (the work one core
    serialises, down to gRPC's core and libc: the top functions; py-spy pauses the process for
    each of these samples, so this step's own latencies are not a capacity figure)."""
    if _profile.py_spy() is None:
        print("  profile: py-spy is not installed: skipped", flush=True)
        return {"skipped": "py-spy not installed"}
    with tempfile.TemporaryDirectory(prefix="bench-prof-") as tmp:
        paths = {"threads": Path(tmp) / "threads.txt", "gil": Path(tmp) / "gil.txt"}
        procs: list[Any] = []

        def start(a: float, b: float) -> None:
            procs.append(_profile.record(pid, seconds, paths["threads"], threads=True))
            procs.append(_profile.record(pid, seconds, paths["gil"], gil=True, threads=True, native=True))

        row = step(n, start)
        errs = []
        for p in procs:
            if p is None:
                continue
            try:
                _, err = p.communicate(timeout=seconds + 30)
                errs.append(err.decode(errors="replace").strip())
            except Exception:
                p.kill()
                p.wait(5)
        if not all(path.exists() for path in paths.values()):
            why = " / ".join(e[-200:] for e in errs if e) or "py-spy wrote nothing"
            print(f"  profile: failed: {why}", flush=True)
            return {"skipped": why, "sessions": n, "step": row}
        threads = _profile.top_functions(paths["threads"].read_text())
        top = _profile.top_functions(paths["gil"].read_text())
    top["all_threads"] = threads
    top.update(sessions=n, seconds=seconds, rate_hz=100, step=row)
    print(f"  profile of the session service at N={n}, {seconds} s at 100 Hz:")
    print(
        "    samples by thread (any state py-spy counts as active): "
        + ", ".join(f"{t} {k}" for t, k in threads["threads"].items())
    )
    print(f"    holding the GIL: {top['samples']} samples; by area (leaf frame):")
    for name, share in top["areas"].items():
        print(f"    {100 * share:5.1f} %  {name}")
    print(f"    {100 * top['through_grpc']:5.1f} %  with gRPC anywhere on the stack")
    print("    top functions by own time:")
    for t in top["own"]:
        print(f"    {100 * t['share']:5.1f} %  {t['function']}")
    print("    project functions by inclusive time:")
    for t in top["inclusive"]:
        print(f"    {100 * t['share']:5.1f} %  {t['function']}")
    return top


def floor_sessions(echo_us_per_pair: float, append_ms: float) -> float:
    """How many sessions one core could hold if each append cost only the transport's floor: one
    gRPC read and one write (the bare echo's CPU per message pair) per append."""
    if echo_us_per_pair <= 0 or append_ms <= 0:
        raise NoMeasurement("the echo's cost per message pair is not a measurement")
    return 1e6 / (echo_us_per_pair * 1000.0 / append_ms)


def measure_floor(append_ms: int, capacity: int | None, seconds: float) -> dict[str, Any]:
    """The transport's floor at ``append_ms`` appends: the bare grpc.aio echo (its own server
    process) with one stream per session at the capacity found (64 when none), one message each
    way per append; the sessions it allows per core, and the capacity as a fraction of that."""
    streams = capacity or 64
    echo = grpc_echo.measure(streams, float(append_ms), seconds=seconds)
    floor = floor_sessions(echo["cpu_us_per_pair"], append_ms)
    out = {
        "append_ms": append_ms,
        "echo": echo,
        "floor_sessions": floor,
        "capacity": capacity,
        "capacity_fraction_of_floor": capacity / floor if capacity else None,
    }
    print(
        f"  transport floor at {append_ms} ms appends: the bare gRPC echo costs "
        f"{echo['cpu_us_per_pair']:.0f} µs per message pair ({streams} streams), so one core holds "
        f"at most {floor:.0f} sessions; capacity "
        f"{capacity if capacity else 'none'} is "
        + (f"{out['capacity_fraction_of_floor']:.2f} of that" if capacity else "no fraction of it"),
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--append-ms", default="20,40", help="append sizes, one ramp each")
    p.add_argument("--steps", default="16,24,32,48,64,96,128,160,192,256,384,512")
    p.add_argument(
        "--batch1-append-ms",
        type=int,
        default=40,
        help="append size of the ramp against --max-batch 1 (batching gain); 0 = skip",
    )
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of streaming before the window")
    p.add_argument("--seconds", type=float, default=8.0, help="the measurement window")
    p.add_argument("--tail", type=float, default=3.0, help="streaming after the window (replies finish)")
    p.add_argument("--generators", type=int, default=0, help="load generator processes (0 = auto)")
    p.add_argument("--worker-args", default="", help="extra flags of the worker, e.g. '--clock free'")
    p.add_argument("--session-args", default="", help="extra flags of the session service")
    p.add_argument(
        "--no-confirm",
        dest="confirm",
        action="store_false",
        help="end a ramp at the first failing step (default: a failing step is run once more)",
    )
    p.add_argument(
        "--carried-acks",
        action="store_true",
        help="sessions read acks carried on output (acked once consumed); default: an input_ack "
        "event per append, sent once handed on (the append->ack latency the step is judged by)",
    )
    p.add_argument(
        "--lanes",
        action="store_true",
        help="each generator holds its sessions as lanes of one ConverseMany stream (acks timed from "
        "each append's deadline, the wait for the next send included)",
    )
    p.add_argument("--flush-ms", type=float, default=8.0, help="--lanes: how often a generator sends")
    p.add_argument(
        "--lanes-append-ms",
        type=int,
        default=0,
        help="also a ramp at this append size from generators holding their sessions as lanes of one "
        "ConverseMany stream (ramp NAME: {ms}ms_lanes; 0 = skip)",
    )
    p.add_argument("--lanes-steps", default="", help="that ramp's session counts (default: --steps)")
    p.add_argument(
        "--floor-append-ms",
        type=int,
        default=0,
        help="measure the transport's floor (a bare gRPC echo, one message each way per append) at this "
        "append size after the ramps, and that ramp's capacity as a fraction of it (0 = skip)",
    )
    p.add_argument("--floor-seconds", type=float, default=5.0, help="the floor's echo window")
    p.add_argument("--profile-s", type=int, default=8, help="py-spy the session service this long (0 = no)")
    p.add_argument("--json", default="", help="write the results here (after each ramp too)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop ramping when a next step would end after this many seconds (0 = no budget)",
    )
    args = p.parse_args(argv)
    args.steps = sorted(set(ints(args.steps)))
    sizes = ints(args.append_ms)
    t0 = time.monotonic()
    step_s = args.warmup + args.seconds + args.tail + 8.0  # opening and closing the sessions too

    def out_of_time() -> bool:
        return bool(args.budget_s) and time.monotonic() + step_s > t0 + args.budget_s

    print(
        f"capacity: parrot on {args.device}, steps {args.steps}, window {args.seconds:g} s "
        f"(+{args.warmup:g} s warm-up, +{args.tail:g} s tail); a step holds with ack p99 < 32 ms, real "
        "time kept, nothing dropped",
        flush=True,
    )
    results: dict[str, Any] = {
        "ramps": {},
        "device": args.device,
        "torch_threads": args.torch_threads,
        "batch1_append_ms": args.batch1_append_ms,
        "complete": False,
    }
    # (name, append ms, max batch, profile seconds, lanes)
    plan: list[tuple[str, int, int | None, int, bool]] = [
        (f"{ms}ms", ms, None, args.profile_s if i == 0 else 0, False) for i, ms in enumerate(sizes)
    ]
    if args.lanes_append_ms:
        # Second: the lanes' capacity is a figure of its own, before the batching gain's ramp.
        plan.insert(1, (f"{args.lanes_append_ms}ms_lanes", args.lanes_append_ms, None, 0, True))
    if args.batch1_append_ms:
        plan.append((f"{args.batch1_append_ms}ms_batch1", args.batch1_append_ms, 1, 0, False))
    lanes_steps = sorted(set(ints(args.lanes_steps))) if args.lanes_steps else None
    try:
        for name, ms, max_batch, profile_s, lanes in plan:
            if out_of_time():
                results["ramps"][name] = {"skipped": "the time budget is spent", "append_ms": ms}
                print(f"  {name}: skipped, the time budget is spent", flush=True)
                continue
            label = f"{ms} ms appends" if max_batch is None else f"{ms} ms, batch 1"
            if lanes:
                label = f"{ms} ms, lanes"
            r = run_ramp(
                args,
                append_ms=ms,
                max_batch=max_batch,
                label=label,
                profile_s=profile_s,
                profile_n=lambda cap: cap or 1,
                out_of_time=out_of_time,
                lanes=lanes,
                steps=lanes_steps if lanes else None,
                # The lanes' ramp is a figure beside the main one: kept short (a failing step is
                # not run again, and it halves no lower than a quarter of its first step).
                confirm=False if lanes else None,
                smallest=max(1, (lanes_steps or args.steps)[0] // 4) if lanes else 1,
            )
            if "profile" in r:
                results["profile"] = r.pop("profile")
            results["ramps"][name] = r
            write_result(args.json, "capacity", results)  # what is done so far survives a kill
        floor_ramp = results["ramps"].get(f"{args.floor_append_ms}ms")
        if args.floor_append_ms and not args.lanes:
            if out_of_time():
                results["floor"] = {"skipped": "the time budget is spent"}
            elif floor_ramp is None or "skipped" in floor_ramp:
                results["floor"] = {"skipped": f"no {args.floor_append_ms} ms ramp was run"}
            else:
                results["floor"] = measure_floor(
                    args.floor_append_ms, floor_ramp.get("capacity"), args.floor_seconds
                )
    except NoMeasurement as exc:
        return fail(str(exc))
    done = {k: r for k, r in results["ramps"].items() if "skipped" not in r}
    failures = [
        f"{name}: not even one session holds real time ({'; '.join(r['steps'][-1]['why'])})"
        for name, r in done.items()
        if r["capacity"] is None and not r["stopped_by_budget"] and not r.get("lanes")
    ]
    gain = None
    key = f"{args.batch1_append_ms}ms"
    batched, single = done.get(key), done.get(f"{key}_batch1")
    if batched and single and not batched["stopped_by_budget"] and not single["stopped_by_budget"]:
        if batched["capacity"] and single["capacity"]:
            gain = batched["capacity"] / single["capacity"]
    results["batching_gain"] = gain
    results["elapsed_s"] = time.monotonic() - t0
    results["complete"] = len(done) == len(plan) and not any(r["stopped_by_budget"] for r in done.values())
    print("capacity (largest N that holds):")
    for name, r in results["ramps"].items():
        if "skipped" in r:
            print(f"  {name:<14} skipped ({r['skipped']})")
            continue
        at = r["at_capacity"]
        extra = f", ack p99 {at['ack_ms']['p99']:.1f} ms" if at else ""
        bound = ">= " if r["stopped_by_budget"] else ""
        print(f"  {name:<14} {bound}{r['capacity'] if r['capacity'] else 'none'}{extra}")
    if gain is not None:
        print(f"  batching gain at {args.batch1_append_ms} ms appends: {gain:.2f}x")
    write_result(args.json, "capacity", results)
    if failures:
        return fail("; ".join(failures))
    if not results["complete"]:
        return fail("the time budget ran out before every ramp finished (the figures so far are kept)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
