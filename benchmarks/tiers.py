"""CPU per session-frame in each tier under a fixed load, beside the model's own.

    python -m benchmarks.tiers [--sessions 32] [--seconds 8] [--device cpu] [--json PATH]

The load: N parrot sessions from ``benchmarks.loadgen`` (its own process) in **duplex** mode, at
real-time pace, one 32 ms worker frame per append, continuous speech, a commit every 32 frames
and a response asked for as soon as none is active (manual turns, no barge-in), so nearly every
input frame has a reply frame playing beside it. A **session-frame** is one 32 ms input frame of
one session with its ack and its reply frame. The clients read acks carried on output
(``acks_on_output``, as ``DuplexClient`` does: acked once consumed, on the reply frame; the load
then holds real time with the ack p99 under two frames); a second window runs the same load from
clients that take an ``input_ack`` event per append, for comparison (``--no-compare`` skips it).

Measured over the window, from process CPU time (/proc utime + stime, all threads; not wall
time): the session service's and the worker's CPU seconds over the session-frames acknowledged in
the window, in µs per frame; the reply frames per input frame that came back; the generator's CPU.
The worker's mean batch size over the window is read from its ``duplex_worker_batch_size``
histogram, and the model's own CPU µs per frame is then measured at that batch size in a plain
loop (``benchmarks.model_steps``: no engine, no gRPC), after the stack has stopped, beside the
model's other share: computing each reply (once per turn, on its helper threads), per reply frame
times the reply frames per input frame; so is the transport's floor, a bare grpc.aio echo at the
client side's message rate (``benchmarks.grpc_echo``).
With ``--compare-lanes`` a further window runs the same load from clients that hold their
sessions as lanes of ONE ``ConverseMany`` stream per generator process, each sending its sessions'
due events together every ``--flush-ms`` (8 ms: an append waits up to that long, and its ack
latency counts from its deadline); ``--lanes`` runs the main window that way.
The ratios (session / model, worker / model, session / echo) are what carries over to other
machines. Each tier's CPU is also split into user space, kernel and context switches.
**Worker overhead**: the worker's CPU per session-frame minus the model's whole share (its step at
the window's mean batch and its reply synthesis), for the main window and the lanes window (each
at its own mean batch); **mean batch fraction**: the mean batch over the sessions with input (all
of them: every session streams continuously). **Against the model as served**: the same, with the
model's step once a frame period and one reply per frame period (idle between, as a frame clock
runs them) in place of back to back. ``--compare-step-interval-ms T`` runs the load
against a worker on the free-running clock (``--clock free --step-interval-ms T``).
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from typing import Any

import torch

from benchmarks import grpc_echo
from benchmarks._load import Criteria, LoadResult, LoadSpec, judge, run_load, step_row
from benchmarks._services import histogram_sum_count, sample_value, scrape, stack
from benchmarks._sys import FRAME_MS, NoMeasurement, fail, fmt, write_result
from benchmarks.model_steps import ParrotLoop
from worker_service.server import resolve_device


def _criteria(spec: LoadSpec) -> Criteria:
    """Whether the load held real time. Acks carried on output come once the worker consumed the
    input (its step and the way back included), and on the worker's frame clock an input waits
    up to one frame period for its tick: they are held to three frames, not one."""
    return Criteria() if spec.separate_acks else Criteria(ack_p99_ms=3 * FRAME_MS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--append-ms", type=int, default=32)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", default="")
    p.add_argument(
        "--separate-acks",
        action="store_true",
        help="clients that do not read carried_ack (an input_ack event per append, at hand-on)",
    )
    p.add_argument(
        "--lanes",
        action="store_true",
        help="the clients hold their sessions as lanes of one ConverseMany stream",
    )
    p.add_argument(
        "--flush-ms", type=float, default=8.0, help="lanes: how often a client sends its sessions' events"
    )
    p.add_argument(
        "--compare-lanes",
        action="store_true",
        help="also run the load from clients holding their sessions as lanes of one ConverseMany stream",
    )
    p.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the second window with an input_ack event per append",
    )
    p.add_argument("--session-args", default="", help="extra flags of the session service (compare settings)")
    p.add_argument("--worker-args", default="", help="extra flags of the worker, e.g. --step-interval-ms 16")
    p.add_argument(
        "--compare-step-interval-ms",
        type=float,
        default=0.0,
        help="also run the load against a worker on the free clock with this --step-interval-ms "
        "(a stack of its own; 0 = skip)",
    )
    args = p.parse_args(argv)
    print(
        f"tiers: {args.sessions} parrot sessions, duplex load at real time ({args.append_ms} ms appends), "
        f"{args.seconds:g} s window; CPU from /proc",
        flush=True,
    )
    spec = load_spec(
        args.sessions,
        append_ms=args.append_ms,
        warmup_s=args.warmup,
        seconds=args.seconds,
        separate_acks=args.separate_acks,
        lanes=args.lanes,
        flush_ms=args.flush_ms,
    )
    try:
        with stack(
            "parrot",
            device=args.device,
            torch_threads=args.torch_threads,
            session_args=args.session_args.split(),
            worker_args=args.worker_args.split(),
        ) as st:
            r, scraped = load_window(st, spec)
            # The same load from clients that take an input_ack event per append: what reading
            # acks on the output saves (same processes, a window of its own).
            compared = None
            if args.compare and not args.separate_acks:
                acks_spec = dataclasses.replace(spec, separate_acks=True)
                compared = compared_row("separate-acks", *load_window(st, acks_spec), acks_spec)
            # The same load from clients that hold their sessions as lanes of one stream each.
            lanes = None
            if args.compare_lanes and not args.lanes:
                lane_spec = dataclasses.replace(spec, lanes=True)
                lanes = {
                    "flush_ms": args.flush_ms,
                    **compared_row("lanes", *load_window(st, lane_spec), lane_spec),
                }
        interval = None
        if args.compare_step_interval_ms > 0:
            # The same load against a worker that steps at most every T ms (a stack of its own).
            t = args.compare_step_interval_ms
            with stack(
                "parrot",
                device=args.device,
                torch_threads=args.torch_threads,
                session_args=args.session_args.split(),
                # The step interval applies to the free-running clock only.
                worker_args=[*args.worker_args.split(), "--clock", "free", "--step-interval-ms", f"{t:g}"],
            ) as st:
                ri, bi = load_window(st, spec)
            interval = {"step_interval_ms": t, **compared_row(f"--step-interval-ms {t:g}", ri, bi, spec)}
        m = r.merged
        why = judge(m, _criteria(spec), turns=False)
        frames = sum(s["acked"] for s in m["per_session"]) * args.append_ms / FRAME_MS
        if frames <= 0:
            raise NoMeasurement("no input frame was acknowledged in the window")
        if m["reply_frames"] <= 0:
            raise NoMeasurement("no reply frame came back in the window")
        mean_batch, steps = _mean_batch(scraped)
        us = _per_frame(r.cpu_s, frames)
        detail = per_frame_detail(r.cpu_detail, frames)
        row = step_row(r, why)
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        b = max(1, round(mean_batch))
        with torch.inference_mode():
            loop = ParrotLoop(resolve_device(args.device))
            model_at_mean = loop.measure(b, seconds=1.0)
            model_at_n = loop.measure(args.sessions, seconds=1.0)
            # The same step once a frame period, as the frame clock runs it: idle between steps,
            # the model's caches go cold, and each step costs more than back to back.
            model_paced = loop.measure(b, seconds=1.5, pace_s=FRAME_MS / 1000)
            # The model's other share: each reply computed once per turn on its helper threads
            # (the load commits every `cycle` frames, so that is the utterance replied to).
            synthesis = loop.reply_synthesis(spec.cycle, seconds=0.5)
            # ... and one reply per frame period: after idle, a reply costs more too.
            synthesis_paced = loop.reply_synthesis(spec.cycle, seconds=1.0, pace_s=FRAME_MS / 1000)
            # The compared windows' model share at their own mean batch (the same measurement
            # where the batch is the same).
            measured = {b: model_at_mean, args.sessions: model_at_n}
            paced = {b: model_paced}
            for other in (lanes, interval):
                if other is not None:
                    ob = max(1, round(other["mean_batch"]))
                    if ob not in measured:
                        measured[ob] = loop.measure(ob, seconds=1.0)
                    if ob not in paced:
                        paced[ob] = loop.measure(ob, seconds=1.5, pace_s=FRAME_MS / 1000)
                    add_model_share(other, measured[ob], synthesis, args.sessions)
                    add_model_as_served(other, paced[ob], synthesis_paced)
        # The transport's floor beside the model's: a bare grpc.aio echo at the client side's
        # message rate (one message in and one out per session-frame), after the stack stopped.
        echo = grpc_echo.measure(args.sessions, args.append_ms, seconds=min(5.0, args.seconds))
    except NoMeasurement as exc:
        return fail(str(exc))
    result: dict[str, Any] = {
        "device": args.device,
        "sessions": args.sessions,
        "append_ms": args.append_ms,
        "separate_acks": args.separate_acks,
        "window_s": m["window_s"],
        "frames": frames,
        "reply_per_input": m["reply_frames"] / frames,
        "steps_in_window": steps,
        "mean_batch": mean_batch,
        "link_commands": link_commands(scraped),
        "cpu_us_per_frame": us,
        "cpu_detail_per_frame": detail,
        "cpu_pct": r.cpu_pct,
        "model_at_mean_batch": model_at_mean,
        "model_at_n": model_at_n,
        "model_paced_at_mean_batch": model_paced,
        "reply_synthesis": synthesis,
        "reply_synthesis_paced": synthesis_paced,
        "model_reply_us_per_frame": synthesis["cpu_us_per_reply_frame"] * m["reply_frames"] / frames,
        "mean_batch_fraction": mean_batch / args.sessions,
        "grpc_echo": echo,
        "held_real_time": not why,
        "why": why,
        "load": row,
        "separate_acks_compared": compared,
        "step_interval_compared": interval,
        "lanes_compared": lanes,
    }
    model_us = model_at_mean["cpu_us_per_frame"]
    reply_us = result["model_reply_us_per_frame"]
    result["model_whole_us_per_frame"] = model_us + reply_us
    result["worker_overhead_us_per_frame"] = overhead(us["worker"], model_us + reply_us)
    in_place = result["model_in_place_us_per_frame"] = model_in_place(scraped, frames)
    result["worker_serving_us_per_frame"] = serving(us["worker"], in_place)
    add_model_as_served(result, model_paced, synthesis_paced)
    print(
        f"  {frames:,.0f} session-frames in {m['window_s']:g} s ({frames / m['window_s']:,.0f}/s), "
        f"{result['reply_per_input']:.2f} reply frames per input frame, mean batch {mean_batch:.1f} "
        f"({steps:,.0f} steps)"
    )
    print(
        f"  CPU µs per session-frame: session service {fmt(us['session'], '.0f')}, worker "
        f"{fmt(us['worker'], '.0f')}, model alone at B={b} {model_us:.0f} (at B={args.sessions}: "
        f"{model_at_n['cpu_us_per_frame']:.0f}); load generator {fmt(us['generator'], '.0f')}"
    )
    print(
        f"  the model's reply synthesis (helper threads, once per turn): {synthesis['ms_per_reply']:.2f} ms "
        f"per {spec.cycle}-frame reply, {reply_us:.0f} µs per session-frame at "
        f"{result['reply_per_input']:.2f} reply frames per input; the model's whole share "
        f"{model_us + reply_us:.0f} µs"
    )
    for name in ("session", "worker", "generator"):
        d = detail.get(name)
        if d is not None:
            print(
                f"    {name}: {d['user_us']:.0f} µs in user space (Python, gRPC, protobuf), "
                f"{d['kernel_us']:.0f} µs in the kernel, {d['switches']:.1f} context switches "
                "per session-frame"
            )
    print(
        f"  a bare gRPC echo at the same message rate: {echo['cpu_us_per_pair']:.0f} µs per message pair "
        f"({echo['user_us']:.0f} user, {echo['kernel_us']:.0f} kernel, "
        f"{echo['switches']:.1f} context switches)"
        + (
            f"; the session service is {us['session'] / echo['cpu_us_per_pair']:.1f}x that"
            if us["session"] is not None
            else ""
        )
    )
    split = worker_split(detail.get("worker"), us["worker"], model_us + reply_us)
    result["worker_split_us_per_frame"] = split
    if split is not None:
        print(
            f"  worker by thread: its event loop {split['event_loop']:.0f} µs per session-frame (serving "
            f"alone: the model never runs there); its other threads (engine, the model's helpers, gRPC's) "
            f"{split['other_threads']:.0f} µs against the model's whole share of {model_us + reply_us:.0f}"
        )
    if in_place is not None:
        print(
            f"  the model in place (its own CPU counter): steps {in_place['step']:.0f}, helper threads "
            f"{in_place['helpers']:.0f} µs per session-frame, against {model_us:.0f} and {reply_us:.0f} "
            f"in its plain loop (its step once a frame period there: "
            f"{model_paced['cpu_us_per_frame']:.0f}); what serving cost the worker beside the model: "
            f"{fmt(result['worker_serving_us_per_frame'], '.0f')} µs per session-frame"
        )
    print(
        f"  the model as served in a plain loop (its step and one reply per frame period, idle between): "
        f"{result['model_as_served_us_per_frame']:.0f} µs per session-frame (replies "
        f"{synthesis_paced['ms_per_reply']:.2f} ms each, against {synthesis['ms_per_reply']:.2f} "
        "back to back); "
        f"the worker's overhead over it {fmt(result['worker_overhead_as_served_us_per_frame'], '.0f')} µs"
    )
    if us["session"] is not None and us["worker"] is not None:
        print(
            f"  ratios to the model at the same batch: session {us['session'] / model_us:.1f}x, "
            f"worker {us['worker'] / model_us:.1f}x ({us['worker'] / (model_us + reply_us):.1f}x the model's "
            "whole share, reply synthesis included)"
        )
    print(
        f"  mean batch {mean_batch:.1f} of {args.sessions} sessions with input "
        f"({result['mean_batch_fraction']:.2f}); worker overhead (worker minus the model's whole share) "
        f"{fmt(result['worker_overhead_us_per_frame'], '.0f')} µs per session-frame"
    )
    print(
        "  the load "
        + ("held real time" if not why else "did NOT hold real time: " + "; ".join(why))
        + f" (ack p99 {fmt(row['ack_ms']['p99'])} ms)"
        + _commands_note(result["link_commands"]),
        flush=True,
    )
    if compared is not None:
        cu = compared["cpu_us_per_frame"]
        print(
            f"  the same load with an input_ack event per append (clients that do not read carried acks): "
            f"session service {fmt(cu['session'], '.0f')}, worker {fmt(cu['worker'], '.0f')}, load generator "
            f"{fmt(cu['generator'], '.0f')} µs per session-frame",
            flush=True,
        )
    if interval is not None:
        iu = interval["cpu_us_per_frame"]
        held = interval["held_real_time"]
        print(
            f"  the same load against a worker on the free clock, stepping at most every "
            f"{interval['step_interval_ms']:g} ms: "
            f"mean batch {interval['mean_batch']:.1f}, session service {fmt(iu['session'], '.0f')}, "
            f"worker {fmt(iu['worker'], '.0f')} µs per session-frame, "
            f"ack p99 {fmt(interval['ack_p99_ms'])} ms"
            + ("" if held else " (did NOT hold real time: " + "; ".join(interval["why"]) + ")"),
            flush=True,
        )
    if lanes is not None:
        lu = lanes["cpu_us_per_frame"]
        print(
            f"  the same load from clients holding their sessions as lanes of one ConverseMany stream, "
            f"sending every {lanes['flush_ms']:g} ms: mean batch {lanes['mean_batch']:.1f}, session service "
            f"{fmt(lu['session'], '.0f')}, worker {fmt(lu['worker'], '.0f')}, load generator "
            f"{fmt(lu['generator'], '.0f')} µs per session-frame, ack p99 {fmt(lanes['ack_p99_ms'])} ms "
            "(from each append's deadline); the model's whole share at its batch "
            f"{lanes['model_whole_us_per_frame']:.0f} µs, worker overhead "
            f"{fmt(lanes['worker_overhead_us_per_frame'], '.0f')} µs per session-frame"
            + _serving_note(lanes)
            + f"; over the model as served ({lanes['model_as_served_us_per_frame']:.0f} µs) "
            + f"{fmt(lanes['worker_overhead_as_served_us_per_frame'], '.0f')}"
            + _commands_note(lanes["link_commands"])
            + _split_note(lanes["worker_split_us_per_frame"])
            + (
                ""
                if lanes["held_real_time"]
                else " (did NOT hold real time: " + "; ".join(lanes["why"]) + ")"
            ),
            flush=True,
        )
    write_result(args.json, "tiers", result)
    return 0


def load_spec(
    sessions: int,
    *,
    append_ms: int = 32,
    warmup_s: float = 3.0,
    seconds: float = 8.0,
    separate_acks: bool = False,
    lanes: bool = False,
    flush_ms: float = 8.0,
) -> LoadSpec:
    """The tiers' load: ``sessions`` parrot sessions in duplex mode at real time (see the module's
    docstring)."""
    return LoadSpec(
        sessions=sessions,
        append_ms=append_ms,
        mode="duplex",
        warmup_s=warmup_s,
        seconds=seconds,
        tail_s=1.0,
        separate_acks=separate_acks,
        lanes=lanes,
        flush_ms=flush_ms,
    )


def load_window(st: Any, spec: LoadSpec) -> tuple[LoadResult, dict[str, str]]:
    """Run ``spec`` against the stack ``st``; also the worker's /metrics at the window's start
    (``a``) and end (``b``): its batch sizes and the CPU its model spent in place; and the
    session service's (``sa``, ``sb``): the commands its worker link wrote."""
    assert st.session is not None
    worker, session = st.worker_children[0], st.session
    pids = {"session": session.pid, "worker": worker.pid}
    scraped: dict[str, str] = {}

    def during(a: float, b: float) -> None:
        scraped["a"], scraped["sa"] = scrape(worker.metrics), scrape(session.metrics)

        def at_b() -> None:
            time.sleep(max(0.0, b - time.monotonic()))
            scraped["b"], scraped["sb"] = scrape(worker.metrics), scrape(session.metrics)

        threading.Thread(target=at_b, daemon=True).start()

    return run_load(st.target, spec, pids, during_window=during), scraped


