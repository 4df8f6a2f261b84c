"""What the in-process engine benchmarks share: the engine started on a model, a step counter."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from worker_service.engine import Engine
from worker_service.engine_types import OwnerStep
from worker_service.model import StepModel
from worker_service.models import create_model

FRAME = 512


class StepCounter:
    """An engine sink that counts steps and the reply frames they emit.

    ``then``, when set, is called with the step count after each batch of items, on the engine
    thread (outside the counter's lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps = 0
        self.reply = 0
        self.then: Callable[[int], None] | None = None

    def __call__(self, items: list[tuple[str, OwnerStep]]) -> None:
        with self.lock:
            for _, item in items:
                if item.step:
                    self.steps += 1
                    self.reply += len(item.audio)
            steps = self.steps
        if self.then is not None:
            self.then(steps)

    def measure(self, seconds: float) -> tuple[int, int, float]:
        """Steps and reply frames counted over about ``seconds``, and the seconds it really took."""
        with self.lock:
            s0, r0 = self.steps, self.reply
        t0 = time.perf_counter()
        time.sleep(seconds)
        with self.lock:
            s1, r1 = self.steps, self.reply
        return s1 - s0, r1 - r0, time.perf_counter() - t0


def start_engine(
    model_name: str,
    device: torch.device,
    options: dict[str, object],
    sink: StepCounter,
    *,
    max_batch: int,
    torch_threads: int = 0,
) -> Engine:
    """An engine running ``model_name``, started; returns once its model is loaded or it died."""

    def factory() -> StepModel[Any]:
        return create_model(model_name, device, options)

    # The free clock: these measure how fast the engine CAN step, not the real-time schedule.
    engine = Engine(factory, sink=sink, max_batch=max_batch, torch_threads=torch_threads, clock="free")
    engine.start()
    try:
        while engine.model is None and engine.dead is None:
            time.sleep(0.01)
    except BaseException:
        engine.stop()
        raise
    return engine
