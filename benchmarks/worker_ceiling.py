"""The worker's ceiling: how many real-time sessions one worker process holds, and its CPU per
session-frame, with a model whose compute is near zero (``null``) or with the parrot.

    python -m benchmarks.worker_ceiling [--model null|parrot|null,parrot] [--steps 64,128,...]
        [--steps-parrot 64,256,...] [--seconds 3] [--warmup 1] [--refine 2] [--out build/bench]
        [--json PATH] [--worker-args "..."]

One real ``duplex worker`` process (``benchmarks._services.lone_worker``) and, in this process, a
driver that does what a session tier's worker link would do at its cheapest. For each session
count N (a *step* of the ramp): it opens one ``Run`` stream as a fresh owner, attaches N sessions,
and every frame period (32 ms) writes ONE ``WorkerCommand`` carrying one APPEND of one 512-sample
frame for every session. The command's bytes are built once per N (each session's ``Submission``
serialized without its seq) and, per tick, joined with the tick's seq field: protobuf takes fields
in any order, so the seq goes last and every session's submission has the same length (one
length prefix for all). By default the APPENDs travel in columns (``AppendColumns``: every column
but ``seq`` serialized once, the tick's packed ``seq`` column added), as the session service's link
sends them; ``--rows`` sends ``Submission`` rows instead. The driver asks for steps in columns, as
the session service does, and counts the input acks (``StepColumns.input_seq``).

Per step, over the window after the warm-up:

- **real time**: the worker acknowledged at least 95 % of the frames the clock offered in the
  window (N per period of wall time), and the lag (frames submitted but not acknowledged, per
  session, sampled before every write: frame periods behind) never exceeded ``--max-lag``
  (default 3);
- **µs per session-frame**: the worker process's CPU (``/proc/PID/stat`` utime+stime, all of its
  threads, in clock ticks of 10 ms: small counts over short windows are coarse) over the window
  divided by the frames it acknowledged in it;
- **tick ack**: per tick, from the write of its command to the last of its N acks (p50/p99/max,
  and the series): with a frame clock in the engine a frame may wait up to a period for its tick;
- **mean batch** and **mean step**: deltas of the worker's ``duplex_worker_batch_size`` and
  ``duplex_worker_step_duration_seconds`` histograms (``/metrics``) over the window;
- the driver's own CPU per session-frame, and how late its ticks were.

The **ceiling** is the largest N that was real time before the first N that was not (the ramp
runs its steps in order, then bisects ``--refine`` times between the last real-time step and the
first that was not). The ramp stops after two steps in a row that are not real time, except that
the reported counts (64, 256 and 1,024) are always measured when listed, real time or not (the
JSON says which). Each step's sessions are released (closed) and the worker's state dropped before
the next step begins.

The driver shares the machine with the worker: its own CPU is reported beside the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks._services import histogram_sum_count, lone_worker, scrape, worker_flags
from benchmarks._sys import (
    CpuMeter,
    NoMeasurement,
    fail,
    fmt,
    git_info,
    ints,
    machine,
    summary_ms,
    write_result,
)
from duplex.audio import PCM16K_MONO, encode
from duplex.serving import CHANNEL_OPTIONS, run_service
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc

FRAME = 512
PERIOD_S = 0.032
"""One frame of both models: 512 samples at 16 kHz."""
REPORTED = (64, 256, 1024)
"""Session counts whose µs per session-frame the result always carries when the ramp lists them."""
DEFAULT_STEPS = "64,128,256,512,768,1024,1536,2048"
RUN_METHOD = "/duplex.v1.DuplexWorker/Run"
APPEND = worker_pb2.SUBMISSION_KIND_APPEND
MIN_CONSUMED = 0.95
"""Fraction of the offered frames a real-time step must have acknowledged in its window."""
_SUBMIT_TAG = b"\x12"  # WorkerCommand.submit: field 2, length-delimited
_SEQ_TAG = b"\x20"  # Submission.seq: field 4, varint


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


class AppendCommands:
    """One APPEND per session in one ``WorkerCommand``, built once and replayed with a new seq.

    ``bodies`` are the sessions' ``Submission`` messages serialized without ``seq``, all of one
    length; ``build(seq)`` is one ``bytes.join`` over them."""

    def __init__(self, session_ids: Sequence[str], pcm: bytes, epoch: int = 1) -> None:
        bodies = [
            worker_pb2.Submission(
                request_id=sid,
                fence=common_pb2.Fence(session_id=sid, epoch=epoch, turn_id=0),
                kind=APPEND,
                pcm=pcm,
            ).SerializeToString()
            for sid in session_ids
        ]
        sizes = {len(b) for b in bodies}
        if len(sizes) != 1:
            raise ValueError("session ids must all have one length (one length prefix for all)")
        self._bodies = bodies
        self._size = sizes.pop()

    def build(self, seq: int) -> bytes:
        """The command's bytes with ``seq`` on every submission."""
        tail = _SEQ_TAG + varint(seq)
        head = _SUBMIT_TAG + varint(self._size + len(tail))
        return head + (tail + head).join(self._bodies) + tail