def _per_frame(cpu_s: dict[str, float | None], frames: float) -> dict[str, float | None]:
    """CPU µs per session-frame of the session service, the worker and the load generator."""
    return {
        k: (1e6 * v / frames if v is not None else None)
        for k, v in cpu_s.items()
        if k in ("session", "worker", "generator")
    }


def _mean_batch(scraped: dict[str, str]) -> tuple[float, float]:
    """The mean batch over the window, and the steps in it."""
    if "b" not in scraped:
        raise NoMeasurement("the worker's metrics could not be read at the window's end")
    s0, c0 = histogram_sum_count(scraped["a"], "duplex_worker_batch_size")
    s1, c1 = histogram_sum_count(scraped["b"], "duplex_worker_batch_size")
    if c1 <= c0:
        raise NoMeasurement("the worker made no step in the window")
    return (s1 - s0) / (c1 - c0), c1 - c0


def _labelled_total(text: str, name: str, label: str) -> float:
    """The sum of ``name``'s samples whose labels hold ``label`` (``outcome="missed"``)."""
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def link_commands(scraped: dict[str, str]) -> dict[str, float] | None:
    """The session service's worker link over the window: ``WorkerCommand``s written per worker
    step (the aim: one per tick, and a tick is a step but for catch-ups), and the share of those
    written for a tick that missed it (None where the worker does not say which made it). None
    where the session service's metrics were not read at both ends."""
    if not {"a", "b", "sa", "sb"} <= scraped.keys():
        return None
    steps = _mean_batch(scraped)[1]
    written = (
        histogram_sum_count(scraped["sb"], "duplex_session_worker_command_items")[1]
        - histogram_sum_count(scraped["sa"], "duplex_session_worker_command_items")[1]
    )
    name = "duplex_session_worker_tick_commands_total"
    made, missed = (
        _labelled_total(scraped["sb"], name, f'outcome="{o}"')
        - _labelled_total(scraped["sa"], name, f'outcome="{o}"')
        for o in ("made", "missed")
    )
    out = {"per_step": written / steps}
    if made + missed > 0:
        out["missed_fraction"] = missed / (made + missed)
    return out


