"""Engine throughput without gRPC: steps/s and frames/s at several batch sizes.

    .venv/bin/python -m benchmarks.worker_bench [--device auto] [--seconds 2]

Every request has input for every step (the parrot runs its batched VAD on all of them) and
half of them reply at the same time (frames/s counts input frames consumed plus reply frames
emitted), so each step is a full batch of the given size.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks._common import FRAME, StepCounter, start_engine
from duplex.fence import Fence
from worker_service.engine import Engine
from worker_service.engine_types import APPEND, COMMIT, RESPOND, Enqueue, QueueCounter, Work
from worker_service.server import resolve_device


def bench(
    model_name: str, options: dict[str, object], device: torch.device, batch: int, seconds: float
) -> tuple[float, float]:
    counts = StepCounter()
    engine = start_engine(model_name, device, options, counts, max_batch=batch)
    rng = np.random.default_rng(0)
    n_in = 2000  # frames of input per request: more than a run consumes
    cmds: list[Any] = []
    for i in range(batch):
        fence = Fence(f"s{i}", 1, 1)
        counter = QueueCounter()
        if i % 2 == 0:
            # A reply to 1000 frames of committed noise, then more input alongside it.
            seed = (rng.standard_normal((1000, FRAME)) * 0.05).astype(np.float32)
            cmds += [
                Enqueue(
                    Work(
                        APPEND, fence, "o", f"r{i}", seq=1, frames=seed, options=_no_auto(model_name, engine)
                    ),
                    counter,
                ),
                Enqueue(Work(COMMIT, fence, "o", f"r{i}"), counter),
                Enqueue(Work(RESPOND, fence, "o", f"r{i}"), counter),
            ]
        noise = (rng.standard_normal((n_in, FRAME)) * 0.05).astype(np.float32)
        cmds.append(Enqueue(Work(APPEND, fence, "o", f"r{i}", seq=2, frames=noise), counter))
    # Warm up past the seed input, then measure.
    engine.submit(cmds)
    while engine.steps < 1000 + 20:
        time.sleep(0.01)
    steps, frames_out, dt = counts.measure(seconds)
    engine.stop()
    step_rate = steps / dt
    return step_rate, step_rate * batch + frames_out / dt


def _no_auto(model_name: str, engine: Engine) -> object | None:
    assert engine.model is not None
    return engine.model.parse_options({"auto_commit": False}) if model_name == "parrot" else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--torch-threads", type=int, default=0)
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = resolve_device(args.device)
    models: list[tuple[str, dict[str, object]]] = [
        ("parrot", {}),
        ("synthetic", {"hidden_size": 256, "layers": 2, "emit_every": 2, "reply_frames": 100_000}),
    ]
    print(f"device={device} torch_threads={torch.get_num_threads()}")
    print(f"{'model':<10} {'batch':>6} {'steps/s':>10} {'frames/s':>11} {'ms/step':>9}")
    for name, opts in models:
        for b in (int(x) for x in args.batches.split(",")):
            rate, fps = bench(name, opts, device, b, args.seconds)
            print(f"{name:<10} {b:>6} {rate:>10.1f} {fps:>11.0f} {1000.0 / rate:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
