"""What a step costs each side in its two forms: rows (a ``BatchEntry`` and an ``input_seq``
update per request) and columns (``StepColumns``: arrays for the whole step).

For N sessions of one owner, each stepped with its ack (and, with ``audio``, a reply frame of
1 KiB), measures in a plain loop, CPU µs per session (thread time, best of five):

- **worker**: ``worker_service.outputs.to_proto`` and ``SerializeToString``, what the worker's
  event loop does for each step it writes;
- **session**: ``FromString`` and ``Router.on_step`` to sessions that take the output and do
  nothing with it, what the session service's link reader does for each step before the
  sessions' own work.

``python -m benchmarks.step_forms [--sessions 64]`` (a few seconds). No gRPC, no threads: the
figures are the conversion alone, the part the form decides.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from duplex.fence import Fence
from duplex.v1 import common_pb2, worker_pb2
from session_service.workers.step_routing import Router, SessionRegistry
from worker_service.engine_types import OwnerStep
from worker_service.fencing import FenceTable
from worker_service.outputs import to_proto

OWNER = "owner"
REPLY_BYTES = 1024  # one 32 ms frame at 16 kHz mono s16le


class _Session:
    """Takes a step's output for one session and does nothing with it (the router's cost alone)."""

    closed = False

    def __init__(self, session_id: str, link: object) -> None:
        self.session_id = session_id
        self.link = link

    def on_output(
        self,
        fence: Any,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
        input_seq: int = 0,
    ) -> None:
        del fence, payload, updates, input_seq


class _Link:
    address = "bench"

    def attaching(self, session_id: str) -> bool:
        return False


def owner_step(sessions: int, *, audio: bool) -> OwnerStep:
    """One step of ``sessions`` requests of one owner, each acked, each with a reply frame when
    ``audio``."""
    fmt = common_pb2.AudioFormat(sample_rate_hz=16000, channels=1)
    item = OwnerStep(step=7, output_type=worker_pb2.OUTPUT_TYPE_AUDIO)
    for i in range(sessions):
        rid = f"r{i}"
        item.batch.append((rid, Fence(f"s{i}", 1, 3)))
        item.input_seq.append(100 + i)
        if audio:
            item.audio_ids.append(rid)
            item.audio.append(common_pb2.AudioPayload(pcm=bytes(REPLY_BYTES), format=fmt))
    return item


def _write(fences: FenceTable, item: OwnerStep, columns: bool) -> bytes:
    """The worker's side: convert the step for its owner and serialize it."""
    msg = to_proto(fences, OWNER, item, columns=columns)
    assert msg is not None
    return msg.SerializeToString()


def _read(router: Router, link: _Link, data: bytes) -> None:
    """The session service's side: parse the step and route it to its sessions."""
    router.on_step(link, worker_pb2.StepOutput.FromString(data))


def us_per_session(fn: Callable[[], object], sessions: int, *, reps: int = 200) -> float:
    """CPU µs per session of ``fn`` (one step), best of five runs of ``reps`` calls."""
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t0) / reps)
    return 1e6 * best / sessions


def measure(sessions: int) -> list[dict[str, Any]]:
    fences = FenceTable()
    link = _Link()
    registry = SessionRegistry()
    for i in range(sessions):
        fences.attach(f"s{i}", 1, OWNER, False)
        registry.add(_Session(f"r{i}", link))  # type: ignore[arg-type]
    router = Router(registry)
    rows: list[dict[str, Any]] = []
    for audio in (False, True):
        item = owner_step(sessions, audio=audio)
        for columns in (False, True):
            data = _write(fences, item, columns)
            worker = us_per_session(partial(_write, fences, item, columns), sessions)
            session = us_per_session(partial(_read, router, link, data), sessions)
            rows.append(
                {
                    "form": "columns" if columns else "rows",
                    "audio": audio,
                    "worker_us_per_session": worker,
                    "session_us_per_session": session,
                    "bytes_per_session": len(data) / sessions,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"a step of {args.sessions} sessions of one owner, each acked; CPU µs per session")
    for r in measure(args.sessions):
        what = "with a reply frame each" if r["audio"] else "acks alone"
        print(
            f"  {r['form']:>7}, {what:<24} worker (convert, serialize) {r['worker_us_per_session']:5.2f}   "
            f"session (parse, route) {r['session_us_per_session']:5.2f}   {r['bytes_per_session']:6.0f} bytes"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
