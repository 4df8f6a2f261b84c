"""The record of a benchmark run: ``BENCHMARKS.md``, ``benchmarks/latest.json`` and the plots.

    python -m benchmarks.report [--results build/bench] [--dest DIR] [--set-baseline]

Reads what the sections of ``benchmarks.run`` wrote (``--results``), and writes

* ``latest.json``: the headline figures at the top level (``capacity_sessions``,
  ``capacity_p99_ack_ms``, ``session_cpu_us_per_frame``, ``worker_cpu_us_per_frame``,
  ``model_cpu_us_per_frame``, ``batching_gain``, ``hop_p99_ms_64``, ``e2e_ratio_parrot_b64``,
  ``e2e_ratio_synthetic_b64``, ...; ``null`` when its section failed, never a zero), the targets,
  the run (date, commit, machine) and every section's figures;
* ``BENCHMARKS.md``: the targets, the comparison with the baseline (``baseline.json``: the run
  recorded before the session-tier optimization), every section's tables and plots, the profile,
  how each figure is measured, and the hand-written notes of ``benchmarks/notes.md``;
* the plots (PNG, matplotlib's Agg backend).

``--set-baseline`` copies ``latest.json`` to ``baseline.json`` (the "before" later runs are
compared with); commit it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from benchmarks._sys import FRAME_MS, REPO

#: (key, label, unit, target, direction): direction +1 = higher is better, -1 = lower is better.
HEADLINE: list[tuple[str, str, str, float | None, int]] = [
    ("capacity_sessions", "real-time parrot sessions, 20 ms appends", "sessions", 160, +1),
    ("capacity_p99_ack_ms", "append -> ack p99 at that capacity", "ms", None, -1),
    ("capacity_sessions_40ms", "real-time parrot sessions, 40 ms appends", "sessions", None, +1),
    ("capacity_p99_first_audio_ms", "end of turn -> first audio p99 at capacity (20 ms)", "ms", None, -1),
    (
        "capacity_sessions_lanes_20ms",
        "real-time parrot sessions, 20 ms appends, generators on lanes of ConverseMany",
        "sessions",
        160,
        +1,
    ),
    (
        "capacity_fraction_of_floor_streams_20ms",
        "capacity at 20 ms appends (one stream per session) over what the transport's floor allows",
        "ratio",
        0.8,
        +1,
    ),
    ("first_audio_p99_ms_64", "end of speech -> first reply audio p99, 64 sessions (20 ms)", "ms", None, -1),
    (
        "realtime_edge_cpu_us_per_frame",
        "Realtime edge CPU per 20 ms session-frame, 32 sessions",
        "µs",
        None,
        -1,
    ),
    (
        "realtime_edge_first_audio_p99_ms",
        "end of speech -> first audio p99 through the Realtime edge, 32 sessions",
        "ms",
        None,
        -1,
    ),
    (
        "realtime_direct_first_audio_p99_ms",
        "the same over direct gRPC (lanes of one ConverseMany stream)",
        "ms",
        None,
        -1,
    ),
    ("session_cpu_us_per_frame", "session service CPU per session-frame", "µs", 60, -1),
    (
        "session_cpu_us_per_frame_separate_acks",
        "session service CPU per session-frame, an input_ack event per append",
        "µs",
        None,
        -1,
    ),
    ("worker_cpu_us_per_frame", "worker CPU per session-frame", "µs", None, -1),
    (
        "mean_batch_fraction_64_streams",
        "worker's mean batch / sessions with input, 64 sessions",
        "ratio",
        0.9,
        +1,
    ),
    (
        "mean_batch_fraction_64_lanes",
        "the same, sessions as lanes of one ConverseMany stream",
        "ratio",
        0.9,
        +1,
    ),
    (
        "worker_overhead_us_per_frame_streams",
        "worker overhead: its CPU minus the model's whole share, per session-frame",
        "µs",
        30,
        -1,
    ),
    (
        "worker_overhead_us_per_frame_lanes",
        "the same, sessions as lanes of one ConverseMany stream",
        "µs",
        30,
        -1,
    ),
    (
        "worker_ceiling_sessions",
        "real-time sessions per worker process, near-zero model",
        "sessions",
        1000,
        +1,
    ),
    ("worker_ceiling_sessions_parrot", "the same with the parrot", "sessions", None, +1),
    (
        "worker_ceiling_us_per_frame_1024",
        "worker CPU per session-frame at 1,024 sessions, near-zero model",
        "µs",
        None,
        -1,
    ),
    (
        "session_cpu_us_per_frame_step_interval",
        "session service CPU per session-frame, worker on the free clock, --step-interval-ms",
        "µs",
        None,
        -1,
    ),
    (
        "worker_cpu_us_per_frame_step_interval",
        "worker CPU per session-frame, worker on the free clock, --step-interval-ms",
        "µs",
        None,
        -1,
    ),
    (
        "session_cpu_us_per_frame_lanes",
        "session service CPU per session-frame, sessions as lanes of one ConverseMany stream",
        "µs",
        None,
        -1,
    ),
    (
        "worker_cpu_us_per_frame_lanes",
        "worker CPU per session-frame, sessions as lanes of one ConverseMany stream",
        "µs",
        None,
        -1,
    ),
    (
        "session_over_baseline_now",
        "session service CPU per session-frame over the baseline commit's, both measured now, "
        "one stream per session",
        "x",
        0.5,
        -1,
    ),
    (
        "lanes_over_baseline_now",
        "the same, sessions as lanes of one ConverseMany stream",
        "x",
        0.5,
        -1,
    ),
    ("model_cpu_us_per_frame", "model alone CPU per frame, same batch", "µs", None, -1),
    (
        "model_reply_us_per_frame",
        "model's reply synthesis per session-frame (helper threads, once per turn)",
        "µs",
        None,
        -1,
    ),
    ("session_over_model", "session service / model CPU per frame", "x", None, -1),
    ("worker_over_model_whole", "worker / the model's whole share (step and reply synthesis)", "x", None, -1),
    ("batching_gain", "capacity with batching / --max-batch 1", "x", 4, +1),
    ("hop_p99_ms_64", "hop latency p99, 64 sessions", "ms", 5, -1),
    ("e2e_ratio_parrot_b64", "end-to-end / model alone, parrot B=64", "ratio", 0.3, +1),
    ("e2e_ratio_synthetic_b64", "end-to-end / model alone, synthetic B=64", "ratio", 0.3, +1),
    ("model_largest_batch_32ms", "largest parrot batch stepped within 32 ms", "B", None, +1),
]


#: Figures the baseline has no key of its own for, and the baseline figure they are the "after"
#: of: the session tier's CPU with the clients on lanes, against one stream per session.
BASELINE_OF = {
    "session_cpu_us_per_frame_lanes": "session_cpu_us_per_frame",
    "worker_cpu_us_per_frame_lanes": "worker_cpu_us_per_frame",
}


def load_sections(results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "model_steps",
        "grpc_hop",
        "hop_latency",
        "e2e_bench",
        "tiers",
        "against_baseline",
        "worker_ceiling",
        "worker_ceiling_parrot",
        "realtime_edge",
        "moshi",
        "capacity",
    ):
        path = results / f"{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if d is None:
            return None
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def headline(sections: dict[str, Any]) -> dict[str, Any]:
    """The top-level figures of ``latest.json`` (None where a section failed or was not run)."""
    cap = sections.get("capacity", {})
    ramps = cap.get("ramps", {})
    tiers = sections.get("tiers")
    h: dict[str, Any] = {
        "capacity_sessions": _get(ramps, "20ms", "capacity"),
        "capacity_is_lower_bound": bool(_get(ramps, "20ms", "stopped_by_budget")),
        "capacity_p99_ack_ms": _get(ramps, "20ms", "at_capacity", "ack_ms", "p99"),
        "capacity_p99_first_audio_ms": _get(ramps, "20ms", "at_capacity", "first_audio_ms", "p99"),
        "capacity_sessions_40ms": _get(ramps, "40ms", "capacity"),
        "capacity_p99_ack_ms_40ms": _get(ramps, "40ms", "at_capacity", "ack_ms", "p99"),
        "capacity_sessions_batch1_40ms": _get(ramps, "40ms_batch1", "capacity"),
        "batching_gain": cap.get("batching_gain") if cap else None,
        "session_cpu_us_per_frame": _get(tiers, "cpu_us_per_frame", "session"),
        "session_cpu_us_per_frame_separate_acks": (
            _get(tiers, "cpu_us_per_frame", "session")
            if _get(tiers, "separate_acks")
            else _get(tiers, "separate_acks_compared", "cpu_us_per_frame", "session")
        ),
        "worker_cpu_us_per_frame": _get(tiers, "cpu_us_per_frame", "worker"),
        "model_cpu_us_per_frame": _get(tiers, "model_at_mean_batch", "cpu_us_per_frame"),
        "model_reply_us_per_frame": _get(tiers, "model_reply_us_per_frame"),
        "session_cpu_us_per_frame_step_interval": _get(
            tiers, "step_interval_compared", "cpu_us_per_frame", "session"
        ),
        "worker_cpu_us_per_frame_step_interval": _get(
            tiers, "step_interval_compared", "cpu_us_per_frame", "worker"
        ),
        "session_cpu_us_per_frame_lanes": _get(tiers, "lanes_compared", "cpu_us_per_frame", "session"),
        "worker_cpu_us_per_frame_lanes": _get(tiers, "lanes_compared", "cpu_us_per_frame", "worker"),
        "lanes_flush_ms": _get(tiers, "lanes_compared", "flush_ms"),
        "lanes_ack_p99_ms": _get(tiers, "lanes_compared", "ack_p99_ms"),
        "tiers_mean_batch": _get(tiers, "mean_batch"),
        "tiers_held_real_time": _get(tiers, "held_real_time"),
        "session_kernel_us_per_frame": _get(tiers, "cpu_detail_per_frame", "session", "kernel_us"),
        "session_switches_per_frame": _get(tiers, "cpu_detail_per_frame", "session", "switches"),
        "grpc_echo_us_per_pair": _get(tiers, "grpc_echo", "cpu_us_per_pair"),
        "session_over_baseline_now": _get(sections, "against_baseline", "streams_over_base"),
        "lanes_over_baseline_now": _get(sections, "against_baseline", "lanes_over_base"),
    }
    e = h["grpc_echo_us_per_pair"]
    s_ = h["session_cpu_us_per_frame"]
    h["session_over_grpc_echo"] = s_ / e if s_ and e else None
    s, m = h["session_cpu_us_per_frame"], h["model_cpu_us_per_frame"]
    h["session_over_model"] = s / m if s and m else None
    w = h["worker_cpu_us_per_frame"]
    h["worker_over_model"] = w / m if w and m else None
    r = h["model_reply_us_per_frame"]
    h["worker_over_model_whole"] = w / (m + r) if w and m and r is not None else None
    for row in _get(sections, "hop_latency", "rows") or []:
        h[f"hop_p50_ms_{row['sessions']}"] = _get(row, "hop_ms", "p50")
        h[f"hop_p99_ms_{row['sessions']}"] = _get(row, "hop_ms", "p99")
    h.setdefault("hop_p99_ms_64", None)
    for row in _get(sections, "e2e_bench", "rows") or []:
        h[f"e2e_ratio_{row['model']}_b{row['batch']}"] = row.get("in_ratio")
    h.setdefault("e2e_ratio_parrot_b64", None)
    h.setdefault("e2e_ratio_synthetic_b64", None)
    ms = sections.get("model_steps")
    h["model_largest_batch_32ms"] = _get(ms, "largest_batch_within_frame")
    for row in _get(ms, "rows") or []:
        h[f"model_ms_per_step_b{row['batch']}"] = row["ms_per_step"]
    h["grpc_packed_over_single"] = _get(sections, "grpc_hop", "packed_over_single")
    h.update(_issue21(sections))
    h["session_profile_through_grpc"] = _get(cap, "profile", "through_grpc")
    mo = sections.get("moshi")
    h["moshi_sessions_at_real_time"] = _get(mo, "sessions_at_real_time")
    for row in _get(mo, "served") or []:
        n = row["sessions"]
        h[f"moshi_served_over_plain_b{n}"] = row.get("served_over_plain")
        h[f"moshi_worker_us_per_session_frame_b{n}"] = row.get("worker_cpu_us_per_session_frame")
        h[f"moshi_ticks_late_pct_b{n}"] = row.get("ticks_late_pct")
    return h


def _overhead(row: Any) -> float | None:
    """Worker CPU minus the model's whole share per session-frame, from a tiers window (its own
    figure, or computed from its parts)."""
    v = _get(row, "worker_overhead_us_per_frame")
    if v is not None:
        return v
    w, m = _get(row, "cpu_us_per_frame", "worker"), _get(row, "model_at_mean_batch", "cpu_us_per_frame")
    r = _get(row, "model_reply_us_per_frame")
    return w - m - r if w is not None and m is not None and r is not None else None


def _in_place(row: Any) -> float | None:
    """What the model spent in the worker per session-frame (steps and helper threads)."""
    d = _get(row, "model_in_place_us_per_frame")
    return None if d is None else float(d["step"] + d["helpers"])


def _step_at(ramp: Any, n: int) -> dict[str, Any] | None:
    """A ramp's last attempt at ``n`` sessions."""
    rows = [s for s in _get(ramp, "steps") or [] if s.get("sessions") == n]
    return rows[-1] if rows else None


