"""Why ``duplex.audio`` resamples with libsoxr's "HQ" recipe: attenuation and latency per recipe.

For each soxr recipe (LQ, MQ, HQ, VHQ) prints

- the gain of tones at 48 -> 16 kHz: those above 8 kHz (the output Nyquist) would alias into
  the band, those below must pass; RMS out over RMS in, 50 ms at each end skipped;
- how much output the streaming resampler holds back while a live stream is fed in 20 ms
  chunks (the latency it adds; ``flush`` returns it at the end), mean and max over 3 s of
  noise, per rate pair.

``python -m benchmarks.resampler`` (about a second). Deterministic figures, for reading.
"""

from __future__ import annotations

import argparse

import numpy as np
import soxr

TONES_HZ = (1000, 3000, 6000, 7000, 8500, 9000, 10000, 12000, 14000, 16000, 20000, 23000)
PAIRS = ((48000, 16000), (16000, 48000), (8000, 16000), (44100, 16000), (16000, 24000))


def tone_gain_db(freq_hz: float, quality: str, src: int = 48000, dst: int = 16000) -> float:
    """Output RMS over input RMS of a 1 s tone, skipping the filter's start and end transients."""
    x = (0.5 * np.sin(2 * np.pi * freq_hz * np.arange(src) / src)).astype(np.float32)
    y = soxr.resample(x, src, dst, quality=quality)[dst // 20 : -dst // 20]
    rms_y = np.sqrt(np.mean(np.square(y, dtype=np.float64)))
    rms_x = np.sqrt(np.mean(np.square(x, dtype=np.float64)))
    return float(20 * np.log10(max(rms_y, 1e-15) / rms_x))


def held_back(src: int, dst: int, quality: str, chunk_ms: int = 20, seconds: int = 3) -> tuple[float, float]:
    """Mean and max output samples the stream owes after each chunk (the first second skipped)."""
    x = np.random.default_rng(0).uniform(-0.5, 0.5, src * seconds).astype(np.float32)
    step = src * chunk_ms // 1000
    rs = soxr.ResampleStream(src, dst, 1, dtype="float32", quality=quality)
    out, owed = 0, []
    for i in range(0, len(x), step):
        out += len(rs.resample_chunk(x[i : i + step]))
        owed.append((i + step) * dst / src - out)
    steady = np.array(owed[len(owed) // seconds :])
    return float(steady.mean()), float(steady.max())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--qualities", default="LQ,MQ,HQ,VHQ")
    args = p.parse_args(argv)
    qualities = args.qualities.split(",")
    print(f"soxr {soxr.__version__} (libsoxr {soxr.__libsoxr_version__})")
    print("\ntone gain at 48 -> 16 kHz, dB (above 8 kHz: aliasing; below: passband)")
    print(f"{'Hz':>6} " + " ".join(f"{q:>8}" for q in qualities))
    for f in TONES_HZ:
        print(f"{f:>6} " + " ".join(f"{tone_gain_db(f, q):8.2f}" for q in qualities))
    print("\noutput held back in a stream fed 20 ms chunks: mean / max, samples (ms)")
    for src, dst in PAIRS:
        cells = []
        for q in qualities:
            mean, peak = held_back(src, dst, q)
            cells.append(f"{q} {mean:.0f}/{peak:.0f} ({1000 * mean / dst:.1f}/{1000 * peak / dst:.1f} ms)")
        print(f"{src:>5} -> {dst:<5}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
