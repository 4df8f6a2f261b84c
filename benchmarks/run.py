"""All benchmarks, short: ``python -m benchmarks.run`` (what ``make bench`` runs).

Sections, each in its own Python process (so torch thread settings and event loops of one
cannot colour the next), printed as they finish:

1. ``worker_bench``: the engine alone, steps/s and frames/s per model and batch size;
2. ``grpc_hop``: per-message cost of a grpc.aio bidi stream, one chunk per message vs packed;
3. ``e2e_bench``: the whole serving path (real processes) as a fraction of the model alone.

One run of each; the figures are for reading, not for asserting. About 1.5-2 minutes on a
2-core machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sections(device: str, seconds: float) -> list[tuple[str, list[str]]]:
    """(title, argv after ``python -m``) of every section."""
    return [
        (
            "worker_bench: the engine alone",
            ["benchmarks.worker_bench", "--device", device, "--seconds", "1", "--batches", "1,16,64"],
        ),
        (
            "grpc_hop: why the internal hop carries batches",
            ["benchmarks.grpc_hop", "--streams", "64", "--chunks", "256", "--pack", "64"],
        ),
        (
            "e2e_bench: the serving path vs the model alone",
            ["benchmarks.e2e_bench", "--device", device, "--seconds", f"{seconds:g}", "--batches", "1,16,64"],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda[:i] (worker_bench and e2e_bench)")
    p.add_argument("--seconds", type=float, default=2.0, help="length of each e2e measurement")
    p.add_argument("--only", default="", help="comma list of section modules to run, e.g. e2e_bench")
    args = p.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    failed: list[str] = []
    start = time.monotonic()
    for title, cmd in sections(args.device, args.seconds):
        module = cmd[0].rsplit(".", 1)[-1]
        if only and module not in only:
            continue
        print(f"\n=== {title} ===", flush=True)
        t0 = time.monotonic()
        code = subprocess.call([sys.executable, "-m", *cmd], cwd=REPO)
        print(f"--- {module}: {time.monotonic() - t0:.0f} s", flush=True)
        if code != 0:
            print(f"--- {module} FAILED (exit {code})", flush=True)
            failed.append(module)
    print(
        f"\nbenchmarks done in {time.monotonic() - start:.0f} s" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