def _issue21(sections: dict[str, Any]) -> dict[str, Any]:
    """The frame clock's figures: the mean batch against the sessions with input and the worker's
    overhead over its model (tiers, both client modes), the worker's ceiling, the capacity from
    lanes and against the transport's floor, end of speech -> first audio at 64 sessions."""
    tiers = sections.get("tiers")
    lanes = _get(tiers, "lanes_compared")
    n = _get(tiers, "sessions")
    at64 = n == 64
    ramps = _get(sections, "capacity", "ramps") or {}
    floor = _get(sections, "capacity", "floor")
    step64 = _step_at(ramps.get("20ms"), 64)
    null, parrot = sections.get("worker_ceiling"), sections.get("worker_ceiling_parrot")
    h: dict[str, Any] = {
        "tiers_sessions": n,
        "mean_batch_fraction_64_streams": _get(tiers, "mean_batch") / n if at64 and tiers else None,
        "mean_batch_fraction_64_lanes": (
            _get(lanes, "mean_batch") / n if at64 and _get(lanes, "mean_batch") is not None else None
        ),
        "worker_overhead_us_per_frame_streams": _overhead(tiers),
        "worker_overhead_us_per_frame_lanes": _overhead(lanes),
        "model_whole_us_per_frame_lanes": _get(lanes, "model_whole_us_per_frame"),
        # Where the overhead sits: the worker's event loop thread (serving alone) and what its
        # other threads spend beyond the model's share (the engine's Python, the model slowed
        # by everything running beside it).
        "worker_event_loop_us_per_frame_streams": _get(tiers, "worker_split_us_per_frame", "event_loop"),
        "worker_event_loop_us_per_frame_lanes": _get(lanes, "worker_split_us_per_frame", "event_loop"),
        "worker_threads_beyond_model_us_per_frame_lanes": _get(
            lanes, "worker_split_us_per_frame", "other_beyond_model"
        ),
        # The model as served (its own CPU counter in the worker: steps and helper threads) and
        # the worker's CPU beside it; the model's step once a frame period in a plain loop.
        "model_in_place_us_per_frame_streams": _in_place(tiers),
        "model_in_place_us_per_frame_lanes": _in_place(lanes),
        "model_paced_us_per_frame": _get(tiers, "model_paced_at_mean_batch", "cpu_us_per_frame"),
        "worker_serving_us_per_frame_streams": _get(tiers, "worker_serving_us_per_frame"),
        "worker_serving_us_per_frame_lanes": _get(lanes, "worker_serving_us_per_frame"),
        # The overhead over the model as a frame clock runs it, from its plain loop: its step once
        # a frame period and one reply per frame period, idle between (caches cold as served).
        "model_as_served_us_per_frame_streams": _get(tiers, "model_as_served_us_per_frame"),
        "model_as_served_us_per_frame_lanes": _get(lanes, "model_as_served_us_per_frame"),
        "worker_overhead_as_served_us_per_frame_streams": _get(
            tiers, "worker_overhead_as_served_us_per_frame"
        ),
        "worker_overhead_as_served_us_per_frame_lanes": _get(lanes, "worker_overhead_as_served_us_per_frame"),
        # The worker link: WorkerCommands per worker step (one per tick is the aim) and the share
        # written for a tick that came too late for it.
        "worker_commands_per_step_streams": _get(tiers, "link_commands", "per_step"),
        "worker_commands_per_step_lanes": _get(lanes, "link_commands", "per_step"),
        "worker_tick_missed_fraction_streams": _get(tiers, "link_commands", "missed_fraction"),
        "worker_tick_missed_fraction_lanes": _get(lanes, "link_commands", "missed_fraction"),
        "lanes_mean_batch": _get(lanes, "mean_batch"),
        "worker_ceiling_sessions": _get(null, "ceiling_sessions"),
        "worker_ceiling_first_behind": _get(null, "first_behind_sessions"),
        # No step behind: the ceiling is the largest N measured, a lower bound.
        "worker_ceiling_is_lower_bound": None if null is None else not null.get("first_behind_sessions"),
        "worker_ceiling_sessions_parrot": _get(parrot, "ceiling_sessions"),
        "worker_ceiling_first_behind_parrot": _get(parrot, "first_behind_sessions"),
        "capacity_sessions_lanes_20ms": _get(ramps, "20ms_lanes", "capacity"),
        "capacity_lanes_is_lower_bound": bool(_get(ramps, "20ms_lanes", "stopped_by_budget")),
        "capacity_floor_sessions_20ms": _get(floor, "floor_sessions"),
        "capacity_fraction_of_floor_streams_20ms": _get(floor, "capacity_fraction_of_floor"),
        "grpc_echo_us_per_pair_20ms": _get(floor, "echo", "cpu_us_per_pair"),
        "first_audio_p99_ms_64": _get(step64, "first_audio_ms", "p99"),
        "first_audio_64_held": None if step64 is None else bool(step64.get("pass")),
        "realtime_edge_cpu_us_per_frame": _get(
            sections, "realtime_edge", "edge", "cpu_us_per_session_frame", "edge"
        ),
        "realtime_edge_first_audio_p99_ms": _get(sections, "realtime_edge", "edge", "first_audio_ms", "p99"),
        "realtime_direct_first_audio_p99_ms": _get(
            sections, "realtime_edge", "direct", "first_audio_ms", "p99"
        ),
    }
    for k in ("64", "256", "1024"):
        h[f"worker_ceiling_us_per_frame_{k}"] = _get(null, "us_per_session_frame", k)
    for k in ("64", "256", "512"):
        row = next((r for r in _get(parrot, "rows") or [] if str(r.get("sessions")) == k), None)
        h[f"worker_ceiling_parrot_us_per_frame_{k}"] = _get(row, "us_per_session_frame")
    return h


