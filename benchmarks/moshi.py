"""The moshi model (model-native full duplex) on a small checkpoint: the model alone, and as served.

    python -m benchmarks.moshi [--slots 1,8,32] [--ramp 1,8,16,24,32,48,64] [--seconds 8] [--json PATH]

A small random-weight checkpoint of the real layout (``duplex moshi-checkpoint``: LM dim 64 x 2
layers, Mimi of 8 SEANet filters) is written to a temporary directory; ``--checkpoint`` measures
another (a real one: give a GPU).

- **plain loop**: ``MoshiModel.step`` again and again with every slot fed a frame (Mimi encode,
  one ``LMGen`` step, Mimi decode for the whole fixed batch), back to back: wall ms per step and CPU
  µs per session-frame at each slot count of ``--ramp``; the most slots whose step fits the frame
  period with ``--headroom`` to spare is the **sessions per worker at real time** (every slot
  costs compute whether a session is in it or not).
- **as served**: for each of ``--slots``, a local stack (one ``duplex worker --model moshi
  --max-sessions B --temperature 0``, a session service) and B sessions streaming speech at real
  time in 80 ms appends for ``--seconds``: the worker's CPU per session-frame beside the model's
  own counter in place (``duplex_worker_model_cpu_seconds_total{part="step"}``) and the plain
  loop's at the same B (their ratio: what serving costs over the model), the ticks that missed
  their deadline (``duplex_worker_ticks_late_total`` of ``duplex_worker_tick_duration_seconds``),
  the tick load, and the audio frames that reached clients late.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks._sys import CpuMeter, NoMeasurement, fail, ints, write_result
from duplex.audio import S16LE, PcmFormat, encode, resample
from duplex.client import event_kind
from duplex.stack import LocalStack
from duplex.v1 import session_pb2, session_pb2_grpc
from worker_service.model import StepBatch
from worker_service.models.moshi.checkpoint import RANDOM_7B

FRAME = 1920
FRAME_S = 0.08
PCM24K = PcmFormat(S16LE, 24000, 1)


#: Kyutai's Moshi (male voice), bf16: what ``--checkpoint auto`` measures when it is cached.
MOSHIKO = "kyutai/moshiko-pytorch-bf16"


def _cached(repo: str) -> bool:
    """Whether ``repo``'s LM weights are in the Hugging Face cache (nothing is fetched)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "model.safetensors"), str)


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(1))
    return total


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def plain_loop(checkpoint: str, slots: int, device: torch.device, seconds: float) -> dict[str, float]:
    """``MoshiModel.step`` with every one of ``slots`` slots fed, back to back."""
    from worker_service.models.moshi import MoshiModel

    model = MoshiModel(device, checkpoint=checkpoint, slots=slots, temperature=0.0)
    states = [model.create_state(f"s{i}") for i in range(slots)]
    rng = np.random.default_rng(0)
    frames = (0.05 * rng.standard_normal((slots, FRAME))).astype(np.float32)
    batch = StepBatch(
        req_ids=[f"s{i}" for i in range(slots)],
        states=states,
        frames=frames,
        has_input=np.ones(slots, dtype=np.bool_),
    )
    for _ in range(3):
        model.step(batch)
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while steps < 5 or time.perf_counter() - t0 < seconds:
        model.step(batch)
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del model, states, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next slot count builds its own
    return {
        "slots": slots,
        "ms_per_step": 1000 * wall / steps,
        "cpu_us_per_session_frame": 1e6 * cpu / (steps * slots),
        "fraction_of_frame": wall / steps / FRAME_S,
    }


def _voice(seconds: float, seed: int) -> bytes:
    from tests.session_helpers import speech  # the fixtures: speech, not noise

    x = np.concatenate([speech((seed + i) % 16) for i in range(int(seconds) + 2)])
    return encode(resample(x, 16000, 24000)[: int(seconds * 24000)], PCM24K)


