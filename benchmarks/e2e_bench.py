"""How close the whole serving path is to the model alone (product promise #2).

    .venv/bin/python -m benchmarks.e2e_bench [--models synthetic,parrot] [--batches 1,16,64]
                                             [--seconds 3] [--device auto]

For each model and batch size B it measures, one run each:

(a) **model alone**: the worker engine in-process (as ``benchmarks.worker_bench`` drives it), B
    requests that each always have input queued and are always replying: each step consumes
    one input frame and emits one reply frame per request. Input frames/s = steps/s x B;
    reply frames/s = reply payloads the engine hands out per second.
(b) **full path**: real processes -- one ``duplex worker`` and one ``duplex session`` with the
    model's plugin -- driven by B concurrent ``DuplexClient`` sessions in this process. Each
    session is a **full-duplex** client: it appends one worker frame (512 samples, 1 KiB) per
    ``append`` as fast as its ``input_ack`` window allows, all the time, replies or not; every
    ``--cycle`` frames it commits (manual turns, no server turn detection), and it asks for a
    response as soon as none of its own is active (at once when the previous reply is done,
    else when its ``response_done`` comes). The sessions' turns are staggered so they are not
    in phase. Input frames/s counts acknowledged frames; reply frames/s counts ``audio_delta``
    audio received. The session service holds acks while more than ``--max-unconsumed-ms``
    (320 ms: 10 frames) of a session's audio waits unconsumed at the worker, so an acknowledged
    frame is a consumed one within 10 frames per session (with its 2 s default the worker's input
    queues filling up during a short window would count as throughput).

Why full duplex: the parrot is lockstep (its reply advances one frame per input frame), so a
client that stops sending until ``response_done`` waits for a reply that only its own input
can advance; with silence continuation off nothing else does, and the benchmark deadlocked (0
frames/s at B=1 and B=16). A full-duplex client is what the product serves, and it keeps the
measurement about the serving path: the session service runs with its defaults (silence
continuation on), which feeds silence only when a client falls behind real time -- never here,
where every client runs far ahead of it.

Both use the same turn shape: a reply of about ``--cycle`` frames to every ``--cycle`` input
frames (synthetic: ``reply_frames=cycle, emit_every=1``; parrot: its reply is the committed
input, advanced one frame per input frame). The table gives the full path as a fraction of the
model alone at the same B, how many times real time (31.25 frames/s) each session was served,
how evenly, and where the CPU went. A measurement in which a session is acknowledged nothing or
receives no reply audio is not a result: the benchmark fails (exit 3) and says so.

The numbers are one run on whatever machine this is -- client, session service and worker
share its cores in (b), while (a) has them to itself -- so they are ratios to read, never
thresholds to assert.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch

from benchmarks._common import FRAME, StepCounter, start_engine
from benchmarks._sys import NoMeasurement, fail, write_result
from duplex.client import DuplexClient, Session, event_kind, turn_detection
from duplex.fence import Fence
from duplex.stack import LocalStack
from worker_service.engine import Engine
from worker_service.engine_types import APPEND, COMMIT, RESPOND, Enqueue, QueueCounter, Work
from worker_service.server import resolve_device

FRAME_BYTES = FRAME * 2  # s16le mono at 16 kHz: the worker format of both models
FRAMES_PER_S = 16000 / FRAME  # real time: 31.25 frames/s


@dataclass(frozen=True)
class ModelSpec:
    """What one model needs on both paths."""

    name: str
    plugin: str
    construct: dict[str, object]
    """Model construction options (engine options in-process, CLI flags for the worker)."""
    worker_flags: tuple[str, ...]
    session_flags: tuple[str, ...]
    session_extra: Callable[[int], dict[str, object]]
    """``extra_body`` of each session's open, given the cycle length."""
    alone_params: Callable[[int], dict[str, object]]
    """Submission params for the in-process requests, given the cycle length."""


