"""Small Moshi checkpoints for the tests: written once per test session with the real code of
``worker_service.models.moshi.checkpoint`` (random weights of the real layout, reduced sizes, a
sentencepiece tokenizer trained on the spot), loaded through moshi's own ``CheckpointInfo``; no
test downloads anything (``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from duplex.audio import S16LE, PcmFormat, encode, resample
from tests.session_helpers import speech

PCM24K = PcmFormat(S16LE, 24000, 1)
FRAME = 1920
"""80 ms at 24 kHz."""


def small_checkpoint(root: Path) -> Path:
    """A small checkpoint under ``root`` (written once; later calls find it)."""
    from worker_service.models.moshi.checkpoint import write_small_checkpoint

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = root / "moshi-small"
    if not (directory / "config.json").exists():
        write_small_checkpoint(directory, seed=0)
    return directory


def voice_24k(seconds: float, *, seed: int = 0) -> np.ndarray:
    """Speech (the fixtures, one after another) at 24 kHz, ``seconds`` long, float32."""
    x = np.concatenate([speech((seed + i) % 16) for i in range(int(seconds) + 2)])
    y = resample(x, 16000, 24000)[: int(seconds * 24000)]
    return np.ascontiguousarray(y, dtype=np.float32)


def frames_of(x: np.ndarray) -> np.ndarray:
    """``x`` cut into whole 80 ms frames, ``(n, FRAME)``."""
    n = len(x) // FRAME
    return np.ascontiguousarray(x[: n * FRAME].reshape(n, FRAME), dtype=np.float32)


def pcm24k(x: np.ndarray) -> bytes:
    return encode(x, PCM24K)