async def _session(target: str, pcm: bytes, heard: list[int]) -> None:
    """One client: open, stream ``pcm`` at real time in 80 ms appends, close."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = session_pb2_grpc.DuplexSessionStub(ch)
        out: asyncio.Queue[session_pb2.ClientEvent | None] = asyncio.Queue()
        cfg = session_pb2.SessionConfig(input_format=PCM24K.to_proto())
        out.put_nowait(session_pb2.ClientEvent(open=session_pb2.SessionOpen(model="moshi", config=cfg)))

        async def requests() -> Any:
            while (ev := await out.get()) is not None:
                yield ev

        call = stub.Converse(requests())

        async def read() -> None:
            async for ev in call:
                if event_kind(ev) == "audio_delta":
                    heard[0] += 1

        reader = asyncio.create_task(read())
        step = 2 * FRAME
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(pcm) - step + 1, step)):
            out.put_nowait(
                session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=k + 1, pcm=pcm[i : i + step]))
            )
            await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME_S - time.monotonic()))
        out.put_nowait(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        out.put_nowait(None)
        await asyncio.wait_for(reader, 30)


def as_served(checkpoint: str, slots: int, device: str, torch_threads: int, seconds: float) -> dict[str, Any]:
    """``slots`` sessions at real time through a local stack whose worker has ``slots`` slots."""
    with tempfile.TemporaryFile("w+") as log:
        stack = LocalStack(
            workers=1,
            model="moshi",
            plugin="session_service.plugins.moshi:MoshiPlugin",
            device=device,
            worker_args=[
                *("--checkpoint", checkpoint, "--temperature", "0", "--max-sessions", str(slots)),
                *("--torch-threads", str(torch_threads), "--max-tick-load", "0"),
            ],
            session_args=["--max-sessions", str(max(64, 2 * slots))],
            log=log,
            startup_timeout_s=180.0,
        )
        with stack:
            worker = stack.worker_children[0]
            assert stack.session is not None
            before = _scrape(worker.metrics_url)
            meter = CpuMeter({"worker": worker.pid, "session": stack.session.pid})
            heard = [0]
            meter.start()
            voices = [_voice(seconds, i) for i in range(slots)]

            async def all_sessions() -> None:
                await asyncio.gather(*(_session(stack.target, v, heard) for v in voices))

            asyncio.run(all_sessions())
            cpu = meter.stop()
            after = _scrape(worker.metrics_url)
            session_metrics = _scrape(stack.session.metrics_url)

    def delta(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    frames = slots * int(seconds / FRAME_S)
    ticks = delta("duplex_worker_tick_duration_seconds_count")
    late = delta("duplex_worker_ticks_late_total")
    worker_s = meter.seconds.get("worker") or 0.0
    model_s = delta("duplex_worker_model_cpu_seconds_total")
    return {
        "slots": slots,
        "sessions": slots,
        "seconds": seconds,
        "session_frames": frames,
        "audio_frames_heard": heard[0],
        "worker_cpu_us_per_session_frame": 1e6 * worker_s / frames,
        "model_in_place_us_per_session_frame": 1e6 * model_s / frames,
        "session_cpu_pct": cpu.get("session"),
        "worker_cpu_pct": cpu.get("worker"),
        "ticks": ticks,
        "ticks_late": late,
        "ticks_late_pct": 100 * late / ticks if ticks else None,
        "tick_load": _metric(after, "duplex_worker_tick_load"),
        "output_frames_late": _metric(session_metrics, "duplex_session_output_frames_late_total"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument(
        "--checkpoint",
        default="",
        help="a Moshi checkpoint (default: a small one, written now); auto: Moshiko when its weights "
        f"are in the Hugging Face cache, else the real 7B layout with random weights ({RANDOM_7B})",
    )
    p.add_argument("--slots", default="1,8,32", help="slot counts measured as served (and in the loop)")
    p.add_argument("--ramp", default="1,8,16,24,32,48,64", help="slot counts of the plain loop")
    p.add_argument("--seconds", type=float, default=8.0, help="each served window")
    p.add_argument("--loop-seconds", type=float, default=1.5, help="each plain-loop measurement")
    p.add_argument("--headroom", type=float, default=0.1, help="share of the frame kept free at real time")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    with tempfile.TemporaryDirectory(prefix="moshi-bench-") as tmp:
        checkpoint = args.checkpoint
        if checkpoint == "auto":
            checkpoint = MOSHIKO if _cached(MOSHIKO) else RANDOM_7B
            print(f"checkpoint: {checkpoint}", flush=True)
        if not checkpoint:
            from worker_service.models.moshi.checkpoint import write_small_checkpoint

            checkpoint = str(write_small_checkpoint(Path(tmp) / "small"))
        try:
            loop = []
            for n in sorted(set(ints(args.ramp)) | set(ints(args.slots))):
                row = plain_loop(checkpoint, n, device, args.loop_seconds)
                loop.append(row)
                print(
                    f"plain loop, {n:3d} slots: {row['ms_per_step']:.1f} ms per step "
                    f"({100 * row['fraction_of_frame']:.0f}% of the frame), "
                    f"{row['cpu_us_per_session_frame']:.0f} µs CPU per session-frame",
                    flush=True,
                )
            fits = [r["slots"] for r in loop if r["fraction_of_frame"] <= 1 - args.headroom]
            served = []
            for n in ints(args.slots):
                row = as_served(checkpoint, n, str(device), args.torch_threads, args.seconds)
                plain = next(r for r in loop if r["slots"] == n)
                row["plain_loop_us_per_session_frame"] = plain["cpu_us_per_session_frame"]
                row["served_over_plain"] = (
                    row["worker_cpu_us_per_session_frame"] / plain["cpu_us_per_session_frame"]
                )
                served.append(row)
                print(
                    f"as served, {n:3d} sessions: worker {row['worker_cpu_us_per_session_frame']:.0f} µs per "
                    f"session-frame (model in place {row['model_in_place_us_per_session_frame']:.0f}, "
                    "plain loop "
                    f"{plain['cpu_us_per_session_frame']:.0f}: x{row['served_over_plain']:.2f}), ticks late "
                    f"{row['ticks_late']:.0f} of {row['ticks']:.0f}, tick load {row['tick_load']:.2f}",
                    flush=True,
                )
        except NoMeasurement as exc:
            return fail(str(exc))
    write_result(
        args.json,
        "moshi",
        {
            "device": str(device),
            "torch_threads": args.torch_threads,
            "checkpoint": "small (random weights)" if not args.checkpoint else checkpoint,
            "plain_loop": loop,
            "sessions_at_real_time": max(fits) if fits else 0,
            "headroom": args.headroom,
            "served": served,
        },
    )
    print(
        f"sessions per worker at real time (plain loop, {100 * args.headroom:.0f}% headroom): "
        f"{max(fits, default=0)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