def _synthetic(hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(
        name="synthetic",
        plugin="session_service.plugins.synthetic:SyntheticPlugin",
        construct={"hidden_size": hidden, "layers": layers},
        worker_flags=("--hidden-size", str(hidden), "--layers", str(layers)),
        session_flags=(),
        session_extra=lambda cycle: {"reply_frames": cycle, "emit_every": 1},
        alone_params=lambda cycle: {"reply_frames": cycle, "emit_every": 1},
    )


PARROT = ModelSpec(
    name="parrot",
    plugin="session_service.plugins.parrot:ParrotPlugin",
    construct={},
    worker_flags=(),
    # The production default (silence continuation on): the full-duplex clients below stay ahead
    # of real time, so no silence is ever fed; input, not a clock, advances the lockstep reply.
    session_flags=(),
    session_extra=lambda cycle: {},
    # Manual turns on both paths (the session sends auto_commit=false for auto_respond=false).
    alone_params=lambda cycle: {"auto_commit": False},
)


@dataclass
class Rates:
    input_fps: float
    """Input frames/s: consumed (model alone) or acknowledged (full path)."""
    reply_fps: float
    """Reply frames/s: emitted (model alone) or received as ``audio_delta`` (full path)."""
    min_share: float = 1.0
    """Full path: the slowest session's input rate over the mean (1.0 = all equal)."""
    cpu: tuple[float | None, ...] = ()
    """Full path: cores used by the client (this process), the session service, the worker."""
    errors: int = 0
    error_codes: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------
# (a) the model alone


class _Feeder:
    """Keeps every request's queue ``ahead`` frames beyond what was stepped, in whole cycles of
    APPEND(cycle frames), COMMIT, RESPOND -- so each request is always listening and replying."""

    def __init__(self, engine: Engine, batch: int, cycle: int, options: object, ahead: int) -> None:
        self.engine = engine
        self.cycle = cycle
        self.options = options
        self.ahead = ahead
        # Silent input: parrot's VAD hears no speech, so each commit is exactly one cycle's frames.
        # One shared array: APPEND frames are only read.
        self.frames = np.zeros((cycle, FRAME), dtype=np.float32)
        self.requests = [(Fence(f"s{i}", 1, 1), f"r{i}", QueueCounter()) for i in range(batch)]
        self.cycles = 0

    def top_up(self, steps: int) -> None:
        cmds: list[Any] = []
        while self.cycles * self.cycle < steps + self.ahead:
            opts = self.options if self.cycles == 0 else None
            self.cycles += 1
            for fence, rid, counter in self.requests:
                append = Work(APPEND, fence, "o", rid, seq=self.cycles, frames=self.frames, options=opts)
                cmds += [
                    Enqueue(append, counter),
                    Enqueue(Work(COMMIT, fence, "o", rid), counter),
                    Enqueue(Work(RESPOND, fence, "o", rid), counter),
                ]
        self.engine.submit(cmds)


def model_alone(
    spec: ModelSpec, device: torch.device, batch: int, *, seconds: float, cycle: int, torch_threads: int
) -> Rates:
    """Engine in-process: B requests, each always with input queued and always replying."""
    counts = StepCounter()
    engine = start_engine(
        spec.name, device, spec.construct, counts, max_batch=batch, torch_threads=torch_threads
    )
    try:
        if engine.model is None:
            raise RuntimeError(f"engine failed: {engine.dead!r}")
        options = engine.model.parse_options(spec.alone_params(cycle))
        feeder = _Feeder(engine, batch, cycle, options, ahead=max(4 * cycle, 256))
        feeder.top_up(0)
        # Topped up on the engine thread, after each batch: keeps a second Python thread off the GIL.
        counts.then = feeder.top_up
        while engine.steps < 2 * cycle + 20 and engine.dead is None:  # replies running
            time.sleep(0.01)
        steps, reply, dt = counts.measure(seconds)
        if engine.dead is not None:
            raise RuntimeError(f"engine failed: {engine.dead!r}")
        if steps <= 0 or reply <= 0:
            raise NoMeasurement(f"{spec.name} alone B={batch}: {steps} steps and {reply} reply frames")
    finally:
        engine.stop()
    return Rates(input_fps=steps * batch / dt, reply_fps=reply / dt)


# ---------------------------------------------------------------------------------------------
# (b) the full path


class _Driver:
    """One client session: appends as fast as acks allow, a response every ``cycle`` frames."""

    def __init__(self, session: Session, *, cycle: int, window: int) -> None:
        self.session = session
        self.cycle = cycle
        self.window = window
        self.idle = asyncio.Event()  # no response of ours is active
        self.idle.set()
        self.acked = 0  # = the highest acked seq: one frame per append
        self.reply_bytes = 0
        self.error_codes: list[str] = []

    async def read(self) -> None:
        async for ev in self.session.events():
            kind = event_kind(ev)
            if kind == "input_ack":
                self.acked = max(self.acked, ev.input_ack.seq)
            elif ev.HasField("carried_ack"):  # on output, for a client that reads it there
                self.acked = max(self.acked, ev.carried_ack.seq)
            if kind == "audio_delta":
                self.reply_bytes += len(ev.audio_delta.pcm)
            elif kind == "response_done":
                self.idle.set()
            elif kind == "error":
                self.error_codes.append(ev.error.code)

    async def send(self, stop: asyncio.Event, offset: int) -> None:
        """Full duplex: a frame whenever the ack window allows, a commit every ``cycle`` frames,
        and a response asked for as soon as none is active.

        ``offset`` staggers the sessions' turns (the first turn is shorter by it)."""
        chunk = bytes(FRAME_BYTES)
        since_commit = offset
        want_response = False
        while not stop.is_set():
            if not await self.session.wait_acked(self.window, timeout_s=5.0):
                if stop.is_set():
                    return
                raise NoMeasurement(
                    f"no input_ack for 5 s with {self.window} appends in flight: the serving path stalled"
                )
            await self.session.send_audio(chunk)
            since_commit += 1
            if since_commit >= self.cycle:
                since_commit = 0
                await self.session.commit()
                want_response = True
            if want_response and self.idle.is_set():
                want_response = False
                self.idle.clear()
                await self.session.create_response()


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (this one when ``pid`` is None); None if unknown."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def full_path(
    target: str,
    spec: ModelSpec,
    batch: int,
    *,
    seconds: float,
    warmup: float,
    cycle: int,
    window: int,
    pids: tuple[int | None, ...] = (None,),
) -> Rates:
    """B client sessions against a running session service at ``target``.

    ``pids``: processes whose CPU use to report (None = this process, the client)."""
    async with DuplexClient(target) as client:
        sessions = await asyncio.gather(
            *(
                client.open_session(
                    model=spec.name,
                    turn_detection=turn_detection(auto_respond=False, barge_in=False),
                    extra_body=spec.session_extra(cycle),
                )
                for _ in range(batch)
            )
        )
        drivers = [_Driver(s, cycle=cycle, window=window) for s in sessions]
        stop = asyncio.Event()
        readers = [asyncio.create_task(d.read()) for d in drivers]
        senders = [asyncio.create_task(d.send(stop, i * cycle // batch)) for i, d in enumerate(drivers)]
        try:
            await asyncio.sleep(warmup)
            acked0 = [d.acked for d in drivers]
            reply0 = sum(d.reply_bytes for d in drivers)
            cpu0 = [_cpu_seconds(p) for p in pids]
            t0 = time.perf_counter()
            await asyncio.sleep(seconds)
            acked = [d.acked - a for d, a in zip(drivers, acked0, strict=True)]
            reply = sum(d.reply_bytes for d in drivers) - reply0
            cpu1 = [_cpu_seconds(p) for p in pids]
            dt = time.perf_counter() - t0
            for task in senders:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    if isinstance(exc, NoMeasurement):
                        raise exc
                    raise RuntimeError(f"a client session failed: {exc!r}")
        finally:
            stop.set()
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(s.close(timeout_s=3.0) for s in sessions)), 10.0)
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
    codes = [c for d in drivers for c in d.error_codes]
    check_flow(spec.name, batch, acked, reply, codes)
    mean = sum(acked) / len(acked)
    return Rates(
        input_fps=sum(acked) / dt,
        reply_fps=reply / FRAME_BYTES / dt,
        min_share=min(acked) / mean if mean else 0.0,
        cpu=tuple(
            (b - a) / dt if a is not None and b is not None else None for a, b in zip(cpu0, cpu1, strict=True)
        ),
        errors=len(codes),
        error_codes=set(codes),
    )


def check_flow(model: str, batch: int, acked: list[int], reply_bytes: int, codes: list[str]) -> None:
    """Raise ``NoMeasurement`` unless every session's input flowed and reply audio came back."""
    idle = sum(1 for a in acked if a <= 0)
    if idle:
        raise NoMeasurement(
            f"{model} B={batch}: {idle} of {batch} sessions had no input acknowledged in the window "
            f"(errors: {sorted(set(codes)) or 'none'})"
        )
    if reply_bytes <= 0:
        raise NoMeasurement(f"{model} B={batch}: no reply audio received in the window")


# ---------------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="synthetic,parrot", help="comma list of synthetic, parrot")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each measurement")
    p.add_argument("--warmup", type=float, default=1.5, help="full path: seconds before measuring")
    p.add_argument(
        "--max-unconsumed-ms",
        type=int,
        default=320,
        help="the session service's --max-unconsumed-input-ms: acked ~ consumed within this much per session",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of torch on both paths (0 = torch's default; 1 suits a small CPU box)",
    )
    p.add_argument("--cycle", type=int, default=32, help="input frames per turn (~ reply frames per turn)")
    p.add_argument("--window", type=int, default=32, help="unacknowledged appends a client keeps in flight")
    p.add_argument("--hidden-size", type=int, default=256, help="synthetic model")
    p.add_argument("--layers", type=int, default=2, help="synthetic model")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)

    specs = {"synthetic": _synthetic(args.hidden_size, args.layers), "parrot": PARROT}
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in specs]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {sorted(specs)}")
    batches = [int(b) for b in args.batches.split(",")]
    device = resolve_device(args.device)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    print(
        f"e2e: device={device} torch_threads={args.torch_threads or torch.get_num_threads()} "
        f"cycle={args.cycle} window={args.window} seconds={args.seconds:g} (one run; ratios, not thresholds)",
        flush=True,
    )
    rows: list[str] = []
    records: list[dict[str, object]] = []
    try:
        for name in names:
            spec = specs[name]
            alone = {
                b: model_alone(
                    spec, device, b, seconds=args.seconds, cycle=args.cycle, torch_threads=args.torch_threads
                )
                for b in batches
            }
            with tempfile.TemporaryFile("w+") as log:
                full = _run_full_path(spec, batches, args, log)
            for b in batches:
                rows.append(_row(name, b, alone[b], full[b]))
                records.append(_record(name, b, alone[b], full[b]))
                print(f"  {rows[-1]}", flush=True)
    except NoMeasurement as exc:
        return fail(str(exc))
    print(HEADER)
    for row in rows:
        print(row)
    print(
        "in/out = input/reply frames/s (alone: consumed/emitted; e2e: acked/received in audio_delta);\n"
        "ratio = e2e / alone at the same B; x rt = e2e input per session in multiples of real time;\n"
        "min/mean = slowest session's input over the mean; cpu = cores used by client/session/worker."
    )
    write_result(
        args.json,
        "e2e",
        {
            "device": str(device),
            "torch_threads": args.torch_threads,
            "cycle": args.cycle,
            "window": args.window,
            "seconds": args.seconds,
            "rows": records,
        },
    )
    return 0