def model_in_place(scraped: dict[str, str], frames: float) -> dict[str, float] | None:
    """The CPU the model spent in the worker over the window, per session-frame, from its own
    counter (``duplex_worker_model_cpu_seconds_total``): ``step`` (its steps on the engine
    thread) and ``helpers`` (its own threads); None from a worker without the counter."""
    out: dict[str, float] = {}
    for part in ("step", "helpers"):
        label = f'part="{part}"'
        a = sample_value(scraped.get("a", ""), "duplex_worker_model_cpu_seconds_total", label)
        b = sample_value(scraped.get("b", ""), "duplex_worker_model_cpu_seconds_total", label)
        if a is None or b is None or frames <= 0:
            return None
        out[part] = 1e6 * (b - a) / frames
    return out


def compared_row(name: str, r: LoadResult, scraped: dict[str, str], spec: LoadSpec) -> dict[str, Any]:
    """A compared window's figures: CPU per session-frame, mean batch, ack p99."""
    frames = sum(s["acked"] for s in r.merged["per_session"]) * spec.append_ms / FRAME_MS
    if frames <= 0:
        raise NoMeasurement(f"no input frame was acknowledged in the {name} window")
    why = judge(r.merged, _criteria(spec), turns=False)
    return {
        "frames": frames,
        "reply_per_input": r.merged["reply_frames"] / frames,
        "mean_batch": _mean_batch(scraped)[0],
        "cpu_us_per_frame": _per_frame(r.cpu_s, frames),
        "model_in_place_us_per_frame": model_in_place(scraped, frames),
        "link_commands": link_commands(scraped),
        "worker_detail_per_frame": per_frame_detail(r.cpu_detail, frames).get("worker"),
        "ack_p99_ms": step_row(r, why)["ack_ms"]["p99"],
        "held_real_time": not why,
        "why": why,
    }