def targets(h: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, label, unit, target, direction in HEADLINE:
        if target is None:
            continue
        value = h.get(key)
        met = None if value is None else (value >= target if direction > 0 else value <= target)
        out.append(
            {
                "key": key,
                "label": label,
                "unit": unit,
                "target": target,
                "direction": direction,
                "value": value,
                "met": met,
            }
        )
    return out


def build_latest(results: Path) -> dict[str, Any]:
    sections = load_sections(results)
    run_path = results / "run.json"
    run = json.loads(run_path.read_text()) if run_path.exists() else {}
    h = headline(sections)
    h["contended_sections"] = contended(run)
    return {"schema": 1, **h, "targets": targets(h), "run": run, "sections": sections}


# ---------------------------------------------------------------------------------------------
# markdown


def f(value: Any, spec: str = ".1f", none: str = "—") -> str:
    if value is None:
        return none
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and not spec.endswith("%"):
        return f"{value:,}"
    return format(value, spec)


def _spec(unit: str) -> str:
    return {"sessions": "d", "B": "d", "x": ".2f", "ratio": ".3f"}.get(unit, ".1f")


def _with_unit(value: Any, unit: str) -> str:
    if value is None:
        return "—"
    text = f(value, _spec(unit))
    if unit == "x":
        return f"{text}x"
    return text if unit == "ratio" else f"{text} {unit}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(
    latest: dict[str, Any], baseline: dict[str, Any] | None, plots: dict[str, str], notes: str
) -> str:
    run = latest.get("run", {})
    sec = latest.get("sections", {})
    mach = run.get("machine", {})
    git = run.get("git", {})
    out: list[str] = []
    add = out.append
    add("# Benchmarks\n")
    add(
        "Generated by `make bench` (`python -m benchmarks.run`, then `benchmarks/report.py`): do not edit "
        "by hand; the hand-written notes come from `benchmarks/notes.md`. Figures are one run on the "
        "machine below, where the load generator, the session service and the worker share the cores; "
        "ratios and CPU per frame carry over to other machines better than rates and latencies do. "
        "A figure shown as — was not measured (its section failed: see *Failures*).\n"
    )
    add(
        _table(
            ["run", ""],
            [
                ["date (UTC)", str(run.get("started", "—"))],
                [
                    "commit",
                    f"`{git.get('commit', '—')[:12]}` {git.get('subject', '')}"
                    + (" (uncommitted changes)" if git.get("dirty") else ""),
                ],
                [
                    "machine",
                    f"{mach.get('cpu_model', '—')}, {mach.get('cores', '—')} cores, "
                    f"{mach.get('memory_gib', '—')} GiB",
                ],
                ["load average at start", ", ".join(str(x) for x in mach.get("loadavg_at_start", [])) or "—"],
                ["device", f"{run.get('device', '—')} (torch threads {run.get('torch_threads', '—')})"],
                ["duration", f"{f(run.get('duration_s'), '.0f')} s"],
            ],
        )
    )
    add("")
    busy = contended(run)
    if busy:
        add(
            "**The machine was busy with other work during this run** (cores used by other processes: "
            + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
            + f"; more than {BUSY_CORES:g} core flags a section): its figures are lower, and its "
            "latencies higher, than the code's own; compare with care.\n"
        )
    if run.get("device", "cpu").startswith("cuda") is False:
        add(
            "No GPU figure is in this record: it was measured on CPU. `make bench DEVICE=cuda` (or "
            "`benchmarks/gpu.sh`) records a GPU run under `benchmarks/gpu/`.\n"
        )

    # targets
    add("## Against the targets\n")
    rows = []
    for t in latest.get("targets", []):
        op = "≥" if t["direction"] > 0 else "≤"
        rows.append(
            [
                t["label"],
                f"{op} {_with_unit(t['target'], t['unit'])}",
                _with_unit(t["value"], t["unit"]),
                "not measured" if t["met"] is None else ("**met**" if t["met"] else "**missed**"),
            ]
        )
    add(_table(["figure", "target", "this run", ""], rows))
    add("")
    _bounds_md(add, latest)

    # baseline
    add("## Compared with the baseline\n")
    if baseline is None:
        add(
            "No `baseline.json` yet: `python -m benchmarks.report --set-baseline` makes this run "
            "the baseline.\n"
        )
    else:
        brun = baseline.get("run", {})
        add(
            f"Baseline: `{brun.get('git', {}).get('commit', '—')[:12]}` of {brun.get('started', '—')} "
            f"({_get(brun, 'machine', 'cpu_model') or '—'}, {_get(brun, 'machine', 'cores') or '—'} cores) "
            "— the run recorded before the session-tier optimization. Compare on the same machine only.\n"
        )
        rows = []
        for key, label, unit, _target, direction in HEADLINE:
            b, v = baseline.get(key, baseline.get(BASELINE_OF.get(key, ""))), latest.get(key)
            change = "—"
            if isinstance(b, int | float) and isinstance(v, int | float) and b:
                ratio = v / b
                better = (ratio > 1) == (direction > 0)
                change = f"{ratio:.2f}x" + (
                    "" if abs(ratio - 1) < 0.05 else (" better" if better else " worse")
                )
            rows.append([label, f(b, _spec(unit)), f(v, _spec(unit)), change])
        add(_table(["figure", "baseline", "this run", "change"], rows))
        add("")

    if notes.strip():
        add("## Notes\n")
        add(notes.strip() + "\n")

    _capacity_md(add, sec.get("capacity"), plots)
    _tiers_md(add, sec.get("tiers"), plots, baseline)
    _ceiling_md(add, sec.get("worker_ceiling"), sec.get("worker_ceiling_parrot"))
    _against_md(add, sec.get("against_baseline"))
    _hop_md(add, sec.get("hop_latency"), sec.get("grpc_hop"), plots)
    _e2e_md(add, sec.get("e2e_bench"), plots)
    _model_md(add, sec.get("model_steps"), plots)
    _moshi_md(add, sec.get("moshi"))
    _failures_md(add, run)
    return "\n".join(out) + "\n"


def _cpu(row: dict[str, Any], key: str) -> str:
    return f(_get(row, "cpu_pct", key), ".0f")