def _record(name: str, b: int, a: Rates, f: Rates) -> dict[str, object]:
    return {
        "model": name,
        "batch": b,
        "alone_in_fps": a.input_fps,
        "alone_out_fps": a.reply_fps,
        "e2e_in_fps": f.input_fps,
        "e2e_out_fps": f.reply_fps,
        "in_ratio": f.input_fps / a.input_fps if a.input_fps > 0 else None,
        "out_ratio": f.reply_fps / a.reply_fps if a.reply_fps > 0 else None,
        "x_realtime": f.input_fps / b / FRAMES_PER_S,
        "min_share": f.min_share,
        "cpu_cores": {"client": f.cpu[0], "session": f.cpu[1], "worker": f.cpu[2]} if len(f.cpu) == 3 else {},
        "errors": f.errors,
        "error_codes": sorted(f.error_codes),
    }


HEADER = (
    f"{'model':<10} {'B':>3} {'alone in/s':>10} {'alone out/s':>11} {'e2e in/s':>9} {'e2e out/s':>9} "
    f"{'in ratio':>8} {'out ratio':>9} {'x rt':>6} {'min/mean':>8} {'cpu c/s/w':>14} errors"
)


def _row(name: str, b: int, a: Rates, f: Rates) -> str:
    cpu = "/".join("-" if c is None else f"{c:.2f}" for c in f.cpu)
    err = f"{f.errors}" + (f" {sorted(f.error_codes)}" if f.error_codes else "")
    return (
        f"{name:<10} {b:>3} {a.input_fps:>10,.0f} {a.reply_fps:>11,.0f} {f.input_fps:>9,.0f} "
        f"{f.reply_fps:>9,.0f} {_ratio(f.input_fps, a.input_fps):>8} {_ratio(f.reply_fps, a.reply_fps):>9} "
        f"{f.input_fps / b / FRAMES_PER_S:>6.1f} {f.min_share:>8.2f} {cpu:>14} {err}"
    )