def _commands_note(link: dict[str, float] | None) -> str:
    """The worker link's commands per step, and the share that missed their tick."""
    if link is None:
        return ""
    missed = link.get("missed_fraction")
    return f"; the worker link wrote {link['per_step']:.2f} commands per worker step" + (
        "" if missed is None else f", {100 * missed:.1f} % of them too late for their tick"
    )


def overhead(worker_us: float | None, model_whole_us: float) -> float | None:
    """The worker's serving overhead per session-frame: its CPU minus the model's whole share
    (its step at the same batch and its reply synthesis)."""
    return None if worker_us is None else worker_us - model_whole_us


def serving(worker_us: float | None, in_place: dict[str, float] | None) -> float | None:
    """What serving cost the worker per session-frame: its CPU minus what its model spent in
    place (steps and helper threads, the model's own counter), where both ran as served: once
    a frame period, beside everything else. The overhead against the plain loop counts, besides
    this, the model running slower there than back to back."""
    if worker_us is None or in_place is None:
        return None
    return worker_us - in_place["step"] - in_place["helpers"]


def add_model_share(
    row: dict[str, Any], model: dict[str, Any], synthesis: dict[str, Any], sessions: int
) -> None:
    """A compared window's model share at its own mean batch, its worker overhead and its mean
    batch over the sessions with input (every session of the load streams continuously)."""
    reply = synthesis["cpu_us_per_reply_frame"] * row["reply_per_input"]
    whole = model["cpu_us_per_frame"] + reply
    worker = row["cpu_us_per_frame"].get("worker")
    row.update(
        model_at_mean_batch=model,
        model_reply_us_per_frame=reply,
        model_whole_us_per_frame=whole,
        worker_overhead_us_per_frame=overhead(worker, whole),
        worker_serving_us_per_frame=serving(worker, row.get("model_in_place_us_per_frame")),
        worker_split_us_per_frame=worker_split(row.get("worker_detail_per_frame"), worker, whole),
        mean_batch_fraction=row["mean_batch"] / sessions,
    )