def _capacity_md(add: Any, cap: dict[str, Any] | None, plots: dict[str, str]) -> None:
    add("## Capacity: real-time parrot conversations\n")
    if not cap:
        add("Not measured.\n")
        return
    add(
        "One `duplex worker` (parrot) and one `duplex session` process on loopback; N sessions from "
        "load-generator processes of their own (`benchmarks/loadgen.py`), each streaming the espeak "
        "fixtures looped with pauses at real-time pace (server turn detection, barge-in on). A step of N "
        f"**holds** when the p99 of append → `input_ack` is under {FRAME_MS:g} ms, every session keeps real "
        "time (generators on schedule, ≥ 95 % of each session's window appends acknowledged in it, ≤ 128 ms "
        "unacknowledged at its end) and nothing is dropped (no error event, no close, every turn ended "
        "in the window answered with audio). N ramps up until a step does not hold twice in a row (a step "
        "that fails is run again: a spike of other work on a shared machine does not end the ramp); "
        "capacity is the last N that held. CPU: % of one core over the window (/proc); *other* is the "
        "rest of the machine (another user's load on a shared box).\n"
    )
    if not cap.get("complete", True):
        add(
            "**Incomplete**: the time budget ran out before every ramp finished; what was measured "
            "is below.\n"
        )
    for name, r in cap.get("ramps", {}).items():
        if "skipped" in r:
            add(f"### {name}: skipped ({r['skipped']})\n")
            continue
        batch = " against `--max-batch 1`" if r.get("max_batch") == 1 else ""
        if r.get("lanes"):
            batch = ", generators holding their sessions as lanes of one `ConverseMany` stream"
        held = f(r.get("capacity"), "d") if r.get("capacity") else "none"
        note = ""
        if r.get("stopped_by_budget"):
            held, note = f"≥ {held}", " (the ramp stopped on the time budget)"
        add(f"### {r['append_ms']} ms appends{batch}: capacity **{held}**{note}\n")
        rows = []
        for s in r["steps"]:
            rows.append(
                [
                    f(s["sessions"], "d") + (" (again)" if s.get("attempt", 1) > 1 else ""),
                    f(s["ack_ms"]["p50"]),
                    f(s["ack_ms"]["p99"]),
                    f(s["first_audio_ms"]["p50"], ".0f"),
                    f(s["first_audio_ms"]["p99"], ".0f"),
                    f"{s['answered']}/{s['turns']}",
                    f(s["late_ms"]["p99"]),
                    " / ".join(_cpu(s, k) for k in ("session", "worker", "generator", "other")),
                    "holds" if s["pass"] else "fails: " + "; ".join(s["why"]),
                ]
            )
        add(
            _table(
                [
                    "N",
                    "ack p50 ms",
                    "ack p99 ms",
                    "first audio p50 ms",
                    "first audio p99 ms",
                    "turns answered",
                    "schedule lag p99 ms",
                    "CPU % session / worker / generator / other",
                    "",
                ],
                rows,
            )
        )
        add("")
    gain = cap.get("batching_gain")
    add(
        "**Batching gain** (capacity with batching over `--max-batch 1`, same append size): "
        f"{f(gain, '.2f')}x.\n"
    )
    floor = cap.get("floor")
    if floor and "skipped" not in floor:
        echo = floor["echo"]
        add(
            f"**Against the transport's floor** ({floor['append_ms']} ms appends, one stream per session): "
            "every append costs the session service at least one gRPC read and one write; a bare grpc.aio "
            f"echo (`benchmarks/grpc_echo.py`, {echo['streams']} streams, one message each way per append) "
            f"spent {echo['cpu_us_per_pair']:.0f} µs per message pair ({echo['user_us']:.0f} user, "
            f"{echo['kernel_us']:.0f} kernel), so one core could hold at most "
            f"{floor['floor_sessions']:.0f} sessions at that cost alone; the capacity found, "
            f"{f(floor['capacity'], 'd') if floor['capacity'] else 'none'}, is "
            f"**{f(floor['capacity_fraction_of_floor'], '.2f')}** of it.\n"
        )
    elif floor:
        add(f"Transport floor not measured: {floor['skipped']}.\n")
    s64 = _step_at(_get(cap, "ramps", "20ms"), 64)
    if s64 is not None:
        add(
            "**End of speech → first reply audio at 64 sessions** (20 ms appends; from the server's "
            f"`committed` to the first audio frame): p50 {f(s64['first_audio_ms']['p50'], '.0f')} ms, "
            f"p99 **{f(s64['first_audio_ms']['p99'], '.0f')} ms** over {s64['first_audio_ms'].get('n', '—')} "
            "turns"
            + ("." if s64["pass"] else " (that step did **not** hold: " + "; ".join(s64["why"]) + ").")
            + "\n"
        )
    if "capacity" in plots:
        add(f"![capacity]({plots['capacity']})\n")
    prof = cap.get("profile")
    if prof and "own" in prof:
        add(
            "### Where the session service's CPU goes "
            f"(py-spy, N={prof['sessions']}, {prof['seconds']} s at 100 Hz)\n"
        )
        threads = _get(prof, "all_threads", "threads") or {}
        if threads:
            add(
                "Samples by thread (py-spy's active samples): "
                + ", ".join(f"{t}: {k}" for t, k in threads.items())
                + ". `_poll_wrapper` is gRPC's C-core poller (HTTP/2, sockets); its work has no "
                "Python frames.\n"
            )
        add(
            f"The thread holding the GIL, with native frames ({prof['samples']} samples; py-spy pauses the "
            "process for each, so this step's latencies are not a capacity figure): the work one core "
            "serialises. By the area of the leaf frame (where the CPU is spent), "
            f"{100 * prof.get('through_grpc', 0):.0f} % of it with gRPC somewhere on the stack:\n"
        )
        rows = [[f"{100 * share:.1f} %", name] for name, share in prof.get("areas", {}).items()]
        add(_table(["share", "area"], rows))
        add("")
        add(
            "Top functions by own time (the leaf frame; an unresolved native address counts as `lib.so:?`):\n"
        )
        rows = [[f"{100 * t['share']:.1f} %", f"`{t['function']}`"] for t in prof["own"]]
        add(_table(["own", "function"], rows))
        add("")
        rows = [[f"{100 * t['share']:.1f} %", f"`{t['function']}`"] for t in prof["inclusive"]]
        add(_table(["inclusive", "project function"], rows))
        add("")
    elif prof:
        add(f"Profile skipped: {prof.get('skipped')}\n")