def _run_full_path(
    spec: ModelSpec, batches: list[int], args: argparse.Namespace, log: IO[str]
) -> dict[int, Rates]:
    """Start one worker and one session service for ``spec``, measure each B, stop them."""
    worker_args = [*spec.worker_flags]
    if args.torch_threads:
        worker_args += ["--torch-threads", str(args.torch_threads)]
    stack = LocalStack(
        workers=1,
        model=spec.name,
        plugin=spec.plugin,
        device=args.device,
        worker_args=worker_args,
        # Acks are held while more than this much of a session's audio waits unconsumed at the worker
        # (the default is 2 s): with a small bound an acknowledged frame is a consumed frame, give or
        # take the bound, so a short window is not inflated by the worker's input queues filling up.
        session_args=[*spec.session_flags, "--max-unconsumed-input-ms", str(args.max_unconsumed_ms)],
        log=log,
    )
    try:
        with stack:
            assert stack.session is not None
            pids = (None, stack.session.pid, stack.worker_children[0].pid)
            return {
                b: asyncio.run(
                    full_path(
                        stack.target,
                        spec,
                        b,
                        seconds=args.seconds,
                        warmup=args.warmup,
                        cycle=args.cycle,
                        window=args.window,
                        pids=pids,
                    )
                )
                for b in batches
            }
    except BaseException:
        log.seek(0)
        tail = log.read()[-4000:]
        if tail:
            sys.stderr.write(f"--- service logs ({spec.name}) ---\n{tail}\n")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
