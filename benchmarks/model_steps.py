"""The parrot model alone, in a plain loop: time per batched step at B = 1 ... 1024, CPU per frame,
and the largest batch whose step fits one 32 ms frame.

    python -m benchmarks.model_steps [--device cpu|cuda] [--batches 1,2,4,...,1024] [--seconds 0.4]

No engine, no gRPC, no queues: ``ParrotModel.step`` called again and again on one ``StepBatch`` of
B requests, each with an input frame (low noise; the batched Silero VAD runs on every row) and a
reply playing (every request emits one reply frame per step) -- a frame with its reply frame, the
model's whole share of one session-frame. Under ``torch.inference_mode()``, with ``--torch-threads``
intra-op threads, as the worker's engine thread runs it. The reply itself (the pitch-shifted
utterance) is computed once per turn on the parrot's helper threads, off the step: that share is
measured apart, by ``ParrotLoop.reply_synthesis``. Per B: wall ms per step (on CUDA the step
ends with the VAD probabilities copied to the host, which waits for the device), process CPU µs
per frame, frames/s. Then the largest B that fits 32 ms is narrowed by bisection between the
last batch that fits and the first that does not.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks._sys import FRAME_MS, NoMeasurement, fail, ints, write_result
from duplex.audio import encode
from worker_service.model import StepBatch
from worker_service.models import create_model
from worker_service.models.parrot import parrot_reply
from worker_service.server import resolve_device

FRAME = 512
REPLY_FRAMES = 4096


class ParrotLoop:
    """One parrot model; ``measure(B)`` steps a batch of B replying requests in a plain loop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model: Any = create_model("parrot", device, {})
        self.reply = bytes(FRAME * 2 * REPLY_FRAMES)
        self.rng = np.random.default_rng(0)

    def measure(
        self, batch: int, *, seconds: float, min_steps: int = 5, pace_s: float = 0.0
    ) -> dict[str, float]:
        """Steps back to back, or with ``pace_s`` one step per ``pace_s`` as a frame clock steps
        (idle between; the CPU is the steps' alone, the wall time per step is then the pace)."""
        model = self.model
        states = [model.create_state(f"s{i}") for i in range(batch)]
        try:
            for st in states:
                self._replying(st)
            frames = (self.rng.standard_normal((batch, FRAME)) * 0.01).astype(np.float32)
            sb = StepBatch(
                req_ids=[f"s{i}" for i in range(batch)],
                states=states,
                frames=frames,
                has_input=np.ones(batch, dtype=np.bool_),
            )
            for _ in range(3):  # warm-up: allocator, first-call paths
                model.step(sb)
            steps = 0
            c0, t0 = time.process_time(), time.perf_counter()
            while True:
                if pace_s:
                    time.sleep(max(0.0, t0 + steps * pace_s - time.perf_counter()))
                model.step(sb)
                steps += 1
                if states[0].reply_pos >= len(self.reply) - 4 * FRAME * 2:
                    for st in states:
                        self._replying(st)
                if steps >= min_steps and time.perf_counter() - t0 >= seconds:
                    break
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
        finally:
            for st in states:
                model.release_state(st)
        if steps <= 0 or wall <= 0:
            raise NoMeasurement(f"parrot B={batch}: no step measured")
        return {
            "batch": batch,
            "steps": steps,
            "ms_per_step": 1000.0 * wall / steps,
            "cpu_us_per_frame": 1e6 * cpu / (steps * batch),
            "wall_us_per_frame": 1e6 * wall / (steps * batch),
            "frames_per_s": steps * batch / wall,
        }

    def reply_synthesis(
        self, frames: int, *, seconds: float, min_replies: int = 5, pace_s: float = 0.0
    ) -> dict[str, float]:
        """CPU µs per reply frame of computing a reply to an utterance of ``frames`` frames, as
        ``ParrotModel.respond`` does on its helper threads: the pitch shift, then the encoding.
        Its cost grows with the utterance, so it is per frame of reply. Back to back, or with
        ``pace_s`` one reply per ``pace_s`` (idle between, as replies come in a served load)."""
        if frames <= 0:
            raise NoMeasurement("reply synthesis: no utterance to reply to")
        utterance = (self.rng.standard_normal(frames * FRAME) * 0.1).astype(np.float32)
        pitch = self.model.defaults.pitch_semitones
        fmt = self.model.audio_format
        encode(parrot_reply(utterance, pitch), fmt)  # warm-up
        replies = 0
        c0, t0 = time.process_time(), time.perf_counter()
        while replies < min_replies or time.perf_counter() - t0 < seconds:
            if pace_s:
                time.sleep(max(0.0, t0 + replies * pace_s - time.perf_counter()))
            encode(parrot_reply(utterance, pitch), fmt)
            replies += 1
        cpu = time.process_time() - c0
        return {
            "utterance_frames": frames,
            "replies": replies,
            "ms_per_reply": 1000.0 * cpu / replies,
            "cpu_us_per_reply_frame": 1e6 * cpu / (replies * frames),
        }

    def _replying(self, st: Any) -> None:
        st.reply, st.reply_pos, st.reply_started, st.pending = self.reply, 0, True, None