def _tiers_md(
    add: Any, t: dict[str, Any] | None, plots: dict[str, str], baseline: dict[str, Any] | None
) -> None:
    add("## CPU per session-frame, per tier\n")
    if not t:
        add("Not measured.\n")
        return
    us = t["cpu_us_per_frame"]
    m = t["model_at_mean_batch"]
    add(
        f"{t['sessions']} parrot sessions at real time (duplex load: {t['append_ms']} ms appends, "
        "a commit every "
        "32 frames and a response whenever none is active, so nearly every input frame has a reply "
        f"frame), {t['window_s']:g} s window. A session-frame is one 32 ms input frame of one session with "
        "its ack and its reply frame. CPU from /proc (user + system, all threads) over the frames "
        f"acknowledged in the window ({t['frames']:,.0f}; {t['reply_per_input']:.2f} reply frames per input "
        f"frame). The worker stepped a mean batch of {t['mean_batch']:.1f}; the model alone is the parrot "
        "in a plain loop at that batch (no engine, no gRPC), plus its reply synthesis: each reply is "
        "computed once per turn on the parrot's helper threads, measured apart per reply frame and "
        "counted at the reply frames per input frame that came back. The bare gRPC echo is the "
        "transport's floor: a server that only reads and writes back one 1 KiB message per stream "
        "per frame period, for as many streams (what a session-frame costs on the client side before "
        "any serving logic). The load "
        + (
            "held real time."
            if t["held_real_time"]
            else "did **not** hold real time: " + "; ".join(t["why"]) + "."
        )
        + "\n"
    )
    reply = t.get("model_reply_us_per_frame")
    whole = m["cpu_us_per_frame"] + (reply or 0.0)
    rows = [
        [
            "session service",
            f(us.get("session"), ".0f"),
            f(us.get("session") / whole if us.get("session") else None, ".1f") + "x",
        ],
        [
            "worker",
            f(us.get("worker"), ".0f"),
            f(us.get("worker") / whole if us.get("worker") else None, ".1f") + "x",
        ],
        [f"model alone, B={m['batch']}: its step", f(m["cpu_us_per_frame"], ".0f"), "—"],
        [
            "model alone: its reply synthesis (helper threads, once per turn)",
            f(reply, ".0f"),
            "—",
        ],
        ["model alone: its whole share", f(whole, ".0f"), "1x"],
        [f"model alone, B={t['model_at_n']['batch']}", f(t["model_at_n"]["cpu_us_per_frame"], ".0f"), "—"],
        [
            "bare gRPC echo, same message rate (per message pair)",
            f(_get(t, "grpc_echo", "cpu_us_per_pair"), ".0f"),
            "—",
        ],
        ["load generator (client)", f(us.get("generator"), ".0f"), "—"],
        [
            "worker overhead: the worker minus the model's whole share",
            f(_overhead(t), ".0f"),
            f(_overhead(t) / whole if _overhead(t) is not None and whole else None, ".1f") + "x",
        ],
    ]
    served, over = t.get("model_as_served_us_per_frame"), t.get("worker_overhead_as_served_us_per_frame")
    if served is not None:
        rows += [
            ["model as served: its step and one reply per frame period, idle between", f(served, ".0f"), "—"],
            ["worker overhead over the model as served", f(over, ".0f"), "—"],
        ]
    add(
        f"The worker's mean batch is {t['mean_batch']:.1f} of the {t['sessions']} sessions with input "
        f"(every session streams continuously): **{t['mean_batch'] / t['sessions']:.2f}**"
        + (
            f"; it made {t['steps_in_window']:,.0f} steps in the window, "
            f"{t['steps_in_window'] / t['window_s']:.1f} a second against {1000 / FRAME_MS:.2f} frame ticks."
            if t.get("steps_in_window") and t.get("window_s")
            else "."
        )
        + "\n"
    )
    add(_table(["process", "CPU µs per session-frame", "over the model's whole share"], rows))
    add("")
    detail = t.get("cpu_detail_per_frame") or {}
    echo = t.get("grpc_echo")
    drows = [
        [label, f(d["user_us"], ".0f"), f(d["kernel_us"], ".0f"), f(d["switches"], ".1f")]
        for label, d in (
            ("session service", detail.get("session")),
            ("worker", detail.get("worker")),
            ("load generator (client)", detail.get("generator")),
            ("bare gRPC echo (per message pair)", echo),
        )
        if d is not None
    ]
    if drows:
        add(
            "Where that CPU goes, per session-frame: user space (Python, gRPC's core, protobuf), the "
            "kernel (syscalls, the loopback TCP path, scheduling), and context switches of all the "
            "process's threads (gRPC hands every completed read and write from its threads to the "
            "event loop's):\n"
        )
        add(_table(["process", "user µs", "kernel µs", "context switches"], drows))
        add("")
    cmp_ = t.get("separate_acks_compared")
    if cmp_:
        cu = cmp_["cpu_us_per_frame"]
        add(
            "The clients read their acks carried on the reply audio (`acks_on_output`, as `DuplexClient` "
            "does: an append is acked once the worker consumed it, so the load is held to an ack p99 "
            "under two frames). The same load from clients that take an `input_ack` event per append "
            "(a second window, same processes"
            + ("" if cmp_["held_real_time"] else "; it did **not** hold real time: " + "; ".join(cmp_["why"]))
            + "):\n"
        )
        add(
            _table(
                ["process", "acks carried on output", "an input_ack event per append"],
                [
                    ["session service", f(us.get("session"), ".0f"), f(cu.get("session"), ".0f")],
                    ["worker", f(us.get("worker"), ".0f"), f(cu.get("worker"), ".0f")],
                    ["load generator (client)", f(us.get("generator"), ".0f"), f(cu.get("generator"), ".0f")],
                ],
            )
        )
        add("")
    si = t.get("step_interval_compared")
    if si:
        add(
            f"The same load against a worker started with `--step-interval-ms {si['step_interval_ms']:g}` "
            "(a stack of its own): the inputs that arrive within the interval share one step, for up to "
            "that much more latency per hop (see docs/worker-protocol.md, Batching)"
            + ("" if si["held_real_time"] else "; it did **not** hold real time: " + "; ".join(si["why"]))
            + ":\n"
        )
        header = [
            "",
            "worker on the frame clock (default)",
            f"free clock, at most every {si['step_interval_ms']:g} ms",
        ]
        add(_table(header, _compared_rows(t, si)))
        add("")
    ln = t.get("lanes_compared")
    if ln:
        lu = ln["cpu_us_per_frame"]
        base = _get(baseline, "session_cpu_us_per_frame")
        add(
            "The same load from clients that hold their sessions as lanes of one `ConverseMany` stream "
            f"per generator process (a backend's choice), each sending its sessions' due events together "
            f"every {ln['flush_ms']:g} ms (an append waits up to that long; its ack latency counts from its "
            "deadline). Same processes, a window of its own"
            + ("" if ln["held_real_time"] else "; it did **not** hold real time: " + "; ".join(ln["why"]))
            + ":\n"
        )
        over_base = [
            "session service over the baseline's (one stream per session)",
            f(us.get("session") / base if us.get("session") and base else None, ".2f") + "x",
            f(lu.get("session") / base if lu.get("session") and base else None, ".2f") + "x",
        ]
        header = ["", "one Converse stream per session", f"lanes, sent every {ln['flush_ms']:g} ms"]
        n = t["sessions"]
        share = [
            [
                "worker's mean batch / sessions with input",
                f(t["mean_batch"] / n, ".2f"),
                f(ln["mean_batch"] / n, ".2f"),
            ],
            [
                "the model's whole share at that batch, µs",
                f(t["model_at_mean_batch"]["cpu_us_per_frame"] + (reply or 0.0), ".0f"),
                f(ln.get("model_whole_us_per_frame"), ".0f"),
            ],
            ["worker overhead µs per session-frame", f(_overhead(t), ".0f"), f(_overhead(ln), ".0f")],
        ]
        add(_table(header, [*_compared_rows(t, ln, generator=True), *share, over_base]))
        add("")
    if "tiers" in plots:
        add(f"![tiers]({plots['tiers']})\n")


def _ceiling_md(add: Any, null: dict[str, Any] | None, parrot: dict[str, Any] | None) -> None:
    add("## The worker's ceiling: real-time sessions per worker process\n")
    if not null and not parrot:
        add("Not measured.\n")
        return
    first = null or parrot
    assert first is not None
    add(
        "`benchmarks/worker_ceiling.py`: one `duplex worker` process driven directly on its `Run` stream "
        "(no session service): every 32 ms one `WorkerCommand` with one APPEND per session, its bytes "
        "built once and replayed, so the driver costs little. A step of N sessions is **real time** "
        f"when the worker acknowledged ≥ {100 * first['min_consumed_fraction']:.0f} % of the frames "
        f"offered in the window and no session lagged more than {first['max_lag_frames']:g} frame "
        "periods. The ceiling is the largest N real time before the first N that was not (then "
        "bisected; with no step behind it is the largest N measured, marked ≥). "
        f"Windows of {first['seconds']:g} s after {first['warmup_s']:g} s; worker CPU from /proc "
        "(10 ms ticks: coarse over short windows).\n"
    )
    summary = []
    for label, r in (("near-zero (`null`)", null), ("parrot", parrot)):
        if not r:
            summary.append([label, "—", "—", "—", "—", "—"])
            continue
        per = r.get("us_per_session_frame", {})
        summary.append(
            [
                label,
                ("≥ " if not r.get("first_behind_sessions") else "") + f"**{f(r['ceiling_sessions'], 'd')}**",
                f(r.get("first_behind_sessions"), "d") if r.get("first_behind_sessions") else "none",
                *(f(per.get(k), ".1f") for k in ("64", "256", "1024")),
            ]
        )
    add(
        _table(
            ["model", "ceiling (sessions)", "first N behind", "µs/session-frame N=64", "N=256", "N=1,024"],
            summary,
        )
    )
    add("")
    for label, r in (("null", null), ("parrot", parrot)):
        if not r:
            continue
        rows = [
            [
                f(row["sessions"], "d"),
                "yes" if row["real_time"] else "**no**",
                f(row.get("us_per_session_frame"), ".1f"),
                f(row.get("worker_cpu_pct"), ".0f"),
                f(row.get("mean_batch"), ".0f"),
                f(row.get("mean_step_ms"), ".2f"),
                f(_get(row, "tick_ack_ms", "p99"), ".0f"),
                f(row.get("lag_frames_max"), ".1f"),
                f(100 * row["consumed_fraction"], ".1f"),
                f(row.get("other_cpu_pct"), ".0f"),
                f(_get(row, "driver", "us_per_session_frame"), ".1f"),
            ]
            for row in r.get("rows", [])
        ]
        add(f"{label}:\n")
        add(
            _table(
                [
                    "N",
                    "real time",
                    "worker µs/session-frame",
                    "worker CPU %",
                    "mean batch",
                    "mean step ms",
                    "tick ack p99 ms",
                    "lag max (frames)",
                    "acked %",
                    "other CPU %",
                    "driver µs/session-frame",
                ],
                rows,
            )
        )
        add("")


def _mode_row(tiers: dict[str, Any], mode: str) -> dict[str, Any]:
    """The tiers window of a client mode: the main one (streams) or the lanes one."""
    return tiers if mode == "streams" else tiers.get("lanes_compared") or {}


def _in_place_note(row: dict[str, Any], paced: float | None) -> str:
    """The overhead's two parts: the model costing more as served than in its plain loop, and
    the worker's own serving beside it."""
    d, serving = _get(row, "model_in_place_us_per_frame"), _get(row, "worker_serving_us_per_frame")
    if d is None or serving is None:
        return ""
    plain = _get(row, "model_at_mean_batch", "cpu_us_per_frame")
    reply = _get(row, "model_reply_us_per_frame")
    return (
        f"; the model as served (its own CPU counter) spent {d['step']:.0f} µs in its steps and "
        f"{d['helpers']:.0f} in its helper threads against {f(plain, '.0f')} and {f(reply, '.0f')} in its "
        f"plain loop (its step once a frame period in a plain loop: {f(paced, '.0f')}: idle between "
        f"steps, the caches go cold), and serving beside it cost the worker {serving:.0f} µs"
    )