def add_model_as_served(
    row: dict[str, Any], step_paced: dict[str, Any], synthesis_paced: dict[str, Any]
) -> None:
    """A window's model share as a frame clock runs the model, from its plain loop: its step once
    a frame period and its replies one per frame period (idle between each, so caches go cold as
    they do in the worker); and the worker's overhead over that."""
    whole = (
        step_paced["cpu_us_per_frame"] + synthesis_paced["cpu_us_per_reply_frame"] * row["reply_per_input"]
    )
    row["model_as_served_us_per_frame"] = whole
    row["worker_overhead_as_served_us_per_frame"] = overhead(row["cpu_us_per_frame"].get("worker"), whole)


def _serving_note(row: dict[str, Any]) -> str:
    in_place, cost = row.get("model_in_place_us_per_frame"), row.get("worker_serving_us_per_frame")
    if in_place is None or cost is None:
        return ""
    return (
        f"; the model in place {in_place['step']:.0f} (steps) + {in_place['helpers']:.0f} (helpers), "
        f"serving beside it {cost:.0f}"
    )


def _split_note(split: dict[str, float] | None) -> str:
    if split is None:
        return ""
    return (
        f" (its event loop {split['event_loop']:.0f}, its other threads "
        f"{split['other_threads']:.0f}, {split['other_beyond_model']:.0f} beyond the model's share)"
    )