def sweep(loop: ParrotLoop, batches: list[int], *, seconds: float, refine: int = 3) -> dict[str, Any]:
    """Per-step figures at each B, then the largest B within one frame period, bisected."""
    rows = []
    for b in batches:
        rows.append(loop.measure(b, seconds=seconds))
        r = rows[-1]
        print(
            f"  B={b:>5}  {r['ms_per_step']:8.2f} ms/step  {r['cpu_us_per_frame']:8.1f} µs CPU/frame  "
            f"{r['frames_per_s']:>10,.0f} frames/s" + ("" if r["ms_per_step"] < FRAME_MS else "  > 32 ms"),
            flush=True,
        )
    fits = [r["batch"] for r in rows if r["ms_per_step"] < FRAME_MS]
    misses = [r["batch"] for r in rows if r["ms_per_step"] >= FRAME_MS]
    lo = max(fits) if fits else None
    hi = min((m for m in misses if lo is None or m > lo), default=None)
    extra = []
    if lo is not None and hi is not None:
        for _ in range(refine):
            if hi - lo <= max(1, lo // 16):
                break
            mid = (lo + hi) // 2
            r = loop.measure(mid, seconds=seconds)
            extra.append(r)
            print(f"  B={mid:>5}  {r['ms_per_step']:8.2f} ms/step (bisecting)", flush=True)
            if r["ms_per_step"] < FRAME_MS:
                lo = mid
            else:
                hi = mid
    return {
        "rows": rows,
        "bisect": extra,
        "largest_batch_within_frame": lo,
        "first_batch_over_frame": hi,
        "all_measured_fit": hi is None and lo is not None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    p.add_argument("--seconds", type=float, default=0.4, help="measured per batch size (at least 5 steps)")
    p.add_argument("--torch-threads", type=int, default=1, help="0 = torch's default")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = resolve_device(args.device)
    print(
        f"parrot step alone (plain loop, every request with an input and a reply frame), device={device}, "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    try:
        with torch.inference_mode():
            loop = ParrotLoop(device)
            result = sweep(loop, ints(args.batches), seconds=args.seconds)
    except NoMeasurement as exc:
        return fail(str(exc))
    lo, hi = result["largest_batch_within_frame"], result["first_batch_over_frame"]
    if lo is None:
        print(f"  no batch fits {FRAME_MS:g} ms (B=1 takes {result['rows'][0]['ms_per_step']:.1f} ms)")
    elif hi is None:
        print(f"  every batch measured fits {FRAME_MS:g} ms (the largest: B={lo})")
    else:
        print(f"  largest batch within {FRAME_MS:g} ms: B={lo} (B={hi} does not fit)")
    write_result(
        args.json,
        "model_steps",
        {"device": str(device), "torch_threads": torch.get_num_threads(), **result},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