def _as_served_note(latest: dict[str, Any], mode: str) -> str:
    """The overhead over the model as a frame clock runs it (its plain loop, paced)."""
    model, over = (
        latest.get(f"{k}_{mode}")
        for k in ("model_as_served_us_per_frame", "worker_overhead_as_served_us_per_frame")
    )
    if model is None or over is None:
        return ""
    return (
        f"; the model as served (its plain loop with its step and one reply per frame period, idle "
        f"between) costs {model:.0f} µs, and the worker {over:.0f} µs beyond that"
    )


def _commands_note(latest: dict[str, Any], mode: str) -> str:
    """The worker link's commands per worker step in that window (one a tick is the aim)."""
    per_step = latest.get(f"worker_commands_per_step_{mode}")
    if per_step is None:
        return ""
    missed = latest.get(f"worker_tick_missed_fraction_{mode}")
    return f"; the worker link wrote {per_step:.2f} commands per worker step" + (
        "" if missed is None else f" ({100 * missed:.1f} % too late for their tick)"
    )


def _bounds_md(add: Any, latest: dict[str, Any]) -> None:
    """For each missed target of the frame clock's issue, what this run's data shows bounds it
    (nothing is said where the data does not show it)."""
    missed = {t["key"] for t in latest.get("targets", []) if t["met"] is False}
    sec = latest.get("sections", {})
    lines: list[str] = []
    tiers = sec.get("tiers")
    for mode, key in (
        ("streams", "mean_batch_fraction_64_streams"),
        ("lanes", "mean_batch_fraction_64_lanes"),
    ):
        if key not in missed or not tiers:
            continue
        row = _mode_row(tiers, mode)
        held = row.get("held_real_time")
        lines.append(
            f"- mean batch ({mode}): {f(row.get('mean_batch'), '.1f')} of {tiers['sessions']} sessions"
            + ("" if held is not False else "; the load did not hold real time: " + "; ".join(row["why"]))
            + (
                f"; {tiers['steps_in_window'] / tiers['window_s']:.1f} steps a second against "
                f"{1000 / FRAME_MS:.2f} ticks (steps beyond one per tick are catch-up steps)"
                if mode == "streams" and tiers.get("steps_in_window") and tiers.get("window_s")
                else ""
            )
            + "."
        )
    for mode, key in (
        ("streams", "worker_overhead_us_per_frame_streams"),
        ("lanes", "worker_overhead_us_per_frame_lanes"),
    ):
        if key not in missed or not tiers:
            continue
        d = _get(tiers, "cpu_detail_per_frame", "worker")
        row = _mode_row(tiers, mode)
        split = _get(row, "worker_split_us_per_frame")
        batch = _get(tiers, "mean_batch") if mode == "streams" else latest.get("lanes_mean_batch")
        lines.append(
            f"- worker overhead ({mode}): {f(latest.get(key), '.0f')} µs per session-frame at a mean batch "
            f"of {f(batch, '.1f')}"
            + (
                f"; the worker's CPU (streams window) is {d['user_us']:.0f} µs in user space (Python, gRPC, "
                f"protobuf) and {d['kernel_us']:.0f} µs in the kernel, {d['switches']:.1f} context switches "
                "per session-frame"
                if d and mode == "streams"
                else ""
            )
            + (
                f"; by thread, the event loop (commands, fences, conversion, writes: never the model) "
                f"{split['event_loop']:.0f} µs and the other threads (engine, the model's helpers, gRPC's) "
                f"{split['other_beyond_model']:.0f} µs beyond the model's whole share from its plain loop"
                if split
                else ""
            )
            + _in_place_note(row, latest.get("model_paced_us_per_frame"))
            + _as_served_note(latest, mode)
            + _commands_note(latest, mode)
            + "; the worker ceiling's null model (no session service, commands replayed) costs "
            f"{f(latest.get('worker_ceiling_us_per_frame_64'), '.1f')} µs per session-frame at 64 sessions."
        )
    null = sec.get("worker_ceiling")
    if "worker_ceiling_sessions" in missed and null:
        miss = next(
            (r for r in null.get("rows", []) if r["sessions"] == null.get("first_behind_sessions")), None
        )
        if miss is not None:
            cpu, us = f(miss.get("worker_cpu_pct"), ".0f"), f(miss.get("us_per_session_frame"), ".1f")
            ack, lag = f(_get(miss, "tick_ack_ms", "p99"), ".0f"), f(miss.get("lag_frames_max"), ".1f")
            lines.append(
                f"- worker ceiling: first behind at {miss['sessions']} sessions with the worker at "
                f"{cpu} % of a core ({us} µs per session-frame, mean step "
                f"{f(miss.get('mean_step_ms'), '.2f')} ms), tick ack p99 {ack} ms, lag up to {lag} "
                f"frames, {100 * miss['consumed_fraction']:.1f} % acknowledged; the rest of the machine used "
                f"{f(miss.get('other_cpu_pct'), '.0f')} % of a core"
                + (
                    " (the worker's CPU was not the limit: its ticks' acks came late)"
                    if (miss.get("worker_cpu_pct") or 100) < 80
                    else ""
                )
                + "."
            )
    ramps = _get(sec, "capacity", "ramps") or {}
    for key, name in (
        ("capacity_sessions_lanes_20ms", "20ms_lanes"),
        ("capacity_fraction_of_floor_streams_20ms", "20ms"),
    ):
        r = ramps.get(name)
        if key not in missed or not r or not r.get("steps"):
            continue
        fails = [s for s in r["steps"] if not s["pass"]]
        if not fails:
            continue
        lines.append(
            f"- {'lanes capacity' if name.endswith('lanes') else 'capacity over the floor'}: "
            f"{f(r.get('capacity'), 'd') if r.get('capacity') else 'none'} held; "
            + "; ".join(
                f"at {s['sessions']}: "
                + ", ".join(s["why"])
                + " (CPU % session / worker / generators / other: "
                + " / ".join(
                    f(_get(s, "cpu_pct", k), ".0f") for k in ("session", "worker", "generator", "other")
                )
                + ")"
                for s in fails
            )
            + (
                f"; the floor allows {latest['capacity_floor_sessions_20ms']:.0f} per core"
                if name == "20ms" and latest.get("capacity_floor_sessions_20ms")
                else ""
            )
            + "."
        )
    if lines:
        add("What this run's data shows bounds the missed targets of the frame clock:\n")
        add("\n".join(lines) + "\n")


def _against_md(add: Any, a: dict[str, Any] | None) -> None:
    add("## The session tier against the baseline's code, measured now\n")
    if not a:
        add("Not measured.\n")
        return
    add(
        f"The baseline's own code (commit `{a['base_commit'][:12]}`, checked out with `git archive`) and "
        "this tree's, measured in turn on this machine minutes apart: the baseline's `benchmarks.tiers` "
        "(its session service and its load generator, one `Converse` stream per session, its clients "
        "taking an `input_ack` event per append), and this tree's with the same sessions as its clients "
        "hold them today (acks carried on output), one stream per session and as lanes of one "
        f"`ConverseMany` stream ({a['sessions']} parrot sessions, {a['window_s']:g} s windows). Rounds are "
        "mirrored (baseline, streams, lanes; then lanes, streams, baseline), so a steady drift of the "
        "machine weighs on every ratio alike. A run on another day is no measure of half: this "
        "machine's speed moves more than that between hours. Each round's ratio compares figures taken "
        "minutes apart; the figure is their median"
        + ("." if a.get("held_real_time") else "; some window did **not** hold real time.")
        + "\n"
    )
    rows = [
        [
            str(i + 1),
            "baseline" if r["base_first"] else "this tree",
            f(_get(r, "base", "session_us"), ".0f"),
            f(_get(r, "streams", "session_us"), ".0f"),
            f(_get(r, "lanes", "session_us"), ".0f"),
            f(r.get("streams_over_base"), ".2f") + "x",
            f(r.get("lanes_over_base"), ".2f") + "x",
        ]
        for i, r in enumerate(a.get("rounds", []))
    ]
    rows.append(
        [
            "median",
            "",
            "",
            "",
            "",
            f(a.get("streams_over_base"), ".2f") + "x",
            f(a.get("lanes_over_base"), ".2f") + "x",
        ]
    )
    header = [
        "round",
        "first",
        "baseline µs",
        "this tree, one stream per session, µs",
        "this tree, lanes, µs",
        "streams over baseline",
        "lanes over baseline",
    ]
    add("Session service CPU per session-frame:\n")
    add(_table(header, rows))
    add(f"\nTarget: at most {f(a.get('target'), '.1f')}x the baseline's.\n")


def _compared_rows(t: dict[str, Any], other: dict[str, Any], *, generator: bool = False) -> list[list[str]]:
    """The tiers' main window beside a compared one: mean batch, CPU per session-frame, ack p99."""
    us, ou = t["cpu_us_per_frame"], other["cpu_us_per_frame"]
    tiers = [("session service", "session"), ("worker", "worker")]
    if generator:
        tiers.append(("load generator", "generator"))
    return [
        ["worker's mean batch", f(t.get("mean_batch"), ".1f"), f(other["mean_batch"], ".1f")],
        *([f"{label} µs per session-frame", f(us.get(k), ".0f"), f(ou.get(k), ".0f")] for label, k in tiers),
        ["ack p99 ms", f(_get(t, "load", "ack_ms", "p99"), ".1f"), f(other.get("ack_p99_ms"), ".1f")],
    ]