def worker_split(
    detail: dict[str, float] | None, worker_us: float | None, model_whole_us: float
) -> dict[str, float] | None:
    """The worker's CPU per session-frame split by thread: ``event_loop`` (its main thread:
    commands, fences, conversion, writes; never the model) and ``other_threads`` (the engine
    thread with the model's steps, the model's helper threads, gRPC's threads), and what the
    latter spend beyond the model's whole share measured in a plain loop (``other_beyond_model``:
    the engine's own Python, plus the model running slower beside everything else)."""
    if detail is None or worker_us is None or "main_thread_us" not in detail:
        return None
    main = detail["main_thread_us"]
    other = worker_us - main
    return {"event_loop": main, "other_threads": other, "other_beyond_model": other - model_whole_us}


def per_frame_detail(
    detail: dict[str, dict[str, float] | None], frames: float
) -> dict[str, dict[str, float] | None]:
    """``CpuMeter.detail`` per session-frame: ``user_us``, ``kernel_us`` and ``switches``. Where a
    tier's CPU goes that no Python profiler sees: the kernel (syscalls, loopback TCP, scheduling)
    and the hand-offs between gRPC's threads and the event loop. ``main_thread_us``: the event
    loop's thread alone, where one was measured."""
    out: dict[str, dict[str, float] | None] = {}
    for name, d in detail.items():
        out[name] = (
            None
            if d is None or frames <= 0
            else {
                "user_us": 1e6 * d["user_s"] / frames,
                "kernel_us": 1e6 * d["system_s"] / frames,
                "switches": d["switches"] / frames,
                **({"main_thread_us": 1e6 * d["main_s"] / frames} if "main_s" in d else {}),
            }
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
