"""The session -> worker -> session hop: how long an APPEND takes to be reported consumed.

    python -m benchmarks.hop_latency [--sessions 1,16,64,256] [--seconds 4] [--device cpu]

A real ``duplex worker`` process (parrot) and, in this process, a client that does what a session
service replica does on its worker link, and nothing else: it attaches S sessions (``Attach``),
opens ONE ``Run`` stream as their owner, and streams each session at real-time pace, one 32 ms
frame (one APPEND) per session per frame period, the sessions staggered evenly over the period.
Appends that fall due in the same millisecond travel in one ``WorkerCommand`` (the session tier's
link coalesces what is pending the same way).

Measured, per APPEND written in the window: from just before ``call.write`` of the command that
carries it (``time.monotonic()``) to the moment this client has read the ``StepOutput`` whose
``RequestUpdate`` for that session reports ``input_seq`` >= its seq -- the worker received it,
queued it, stepped it (VAD on the frame) and sent the news back. No session-service code runs:
the figure is the hop and the worker, the floor under the session tier's own ack and reply
latency. Each session count runs on the same worker, after the previous count's sessions are
released. The p50/p99 are reported per count; the client's own event loop lag is part of them
(it shares the machine, like the session service would).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc

from benchmarks._services import lone_worker, worker_flags
from benchmarks._sys import CpuMeter, NoMeasurement, fail, fmt, ints, summary_ms, write_result
from duplex.serving import CHANNEL_OPTIONS
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc

FRAME_BYTES = 1024
PERIOD_S = 0.032
OWNER = "bench-hop"
APPEND = worker_pb2.SUBMISSION_KIND_APPEND


async def measure(
    address: str, sessions: int, *, seconds: float, warmup: float, run_id: int
) -> dict[str, Any]:
    """S sessions on one Run stream for ``warmup + seconds``; latencies of the window's appends."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.DuplexWorkerStub(channel)
        ids = [f"hop{run_id}-{i}" for i in range(sessions)]
        sem = asyncio.Semaphore(32)

        async def attach(sid: str) -> None:
            async with sem:
                await stub.Attach(worker_pb2.AttachRequest(session_id=sid, epoch=1, owner=OWNER), timeout=10)

        await asyncio.gather(*(attach(s) for s in ids))
        fences = {sid: common_pb2.Fence(session_id=sid, epoch=1, turn_id=0) for sid in ids}
        call = stub.Run()
        await call.write(worker_pb2.WorkerCommand(owner=OWNER))
        pcm = bytes(FRAME_BYTES)
        # sent[sid][seq] = write time
        sent: dict[str, dict[int, float]] = {sid: {} for sid in ids}
        lat_ms: list[float] = []
        reported: dict[str, int] = dict.fromkeys(ids, 0)
        t0 = time.monotonic() + 0.2
        a = t0 + warmup
        b = a + seconds
        end = b + 0.5
        errors: list[str] = []

        async def reader() -> None:
            while True:
                out = await call.read()
                if out is grpc.aio.EOF:
                    return
                now = time.monotonic()
                for upd in out.updates:
                    if upd.HasField("error") and upd.error.code:
                        errors.append(upd.error.code)
                    seq = upd.input_seq
                    sid = upd.request_id
                    if not seq or sid not in sent:
                        continue
                    times = sent[sid]
                    for k in range(reported[sid] + 1, seq + 1):
                        t = times.pop(k, None)
                        if t is not None and a <= t < b:
                            lat_ms.append(1000.0 * (now - t))
                    reported[sid] = max(reported[sid], seq)

        async def sender() -> None:
            # Phases in whole milliseconds: session i is due at t0 + i * period / S (+ k periods).
            by_ms: dict[int, list[str]] = {}
            for i, sid in enumerate(ids):
                by_ms.setdefault(int(1000 * PERIOD_S * i / sessions), []).append(sid)
            offsets = sorted(by_ms)
            seqs = dict.fromkeys(ids, 0)
            period = 0
            while True:
                base = t0 + period * PERIOD_S
                if base >= end:
                    return
                for off in offsets:
                    due = base + off / 1000.0
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    cmd = worker_pb2.WorkerCommand()
                    for sid in by_ms[off]:
                        seqs[sid] += 1
                        cmd.submit.add(request_id=sid, fence=fences[sid], kind=APPEND, seq=seqs[sid], pcm=pcm)
                    now = time.monotonic()
                    for sid in by_ms[off]:
                        sent[sid][seqs[sid]] = now
                    await call.write(cmd)
                period += 1

        read_task = asyncio.create_task(reader())
        try:
            await sender()
            await asyncio.sleep(0.3)
            await call.write(
                worker_pb2.WorkerCommand(
                    release=[worker_pb2.Release(request_id=s, fence=fences[s], closed=True) for s in ids]
                )
            )
            await asyncio.sleep(0.2)
            await call.done_writing()
            await asyncio.wait_for(read_task, 5.0)
        except TimeoutError:
            pass
        finally:
            read_task.cancel()
            call.cancel()
    expected = int(seconds / PERIOD_S) * sessions
    if not lat_ms:
        raise NoMeasurement(f"{sessions} sessions: no APPEND of the window was reported consumed")
    if len(lat_ms) < 0.9 * expected:
        raise NoMeasurement(
            f"{sessions} sessions: only {len(lat_ms)} of ~{expected} appends of the window were reported "
            f"consumed (errors: {sorted(set(errors)) or 'none'})"
        )
    return {"sessions": sessions, "hop_ms": summary_ms(lat_ms), "appends": len(lat_ms), "errors": len(errors)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="1,16,64,256")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--model", default="parrot")
    p.add_argument("--json", default="")
    p.add_argument("--worker-args", default="", help="extra flags of the worker, e.g. --step-interval-ms 8")
    args = p.parse_args(argv)
    rows = []
    print(
        f"hop latency: APPEND written -> StepOutput reporting it consumed, {args.model} worker on "
        f"{args.device}, real-time pace (one 32 ms frame per session per period), {args.seconds:g} s each",
        flush=True,
    )
    try:
        flags = worker_flags(device=args.device, torch_threads=args.torch_threads) + args.worker_args.split()
        with lone_worker(args.model, flags) as w:
            for i, s in enumerate(ints(args.sessions)):
                meter = CpuMeter({"worker": w.pid, "client": None})
                meter.start()
                row = asyncio.run(measure(w.grpc, s, seconds=args.seconds, warmup=args.warmup, run_id=i))
                row["cpu_pct"] = meter.stop()
                rows.append(row)
                h = row["hop_ms"]
                print(
                    f"  S={s:>4}  p50 {fmt(h['p50'], '.2f'):>6} ms  p90 {fmt(h['p90'], '.2f'):>6} ms  "
                    f"p99 {fmt(h['p99'], '.2f'):>6} ms  max {fmt(h['max'], '.1f'):>6} ms  "
                    f"({row['appends']} appends; cpu worker {fmt(row['cpu_pct']['worker'], '.0f')} %, "
                    f"client {fmt(row['cpu_pct']['client'], '.0f')} %)",
                    flush=True,
                )
    except NoMeasurement as exc:
        return fail(str(exc))
    write_result(args.json, "hop_latency", {"device": args.device, "model": args.model, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