def _hop_md(
    add: Any, hop: dict[str, Any] | None, grpc_hop: dict[str, Any] | None, plots: dict[str, str]
) -> None:
    add("## Hop latency: session → worker → session\n")
    if hop:
        add(
            "A client doing what a session replica does on its worker link, against a real parrot worker "
            "process: S sessions attached, one `Run` stream, one APPEND (one 32 ms frame) per session per "
            "frame period, staggered, appends due in the same millisecond in one `WorkerCommand`. "
            "Measured: from just before the `WorkerCommand` carrying an APPEND is written to the moment "
            "the `StepOutput` reporting it consumed (`RequestUpdate.input_seq`) has been read -- the "
            "worker received, queued and stepped it (VAD) and sent the news back. No session-service code "
            "runs: this is the floor under the session tier's latencies.\n"
        )
        rows = [
            [
                f(r["sessions"], "d"),
                f(r["hop_ms"]["p50"], ".2f"),
                f(r["hop_ms"]["p90"], ".2f"),
                f(r["hop_ms"]["p99"], ".2f"),
                f(r["hop_ms"]["max"], ".1f"),
                f(r["appends"], "d"),
                _cpu(r, "worker"),
            ]
            for r in hop["rows"]
        ]
        add(_table(["sessions", "p50 ms", "p90 ms", "p99 ms", "max ms", "appends", "worker CPU %"], rows))
        add("")
        if "hop" in plots:
            add(f"![hop]({plots['hop']})\n")
    else:
        add("Not measured.\n")
    if grpc_hop:
        add(
            "**gRPC message cost** (`benchmarks/grpc_hop.py`: a loopback grpc.aio bidi echo, "
            f"{grpc_hop['streams']} "
            f"streams): {grpc_hop['single_chunks_per_s']:,.0f} 1 KiB chunks/s one per message, "
            f"{grpc_hop['packed_chunks_per_s']:,.0f} packed {grpc_hop['pack']} per message "
            f"({grpc_hop['packed_over_single']:.1f}x): why the worker hop carries batches.\n"
        )


def _e2e_md(add: Any, e2e: dict[str, Any] | None, plots: dict[str, str]) -> None:
    add("## The serving path vs the model alone\n")
    if not e2e:
        add("Not measured.\n")
        return
    add(
        "`benchmarks/e2e_bench.py`: B full-duplex `DuplexClient` sessions through a real session service "
        "and worker, each appending 32 ms frames as fast as its ack window allows, committing every "
        f"{e2e['cycle']} frames and asking for a response whenever none is active; against the engine "
        "in-process with the same turn shape. Ratio = end-to-end input frames/s over the model alone's.\n"
    )
    rows = []
    for r in e2e["rows"]:
        cpu = r.get("cpu_cores") or {}
        rows.append(
            [
                r["model"],
                f(r["batch"], "d"),
                f(r["alone_in_fps"], ",.0f"),
                f(r["e2e_in_fps"], ",.0f"),
                f(r["e2e_out_fps"], ",.0f"),
                f(r["in_ratio"], ".3f"),
                f(r["x_realtime"], ".1f"),
                f(r["min_share"], ".2f"),
                " / ".join(f(cpu.get(k), ".2f") for k in ("client", "session", "worker")),
            ]
        )
    add(
        _table(
            [
                "model",
                "B",
                "alone in/s",
                "e2e in/s",
                "e2e reply/s",
                "ratio",
                "x real time per session",
                "min/mean",
                "cores client / session / worker",
            ],
            rows,
        )
    )
    add("")
    if "e2e" in plots:
        add(f"![e2e]({plots['e2e']})\n")


def _model_md(add: Any, ms: dict[str, Any] | None, plots: dict[str, str]) -> None:
    add("## The parrot model alone: per-step time\n")
    if not ms:
        add("Not measured.\n")
        return
    lo, hi = ms.get("largest_batch_within_frame"), ms.get("first_batch_over_frame")
    add(
        f"`benchmarks/model_steps.py` on {ms['device']} (torch threads {ms['torch_threads']}): "
        "`ParrotModel.step` in a plain loop, every request with an input frame and a reply frame. "
        + (
            f"Largest batch within {FRAME_MS:g} ms: **B={lo}**"
            + (f" (B={hi} does not fit)." if hi else " (every batch measured fits).")
            if lo
            else f"No batch fits {FRAME_MS:g} ms."
        )
        + "\n"
    )
    rows = [
        [
            f(r["batch"], "d"),
            f(r["ms_per_step"], ".2f"),
            f(r["cpu_us_per_frame"], ".1f"),
            f(r["frames_per_s"], ",.0f"),
        ]
        for r in sorted([*ms["rows"], *ms.get("bisect", [])], key=lambda r: r["batch"])
    ]
    add(_table(["B", "ms per step", "CPU µs per frame", "frames/s"], rows))
    add("")
    if "model" in plots:
        add(f"![model]({plots['model']})\n")


def _moshi_md(add: Any, m: dict[str, Any] | None) -> None:
    add("## The moshi model: as served against its plain loop\n")
    if not m:
        add("Not measured.\n")
        return
    add(
        f"`benchmarks/moshi.py` on {m['device']} (torch threads {m['torch_threads']}), checkpoint: "
        f"{m['checkpoint']}. Every slot is stepped every tick whether a session is in it or not, so "
        "the cost per session-frame falls as slots fill. **Sessions per worker at real time: "
        f"{m.get('sessions_at_real_time', '—')}** (the most slots whose step leaves "
        f"{100 * m.get('headroom', 0.1):.0f}% of the 80 ms frame free, plain loop).\n"
    )
    rows = [
        [
            f(r["slots"], "d"),
            f(r["ms_per_step"], ".1f"),
            f(100 * r["fraction_of_frame"], ".0f"),
            f(r["cpu_us_per_session_frame"], ",.0f"),
        ]
        for r in m.get("plain_loop", [])
    ]
    add(_table(["slots", "ms per step", "% of the frame", "CPU µs per session-frame"], rows))
    add("")
    rows = [
        [
            f(r["sessions"], "d"),
            f(r["worker_cpu_us_per_session_frame"], ",.0f"),
            f(r["model_in_place_us_per_session_frame"], ",.0f"),
            f(r["plain_loop_us_per_session_frame"], ",.0f"),
            f(r["served_over_plain"], ".2f"),
            f"{f(r['ticks_late'], '.0f')} of {f(r['ticks'], '.0f')}",
            f(r["tick_load"], ".2f"),
            f(r["output_frames_late"], ".0f"),
        ]
        for r in m.get("served", [])
    ]
    add(
        _table(
            [
                "sessions (= slots)",
                "worker µs per session-frame",
                "model in place",
                "plain loop",
                "served / plain",
                "ticks late",
                "tick load",
                "frames late at clients",
            ],
            rows,
        )
    )
    add("")


#: Cores the rest of the machine may use during a section before the run is flagged as contended.
BUSY_CORES = 0.5


def contended(run: dict[str, Any]) -> dict[str, float]:
    """Sections during which the rest of the machine used more than ``BUSY_CORES`` cores."""
    return {
        name: v["other_cores"]
        for name, v in run.get("sections", {}).items()
        if v.get("other_cores") is not None and v["other_cores"] > BUSY_CORES
    }


def _failures_md(add: Any, run: dict[str, Any]) -> None:
    failed = {k: v for k, v in run.get("sections", {}).items() if not v.get("ok")}
    add("## Sections\n")
    rows = [
        [
            name,
            f(v.get("seconds"), ".0f"),
            f(v.get("other_cores"), ".2f"),
            "ok" if v.get("ok") else f"**failed**: {v.get('reason')}",
        ]
        for name, v in run.get("sections", {}).items()
    ]
    add(_table(["section", "seconds", "other work on the machine meanwhile (cores)", ""], rows))
    add("")
    if failed:
        add(
            "A failed section's figures are missing above (never zeros); its reason is in the run's output.\n"
        )


# ---------------------------------------------------------------------------------------------
# plots


