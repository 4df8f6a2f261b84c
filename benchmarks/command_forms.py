"""What a command of APPENDs costs each side in its two forms: rows (a ``Submission`` per APPEND)
and columns (``AppendColumns``: arrays for the whole command, all PCM in one field).

For N sessions of one owner, each with one 32 ms frame, measures in a plain loop, CPU µs per
session (thread time, best of five):

- **session**: ``command_form.build_command`` from the plugin's ``Submission`` messages and
  ``SerializeToString``, what the session service's link does for each command it writes;
- **worker**: ``FromString`` and ``CommandHandler.handle`` (validation, fencing, the input queue,
  the PCM decode, the engine commands), what the worker's event loop does for each command it
  reads, into an engine that is not running (its inbox and the input queues are emptied after
  each command, inside the measured call, the same for both forms).

``python -m benchmarks.command_forms [--sessions 64]`` (a few seconds). No gRPC, no threads: the
figures are the conversion alone, the part the form decides. Warm loops: in the worker, where a
command comes once a frame period, the same code costs about twice this (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks._sys import NoMeasurement
from benchmarks.step_forms import us_per_session
from duplex.fence import Fence
from duplex.v1 import worker_pb2
from session_service.workers.command_form import build_command
from worker_service.commands import CommandHandler
from worker_service.config import WorkerConfig
from worker_service.engine import Engine
from worker_service.fencing import FenceTable
from worker_service.models import create_model
from worker_service.serving_state import ServingState
from worker_service.sessions import SessionTable

OWNER = "owner"
APPEND = worker_pb2.SUBMISSION_KIND_APPEND


class _Worker:
    """The worker's command handling over a loaded null model and an engine that never runs."""

    def __init__(self, sessions: int) -> None:
        model = create_model("null", torch.device("cpu"), {})
        self.frame_bytes = model.frame_samples * model.audio_format.frame_bytes
        state = ServingState()
        state.model = model
        config = WorkerConfig()
        self.engine = Engine(lambda: model, sink=lambda items: None)
        fences = FenceTable()
        self.sessions = SessionTable(fences, config, has_stream=lambda o: True, submit=self.engine.submit)
        self.handler = CommandHandler(config, state, self.engine, None, self.sessions, None)  # type: ignore[arg-type]
        self.ids = [f"s{i}" for i in range(sessions)]
        for sid in self.ids:
            fences.attach(sid, 1, OWNER, False)

    def read(self, data: bytes) -> int:
        """Handle one command; how many engine commands it queued (then emptied again, with the
        input queues: nothing steps)."""
        self.handler.handle(OWNER, worker_pb2.WorkerCommand.FromString(data))
        queued = len(self.engine._inbox)
        self.engine._inbox.clear()
        for sid in self.ids:
            counter = self.sessions.counter(sid)
            counter.retired = counter.submitted
        return queued


def submissions(sessions: int, frame_bytes: int) -> list[worker_pb2.Submission]:
    """One APPEND of one frame of quiet noise per session, as the plugin plans them."""
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(frame_bytes // 2) * 100).astype("<i2").tobytes()
    subs = []
    for i in range(sessions):
        sub = worker_pb2.Submission(request_id=f"r{i}", kind=APPEND, seq=9, pcm=pcm)
        Fence(f"s{i}", 1, 3).write_to(sub.fence)
        subs.append(sub)
    return subs


def _write(subs: list[worker_pb2.Submission], frame_bytes: int) -> bytes:
    return build_command(subs, [], [], frame_bytes=frame_bytes).SerializeToString()


def measure(sessions: int) -> list[dict[str, Any]]:
    worker = _Worker(sessions)
    subs = submissions(sessions, worker.frame_bytes)
    rows: list[dict[str, Any]] = []
    for columns in (False, True):
        form = "columns" if columns else "rows"
        frame_bytes = worker.frame_bytes if columns else 0
        data = _write(subs, frame_bytes)
        if worker.read(data) != sessions:  # a refused APPEND would measure its refusal
            raise NoMeasurement(f"the worker did not queue every APPEND of the {form}")
        rows.append(
            {
                "form": form,
                "session_us_per_session": us_per_session(partial(_write, subs, frame_bytes), sessions),
                "worker_us_per_session": us_per_session(partial(worker.read, data), sessions),
                "bytes_per_session": len(data) / sessions,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"a command of {args.sessions} APPENDs of one frame each, one owner; CPU µs per session")
    for r in measure(args.sessions):
        print(
            f"  {r['form']:>7}: session (build, serialize) {r['session_us_per_session']:5.2f}   "
            f"worker (parse, handle) {r['worker_us_per_session']:5.2f}   {r['bytes_per_session']:6.0f} bytes"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