_APPENDS_TAG = b"\x32"  # WorkerCommand.appends: field 6, length-delimited
_SEQ_COLUMN_TAG = b"\x2a"  # AppendColumns.seq: field 5, packed varints


class AppendColumnCommands:
    """The same command with its APPENDs in columns (``AppendColumns``), as the session
    service's link sends them to a worker that reads them: every column but ``seq`` serialized
    once; per tick, the packed ``seq`` column (one varint per session) is appended and the
    submessage's length prefix put in front."""

    def __init__(self, session_ids: Sequence[str], pcm: bytes, epoch: int = 1) -> None:
        n = len(session_ids)
        self._n = n
        self._body = worker_pb2.AppendColumns(
            request_id=session_ids,
            session_id=session_ids,
            epoch=[epoch] * n,
            turn_id=[0] * n,
            frames=[len(pcm) // (2 * FRAME)] * n,
            pcm=pcm * n,
        ).SerializeToString()

    def build(self, seq: int) -> bytes:
        """The command's bytes with ``seq`` on every APPEND."""
        column = varint(seq) * self._n
        seqs = _SEQ_COLUMN_TAG + varint(len(column)) + column
        return _APPENDS_TAG + varint(len(self._body) + len(seqs)) + self._body + seqs


@dataclass
class _Counts:
    """What the driver's reader saw on one Run stream."""

    acked: int = 0
    """Acks of an input frame consumed (``StepColumns.input_seq`` set)."""
    steps: int = 0
    """StepOutputs of engine steps (``step`` > 0)."""
    errors: dict[str, int] = field(default_factory=dict)
    ended: str = ""
    per_seq: dict[int, int] = field(default_factory=dict)
    """Acks received per seq (per tick: every session's APPEND of a tick has the tick's seq)."""
    done_at: dict[int, float] = field(default_factory=dict)
    """When the last session's ack of a tick's seq arrived (``time.monotonic()``)."""


def _silence_ish(seed: int = 0) -> bytes:
    """One frame of quiet noise (the parrot's VAD hears no speech in it), as s16le."""
    rng = np.random.default_rng(seed)
    return encode((rng.standard_normal(FRAME) * 0.003).astype(np.float32), PCM16K_MONO)


def _histograms(metrics: str) -> dict[str, float]:
    text = scrape(metrics)
    bsum, bcount = histogram_sum_count(text, "duplex_worker_batch_size")
    ssum, scount = histogram_sum_count(text, "duplex_worker_step_duration_seconds")
    active = 0.0
    for line in text.splitlines():
        if line.startswith("duplex_worker_active_requests "):
            active = float(line.split()[1])
    return {
        "batch_sum": bsum,
        "batch_count": bcount,
        "step_sum": ssum,
        "step_count": scount,
        "active": active,
    }


async def _metrics(metrics: str) -> dict[str, float]:
    return await asyncio.to_thread(_histograms, metrics)


async def _wait_idle(metrics: str, within_s: float = 15.0) -> None:
    """Until the worker holds no session state (the previous step's releases applied)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError):
            if (await _metrics(metrics))["active"] == 0:
                return
        await asyncio.sleep(0.1)


async def measure(
    address: str,
    metrics: str,
    pid: int,
    sessions: int,
    *,
    seconds: float,
    warmup: float,
    run_id: int,
    max_lag: float,
    per_command: int = 0,
    rows: bool = False,
) -> dict[str, Any]:
    """N sessions at real-time pace on one Run stream for ``warmup + seconds``; one ramp row.
    ``rows``: the APPENDs as ``Submission`` rows, not in columns."""
    await _wait_idle(metrics)
    owner = f"ceiling-{run_id}"
    ids = [f"c{run_id:03d}-{i:06d}" for i in range(sessions)]
    t_build = time.perf_counter()
    pcm = _silence_ish(run_id)
    size = per_command or sessions
    form = AppendCommands if rows else AppendColumnCommands
    commands = [form(ids[i : i + size], pcm) for i in range(0, sessions, size)]
    build_once_s = time.perf_counter() - t_build
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.DuplexWorkerStub(channel)
        # Raw bytes out (the commands are pre-serialized), parsed StepOutputs in.
        run: Any = channel.stream_stream(
            RUN_METHOD, request_serializer=None, response_deserializer=worker_pb2.StepOutput.FromString
        )
        call: Any = run()
        # Steps in columns, as the session service's link asks for them.
        await call.write(worker_pb2.WorkerCommand(owner=owner, step_columns=True).SerializeToString())
        sem = asyncio.Semaphore(64)

        async def attach(sid: str) -> None:
            async with sem:
                await stub.Attach(worker_pb2.AttachRequest(session_id=sid, epoch=1, owner=owner), timeout=30)

        await asyncio.gather(*(attach(s) for s in ids))
        counts = _Counts()
        per_seq, done_at = counts.per_seq, counts.done_at
        sent_at: dict[int, float] = {}

        async def reader() -> None:
            try:
                while True:
                    out = await call.read()
                    if out is grpc.aio.EOF:
                        counts.ended = "eof"
                        return
                    if out.step:
                        counts.steps += 1
                    now = time.monotonic()
                    for seq in out.columns.input_seq:
                        if seq:
                            counts.acked += 1
                            got = per_seq[seq] = per_seq.get(seq, 0) + 1
                            if got == sessions:
                                done_at[seq] = now
                    for upd in out.updates:
                        if upd.error.code:
                            counts.errors[upd.error.code] = counts.errors.get(upd.error.code, 0) + 1
            except grpc.aio.AioRpcError as exc:
                counts.ended = exc.code().name

        read_task = asyncio.create_task(reader())
        t0 = time.monotonic() + 0.05
        a, b = t0 + warmup, t0 + warmup + seconds
        ticks = 0
        build_s = 0.0
        late_max = 0.0
        lags: list[float] = []
        marks: dict[str, Any] = {}
        start_metrics: dict[str, float] = {}
        meter = CpuMeter({"worker": pid, "driver": None})
        try:
            while True:
                due = t0 + ticks * PERIOD_S
                window_starts = "a" not in marks and due >= a
                if window_starts:
                    start_metrics = await _metrics(metrics)
                delay = min(due, b) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if due >= b or counts.ended:
                    break
                if window_starts:
                    # After the sleep: the previous tick's acks are in, this tick's are not.
                    marks["a"] = (counts.acked, ticks, start_metrics)
                    meter.start()
                now = time.monotonic()
                in_window = "a" in marks
                if in_window:
                    late_max = max(late_max, now - due)
                    lags.append(ticks - counts.acked / sessions)
                t1 = time.perf_counter()
                data = [c.build(ticks + 1) for c in commands]
                if in_window:
                    build_s += time.perf_counter() - t1
                    sent_at[ticks + 1] = time.monotonic()
                for one in data:
                    await call.write(one)
                ticks += 1
            # At b, one period after the last tick of the window: its acks are in if it kept up.
            acked_b = counts.acked
            t_end = time.monotonic()
            ended = counts.ended
            cpu = meter.stop() if "a" in marks else {}
            end_metrics = await _metrics(metrics)
            lag_end = ticks - acked_b / sessions
            releases = worker_pb2.WorkerCommand(
                release=[
                    worker_pb2.Release(
                        request_id=s, fence=common_pb2.Fence(session_id=s, epoch=1, turn_id=0), closed=True
                    )
                    for s in ids
                ]
            )
            await call.write(releases.SerializeToString())
            await call.done_writing()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(read_task), 10.0)
        finally:
            read_task.cancel()
            call.cancel()
    if "a" not in marks:
        raise NoMeasurement(f"{sessions} sessions: the run ended before its window ({counts.ended})")
    acked_a, ticks_a, start_metrics = marks["a"]  # as the window began
    wall = meter.wall
    consumed = acked_b - acked_a
    offered = sessions * wall / PERIOD_S
    worker_s = meter.seconds.get("worker")
    driver_s = meter.seconds.get("driver")
    batches = end_metrics["batch_count"] - start_metrics["batch_count"]
    steps_n = end_metrics["step_count"] - start_metrics["step_count"]
    window_ticks = ticks - ticks_a
    consumed_fraction = consumed / offered if offered else 0.0
    lag_max = max(lags) if lags else None
    # Per tick of the window: from its command's write to the last of its N acks (a tick not
    # acknowledged in full by the window's end counts as acknowledged then: a lower bound).
    ack_ms = [1000 * (done_at.get(seq, t_end) - t) for seq, t in sent_at.items()]
    real_time = (
        not counts.errors
        and not ended
        and consumed_fraction >= MIN_CONSUMED
        and lag_max is not None
        and lag_max <= max_lag
    )
    return {
        "sessions": sessions,
        "real_time": real_time,
        "window_s": round(wall, 3),
        "frames_offered": round(offered),
        "frames_submitted": window_ticks * sessions,
        "frames_acked": consumed,
        "consumed_fraction": round(consumed_fraction, 4),
        "lag_frames_max": None if lag_max is None else round(lag_max, 2),
        "lag_frames_mean": round(sum(lags) / len(lags), 2) if lags else None,
        "lag_frames_end": round(lag_end, 2),
        "tick_ack_ms": summary_ms(ack_ms),
        "tick_ack_ms_series": [round(x, 1) for x in ack_ms],
        "worker_cpu_pct": cpu.get("worker"),
        "other_cpu_pct": cpu.get("other"),
        "us_per_session_frame": None if worker_s is None or not consumed else 1e6 * worker_s / consumed,
        "mean_batch": (end_metrics["batch_sum"] - start_metrics["batch_sum"]) / batches if batches else None,
        "steps_per_s": batches / wall if wall else None,
        "mean_step_ms": 1000 * (end_metrics["step_sum"] - start_metrics["step_sum"]) / steps_n
        if steps_n
        else None,
        "driver": {
            "cpu_pct": cpu.get("driver"),
            "us_per_session_frame": None if driver_s is None or not consumed else 1e6 * driver_s / consumed,
            "build_us_per_tick": 1e6 * build_s / window_ticks if window_ticks else None,
            "build_once_ms": round(1000 * build_once_s, 2),
            "commands_per_tick": len(commands),
            "command_bytes": len(commands[0].build(ticks + 1)),
            "late_ms_max": round(1000 * late_max, 2),
        },
        "errors": counts.errors,
        "stream_ended": ended or None,
    }


def _row_line(row: dict[str, Any]) -> str:
    d = row["driver"]
    return (
        f"  N={row['sessions']:>5}  {'real time' if row['real_time'] else 'BEHIND   '}  "
        f"worker {fmt(row['us_per_session_frame'], '.1f'):>6} µs/session-frame "
        f"({fmt(row['worker_cpu_pct'], '.0f')} % cpu)  batch {fmt(row['mean_batch'], '.0f'):>5}  "
        f"step {fmt(row['mean_step_ms'], '.2f'):>6} ms  acked {100 * row['consumed_fraction']:.1f} %  "
        f"lag max {fmt(row['lag_frames_max'], '.1f')}  "
        f"tick ack p99 {fmt(row['tick_ack_ms']['p99'], '.0f')} ms  "
        f"| driver {fmt(d['us_per_session_frame'], '.1f')} µs/sf, "
        f"late max {d['late_ms_max']:.1f} ms"
    )


def ramp(
    model: str,
    steps: list[int],
    *,
    device: str,
    torch_threads: int,
    seconds: float,
    warmup: float,
    refine: int,
    max_lag: float,
    worker_args: list[str],
    per_command: int = 0,
    rows_form: bool = False,
) -> dict[str, Any]:
    """Start one worker of ``model`` and run the ramp on it; the result for one model."""
    most = max(steps)
    flags = worker_flags(device=device, torch_threads=torch_threads, max_batch=max(most, 1))
    flags += ["--max-sessions", "0", "--max-tick-load", "0", "--log-level", "WARNING", *worker_args]
    rows: list[dict[str, Any]] = []
    print(
        f"worker ceiling: {model} worker on {device}, one APPEND per session per {1000 * PERIOD_S:.0f} ms "
        f"in one command, {warmup:g} s warm-up + {seconds:g} s each",
        flush=True,
    )
    with lone_worker(model, flags) as w:
        run_id = 0

        def one(n: int) -> dict[str, Any]:
            nonlocal run_id
            run_id += 1
            coro = measure(
                w.grpc,
                w.metrics,
                w.pid,
                n,
                seconds=seconds,
                warmup=warmup,
                run_id=run_id,
                max_lag=max_lag,
                per_command=per_command,
                rows=rows_form,
            )
            row = run_service(coro)
            rows.append(row)
            print(_row_line(row), flush=True)
            return row

        misses = 0
        for n in steps:
            if misses >= 2 and n not in REPORTED:
                continue
            row = one(n)
            misses = 0 if row["real_time"] else misses + 1
        # Bisect between the last real-time step before the first miss and that miss.
        lo, hi = _bracket(rows)
        for _ in range(refine):
            if hi is None or hi - lo <= max(8, lo // 16):
                break
            mid = (lo + hi) // 2
            if one(mid)["real_time"]:
                lo = mid
            else:
                hi = mid
    ordered = sorted(rows, key=lambda r: r["sessions"])
    ceiling, first_miss = _bracket(ordered)
    by_n = {r["sessions"]: r for r in ordered}
    return {
        "model": model,
        "device": device,
        "period_ms": 1000 * PERIOD_S,
        "seconds": seconds,
        "warmup_s": warmup,
        "max_lag_frames": max_lag,
        "min_consumed_fraction": MIN_CONSUMED,
        "worker_args": worker_args,
        "sessions_per_command": per_command or None,
        "appends_in": "rows" if rows_form else "columns",
        "ceiling_sessions": ceiling,
        "first_behind_sessions": first_miss,
        "largest_real_time_sessions": max((r["sessions"] for r in ordered if r["real_time"]), default=0),
        "us_per_session_frame": {str(n): by_n[n]["us_per_session_frame"] for n in REPORTED if n in by_n},
        "real_time_at": {str(n): by_n[n]["real_time"] for n in REPORTED if n in by_n},
        "mean_batch": {str(n): by_n[n]["mean_batch"] for n in REPORTED if n in by_n},
        "rows": ordered,
    }


def _bracket(rows: list[dict[str, Any]]) -> tuple[int, int | None]:
    """(largest real-time N before the first N that was not, that N or None), in ramp order."""
    lo, hi = 0, None
    for row in sorted(rows, key=lambda r: r["sessions"]):
        if not row["real_time"]:
            hi = row["sessions"]
            break
        lo = row["sessions"]
    return lo, hi


def _out_path(out: str, model: str) -> Path:
    path = Path(out)
    if path.suffix == ".json":
        return path if model == "null" else path.with_name(f"{path.stem}_{model}.json")
    return path / ("worker_ceiling.json" if model == "null" else f"worker_ceiling_{model}.json")


def _summary(result: dict[str, Any]) -> str:
    per = ", ".join(
        f"{n}: {fmt(v, '.1f')} µs{'' if result['real_time_at'][n] else ' (behind)'}"
        for n, v in result["us_per_session_frame"].items()
    )
    batch = ", ".join(f"{n}: {fmt(v, '.0f')}" for n, v in result["mean_batch"].items())
    miss = result["first_behind_sessions"]
    return (
        f"{result['model']}: ceiling {result['ceiling_sessions']} real-time sessions per worker process "
        f"({'behind at ' + str(miss) if miss else 'no step was behind'}); "
        f"worker µs per session-frame {per or '-'}; mean batch {batch or '-'}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="null", help="null, parrot, or both: null,parrot")
    p.add_argument("--steps", default=DEFAULT_STEPS, help="session counts of the ramp, in order")
    p.add_argument("--seconds", type=float, default=3.0, help="measured window per step")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--refine", type=int, default=2, help="bisection steps after the ramp")
    p.add_argument(
        "--per-command",
        type=int,
        default=0,
        help="most sessions per WorkerCommand (0 = all of them in one command per tick)",
    )
    p.add_argument("--rows", action="store_true", help="APPENDs as Submission rows (default: columns)")
    p.add_argument("--max-lag", type=float, default=3.0, help="frame periods a real-time step may lag")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--step-interval-ms 8'")
    p.add_argument("--steps-parrot", default="", help="the parrot's ramp (default: --steps)")
    p.add_argument("--out", default="build/bench", help="a directory (or a .json path) for the result")
    p.add_argument(
        "--json",
        default="",
        help="a .json path for the result (overrides --out; the parrot's goes beside it as STEM_parrot.json)",
    )
    args = p.parse_args(argv)
    if args.json:
        args.out = args.json
    steps = ints(args.steps)
    parrot_steps = ints(args.steps_parrot) if args.steps_parrot else steps
    if not steps or min(steps) < 1 or not parrot_steps or min(parrot_steps) < 1:
        return fail("--steps needs positive session counts")
    summaries = []
    for model in [m.strip() for m in args.model.split(",") if m.strip()]:
        try:
            result = ramp(
                model,
                parrot_steps if model == "parrot" else steps,
                device=args.device,
                torch_threads=args.torch_threads,
                seconds=args.seconds,
                warmup=args.warmup,
                refine=args.refine,
                per_command=args.per_command,
                rows_form=args.rows,
                max_lag=args.max_lag,
                worker_args=shlex.split(args.worker_args),
            )
        except NoMeasurement as exc:
            return fail(str(exc))
        result["machine"] = machine()
        result["git"] = git_info()
        path = _out_path(args.out, model)
        write_result(path, "worker_ceiling", result)
        summaries.append(_summary(result))
        print(f"  written to {path}", flush=True)
    for line in summaries:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