def _last_per_n(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ramp's steps by N, the last attempt of each (a repeated step's verdict)."""
    by_n = {s["sessions"]: s for s in steps}
    return [by_n[n] for n in sorted(by_n)]


def plot_all(latest: dict[str, Any], dest: Path) -> dict[str, Path]:
    """The PNGs (small: about 100 dpi); returns name -> path of those made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dest.mkdir(parents=True, exist_ok=True)
    sec = latest.get("sections", {})
    made: dict[str, Path] = {}
    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3})

    cap = sec.get("capacity")
    if cap and any(r.get("steps") for r in cap.get("ramps", {}).values()):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        colors = {
            "20ms": "tab:blue",
            "40ms": "tab:green",
            "40ms_batch1": "tab:red",
            "20ms_batch1": "tab:purple",
        }
        ramps = {k: r for k, r in cap["ramps"].items() if r.get("steps")}
        for name, r in ramps.items():
            steps = _last_per_n(r["steps"])
            n = [s["sessions"] for s in steps]
            c = colors.get(name, None)
            label = f"{r['append_ms']} ms" + (", batch 1" if r.get("max_batch") == 1 else "")
            p99 = [s["ack_ms"]["p99"] for s in steps]
            p50 = [s["ack_ms"]["p50"] for s in steps]
            axes[0].plot(n, p99, "o-", color=c, label=f"{label} p99")
            axes[0].plot(n, p50, "x--", color=c, alpha=0.6, label=f"{label} p50")
            fa99 = [s["first_audio_ms"]["p99"] for s in steps]
            fa50 = [s["first_audio_ms"]["p50"] for s in steps]
            axes[1].plot(n, fa99, "o-", color=c, label=f"{label} p99")
            axes[1].plot(n, fa50, "x--", color=c, alpha=0.6, label=f"{label} p50")
            if r.get("capacity"):
                axes[0].axvline(r["capacity"], color=c, alpha=0.2, lw=1.5)
        axes[0].axhline(FRAME_MS, color="k", lw=1, ls=":", label="32 ms (one frame)")
        axes[0].set(
            title="append → ack latency vs sessions",
            xlabel="concurrent sessions N",
            ylabel="ms",
            yscale="log",
        )
        axes[1].set(
            title="end of turn → first reply audio", xlabel="concurrent sessions N", ylabel="ms", yscale="log"
        )
        axes[0].legend(fontsize=7)
        axes[1].legend(fontsize=7)
        first = next(iter(ramps.values()))
        steps = _last_per_n(first["steps"])
        n = [s["sessions"] for s in steps]
        for key, c in (
            ("session", "tab:blue"),
            ("worker", "tab:orange"),
            ("generator", "tab:gray"),
            ("other", "tab:red"),
        ):
            axes[2].plot(n, [s["cpu_pct"].get(key) or 0 for s in steps], "o-", color=c, label=key)
        axes[2].axhline(100, color="k", lw=1, ls=":")
        axes[2].set(
            title=f"CPU, {first['append_ms']} ms appends (% of a core)",
            xlabel="concurrent sessions N",
            ylabel="%",
        )
        axes[2].legend(fontsize=7)
        fig.tight_layout()
        made["capacity"] = dest / "capacity.png"
        fig.savefig(made["capacity"], dpi=80)
        plt.close(fig)

    tiers = sec.get("tiers")
    if tiers:
        us = tiers["cpu_us_per_frame"]
        labels = [
            "session service",
            "worker",
            f"model alone B={tiers['model_at_mean_batch']['batch']} (with replies)",
            "load generator",
        ]
        values = [
            us.get("session") or 0,
            us.get("worker") or 0,
            tiers["model_at_mean_batch"]["cpu_us_per_frame"] + (tiers.get("model_reply_us_per_frame") or 0),
            us.get("generator") or 0,
        ]
        fig, ax = plt.subplots(figsize=(7, 2.8))
        bars = ax.barh(labels[::-1], values[::-1], color=["tab:gray", "tab:green", "tab:orange", "tab:blue"])
        ax.bar_label(bars, fmt="%.0f µs", fontsize=8)
        ax.axvline(60, color="k", ls=":", lw=1)
        ax.text(60, 3.45, " session target 60 µs", fontsize=7)
        ax.set(
            title=f"CPU per session-frame, {tiers['sessions']} real-time sessions",
            xlabel="µs of CPU per 32 ms frame",
        )
        fig.tight_layout()
        made["tiers"] = dest / "tiers.png"
        fig.savefig(made["tiers"], dpi=80)
        plt.close(fig)

    hop = sec.get("hop_latency")
    if hop:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        n = [r["sessions"] for r in hop["rows"]]
        ax.plot(n, [r["hop_ms"]["p50"] for r in hop["rows"]], "o--", label="p50")
        ax.plot(n, [r["hop_ms"]["p99"] for r in hop["rows"]], "o-", label="p99")
        ax.axhline(5, color="k", ls=":", lw=1, label="target p99 at 64: 5 ms")
        ax.set(
            xscale="log",
            title="APPEND → consumed report (session→worker→session)",
            xlabel="sessions on the worker",
            ylabel="ms",
        )
        ax.set_xticks(n, [str(x) for x in n])
        ax.legend(fontsize=7)
        fig.tight_layout()
        made["hop"] = dest / "hop.png"
        fig.savefig(made["hop"], dpi=80)
        plt.close(fig)

    e2e = sec.get("e2e_bench")
    if e2e:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        models = sorted({r["model"] for r in e2e["rows"]})
        batches = sorted({r["batch"] for r in e2e["rows"]})
        width = 0.8 / max(1, len(models))
        for i, m in enumerate(models):
            vals = [
                next((r["in_ratio"] or 0 for r in e2e["rows"] if r["model"] == m and r["batch"] == b), 0)
                for b in batches
            ]
            ax.bar([j + i * width for j in range(len(batches))], vals, width, label=m)
        ax.axhline(0.3, color="k", ls=":", lw=1, label="target 0.3")
        ax.set_xticks(
            [j + width * (len(models) - 1) / 2 for j in range(len(batches))], [f"B={b}" for b in batches]
        )
        ax.set(title="end-to-end input frames/s over the model alone", ylabel="ratio")
        ax.legend(fontsize=7)
        fig.tight_layout()
        made["e2e"] = dest / "e2e.png"
        fig.savefig(made["e2e"], dpi=80)
        plt.close(fig)

    ms = sec.get("model_steps")
    if ms:
        rows = sorted([*ms["rows"], *ms.get("bisect", [])], key=lambda r: r["batch"])
        fig, ax = plt.subplots(figsize=(6, 3.2))
        b = [r["batch"] for r in rows]
        ax.plot(b, [r["ms_per_step"] for r in rows], "o-", label="ms per step")
        ax.axhline(FRAME_MS, color="k", ls=":", lw=1, label="32 ms frame")
        ax.set(
            xscale="log",
            yscale="log",
            title=f"parrot step alone on {ms['device']}",
            xlabel="batch B",
            ylabel="ms per step",
        )
        ax2 = ax.twinx()
        ax2.plot(
            b, [r["cpu_us_per_frame"] for r in rows], "s--", color="tab:orange", label="CPU µs per frame"
        )
        ax2.set(yscale="log", ylabel="CPU µs per frame")
        ax2.grid(False)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper center")
        fig.tight_layout()
        made["model"] = dest / "model_steps.png"
        fig.savefig(made["model"], dpi=80)
        plt.close(fig)
    return made


# ---------------------------------------------------------------------------------------------


def write_all(results: Path, paths: dict[str, Path], notes_path: Path | None = None) -> dict[str, Any]:
    latest = build_latest(results)
    paths["latest"].parent.mkdir(parents=True, exist_ok=True)
    paths["latest"].write_text(json.dumps(latest, indent=1) + "\n")
    baseline = json.loads(paths["baseline"].read_text()) if paths["baseline"].exists() else None
    made = plot_all(latest, paths["plots"])
    md_dir = paths["markdown"].parent
    plots = {k: _rel(v, md_dir) for k, v in made.items()}
    notes_path = notes_path or (paths["latest"].parent / "notes.md")
    notes = notes_path.read_text() if notes_path.exists() else ""
    paths["markdown"].write_text(markdown(latest, baseline, plots, notes))
    return latest


def _rel(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path, start)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import artifacts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(REPO / "build" / "bench"))
    p.add_argument(
        "--device", default="cpu", help="which record: cpu (the top level) or cuda (benchmarks/gpu/)"
    )
    p.add_argument("--dest", default="", help="write everything under this directory instead (for trying)")
    p.add_argument("--set-baseline", action="store_true", help="copy latest.json to baseline.json")
    args = p.parse_args(argv)
    paths = artifacts(args.device)
    if args.dest:
        d = Path(args.dest)
        paths = {
            "markdown": d / "BENCHMARKS.md",
            "latest": d / "latest.json",
            "baseline": paths["baseline"],
            "plots": d / "plots",
        }
    if args.set_baseline:
        shutil.copyfile(paths["latest"], paths["baseline"])
        print(f"{paths['latest']} -> {paths['baseline']}")
        return 0
    write_all(Path(args.results), paths, notes_path=artifacts(args.device)["latest"].parent / "notes.md")
    print(f"wrote {paths['markdown']}, {paths['latest']}, plots in {paths['plots']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
