"""The path one input frame takes: from a client's append to the reply audio it clocks out.

Runs a parrot worker and a session service in this process, opens a session, talks until the
reply streams (parrot is lockstep: each input frame clocks one reply frame out), then sends ONE
more append -- 20 ms by default, what real clients send -- and records every function of the
project that runs, on any thread, until the reply frame it produced (and its ack) reach the
client. The talk before it is sent in appends of the same size and leaves just enough audio
held back at the session service that the traced append completes one worker frame (32 ms)
exactly: the one the reply frame answers.

It prints the functions in order of first call, grouped by module, and the hand-offs it
observed, each in order: every time the project's code goes on in another thread (a thread
hand-off) or, on one thread, in another asyncio task or a plain event-loop callback (a task
hand-off), with the function that took over and the wake-ups the side that let go had issued
since the last hand-off (a queue's put, an Event or Condition, ``call_soon_threadsafe``, a
future's result: the queue hand-offs, counted too). Client, session service and worker share
this process's event loop, so a gRPC message between them shows as a task hand-off. The count
is what one run observed: unrelated work that runs meanwhile (a timer) adds its own.

    python -m benchmarks.frame_trace [--append-ms 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from benchmarks._sys import NoMeasurement, fail, write_result
from duplex.audio import PCM16K_MONO, encode, read_wav, resample, to_mono
from duplex.stack import example_path
from duplex.v1 import session_pb2, session_pb2_grpc
from session_service.api.server import SessionServer
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import load_plugin
from worker_service.config import WorkerConfig
from worker_service.server import WorkerServer

if TYPE_CHECKING:
    from duplex.v1.session_pb2_grpc import DuplexSessionAsyncStub

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("duplex", "session_service", "worker_service")
RATE = 16000
"""Input and worker sample rate (``PCM16K_MONO``: 2 bytes a sample)."""
WORKER_FRAME = 512
"""Samples in one worker frame (32 ms): the parrot steps, and replies, one at a time."""
TIMEOUT_S = 60.0
"""The conversation that sets the frame up, and the frame itself, fail the trace past this."""

#: Python-level wake-ups, by (file, function): the side that hands work on to another task or
#: thread. Counted when the project's code calls them directly.
WAKEUPS_PY = {
    ("asyncio/queues.py", "Queue.put_nowait"): "asyncio.Queue.put_nowait",
    ("asyncio/queues.py", "Queue.put"): "asyncio.Queue.put",
    ("asyncio/locks.py", "Event.set"): "asyncio.Event.set",
    ("asyncio/locks.py", "Condition.notify"): "asyncio.Condition.notify",
    ("asyncio/locks.py", "Condition.notify_all"): "asyncio.Condition.notify_all",
    ("asyncio/base_events.py", "BaseEventLoop.call_soon_threadsafe"): "loop.call_soon_threadsafe",
    ("queue.py", "Queue.put"): "queue.Queue.put",
    ("queue.py", "Queue.put_nowait"): "queue.Queue.put_nowait",
    ("threading.py", "Condition.notify"): "threading.Condition.notify",
    ("threading.py", "Condition.notify_all"): "threading.Condition.notify_all",
    ("threading.py", "Event.set"): "threading.Event.set",
}
#: The same in C (``c_call`` events), by the builtin's qualified name.
WAKEUPS_C = {
    "Future.set_result": "Future.set_result",
    "Future.set_exception": "Future.set_exception",
    "SimpleQueue.put": "queue.SimpleQueue.put",
    "SimpleQueue.put_nowait": "queue.SimpleQueue.put_nowait",
    "Loop.call_soon_threadsafe": "loop.call_soon_threadsafe",  # uvloop
}


Where = tuple[int, int]
"""Where code runs: (thread ident, ``id`` of the asyncio task or 0 outside one)."""


@dataclass
class Handoff:
    """The project's code went on somewhere else."""

    kind: str
    """``thread`` (another OS thread) or ``task`` (the same thread, another asyncio task or a
    plain event-loop callback)."""
    source: Where
    target: Where
    function: str
    """The first function of the project that ran there (``module:qualname``)."""
    via: list[str] = field(default_factory=list)
    """The wake-ups the side that let go issued since the previous hand-off."""


@dataclass
class Place:
    """What a ``Where`` was, for its name."""

    thread: str
    task: str | None
    """The task's coroutine (None: a loop callback, or a thread with no event loop)."""
    loop: bool
    project_task: bool
    """The task's coroutine is the project's own (else gRPC's or asyncio's, around it)."""
    first: str = ""
    """The first named function of the project seen running there."""

    def name(self) -> str:
        if not self.loop:
            return f"thread {self.thread}"
        if self.task is None:
            return f"{self.thread}: loop callback"
        if self.project_task or not self.first:
            return f"{self.thread}: task {self.task}"
        return f"{self.thread}: task {self.first} (in {self.task})"


def _rel(path: str, packages: tuple[str, ...] = PACKAGES) -> str | None:
    """A file of ``packages`` (the project's) relative to the repository, else None."""
    if not path.startswith(str(ROOT)):
        return None
    rel = Path(path).relative_to(ROOT).as_posix()
    if not rel.startswith(packages) or rel.startswith("duplex/v1/"):
        return None
    return rel


def _stdlib_key(path: str, qualname: str) -> tuple[str, str]:
    """``(.../asyncio/queues.py, Queue.put)`` -> ``(asyncio/queues.py, Queue.put)``."""
    parts = Path(path).parts
    return "/".join(parts[-2:]) if len(parts) > 1 and parts[-2] == "asyncio" else parts[-1], qualname


class Recorder:
    """A profile hook that, while armed, keeps the project's functions in order of first call
    and every hand-off between threads, tasks and loop callbacks it sees them make."""

    def __init__(self, packages: tuple[str, ...] = PACKAGES) -> None:
        self.packages = packages
        """Paths (from the repository's root) of the code whose calls are recorded."""
        self.armed = False
        self.seen: dict[tuple[str, str], int] = {}
        self.handoffs: list[Handoff] = []
        self.wakeups: list[str] = []
        self.places: dict[Where, Place] = {}
        self._pending: list[str] = []
        self._where: Where | None = None
        self._lock = threading.Lock()

    def _context(self) -> Where:
        """Where the running code is (its ``Place`` noted the first time)."""
        thread = threading.current_thread()
        loop = asyncio._get_running_loop()
        task = asyncio.current_task(loop) if loop is not None else None
        where = (thread.ident or 0, id(task) if task is not None else 0)
        if where not in self.places:
            if task is None:
                self.places[where] = Place(thread.name, None, loop is not None, False)
            else:
                coro = task.get_coro()
                code = getattr(coro, "cr_code", None)
                self.places[where] = Place(
                    thread.name,
                    getattr(coro, "__qualname__", type(coro).__name__),
                    True,
                    code is not None and _rel(code.co_filename, self.packages) is not None,
                )
        return where

    def name(self, where: Where) -> str:
        return self.places[where].name()

    def _wakeup(self, what: str, caller: types.FrameType | None) -> None:
        rel = _rel(caller.f_code.co_filename, self.packages) if caller is not None else None
        if rel is None or caller is None:
            return  # not the project's own hand-off (asyncio's, gRPC's internals)
        note = f"{what} in {rel}:{caller.f_code.co_qualname}"
        with self._lock:
            self.wakeups.append(note)
            self._pending.append(note)

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.armed:
            return
        if event == "c_call":
            what = WAKEUPS_C.get(getattr(arg, "__qualname__", ""))
            if what is not None:
                self._wakeup(what, frame)
            return
        if event != "call":
            return
        code = frame.f_code
        rel = _rel(code.co_filename, self.packages)
        if rel is None:
            what = WAKEUPS_PY.get(_stdlib_key(code.co_filename, code.co_qualname))
            if what is not None:
                self._wakeup(what, frame.f_back)
            return
        key = (rel, code.co_qualname)
        with self._lock:
            where = self._context()
            place = self.places[where]
            if not place.first and "<" not in code.co_qualname:  # a task's resumed chain, outside in
                place.first = code.co_qualname
            self.seen[key] = self.seen.get(key, 0) + 1
            if self._where is not None and where != self._where:
                kind = "thread" if where[0] != self._where[0] else "task"
                self.handoffs.append(Handoff(kind, self._where, where, f"{rel}:{code.co_qualname}"))
                self.handoffs[-1].via, self._pending = self._pending, []
            self._where = where


@dataclass
class Trace:
    """What one traced append ran through."""

    append_ms: float
    worker_frames: int
    """Worker frames the traced append completed (the reply frames it clocks out)."""
    recorder: Recorder
    seconds: float
    """From the traced append to its ack and reply audio at the client (with the hook's cost)."""


async def _conversation(
    stub: DuplexSessionAsyncStub, out: asyncio.Queue[session_pb2.ClientEvent | None]
) -> AsyncIterator[session_pb2.ServerEvent]:
    async def requests() -> AsyncIterator[session_pb2.ClientEvent]:
        while (ev := await out.get()) is not None:
            yield ev

    async for ev in stub.Converse(requests()):
        yield ev


def priming(speech: bytes, append_samples: int) -> list[bytes]:
    """``speech`` cut into appends of ``append_samples``, then silence so that what the session
    service holds back (short of a worker frame) plus the traced append is one worker frame
    exactly (a traced append of a frame or more finds nothing held back)."""
    chunks = [speech[i : i + 2 * append_samples] for i in range(0, len(speech), 2 * append_samples)]
    held = (len(speech) // 2) % WORKER_FRAME
    want = WORKER_FRAME - append_samples if append_samples < WORKER_FRAME else 0
    pad = (want - held) % WORKER_FRAME
    if pad:
        chunks.append(b"\0\0" * pad)
    return chunks


async def trace(append_ms: float = 20.0) -> Trace:
    append_samples = round(append_ms * RATE / 1000)
    if append_samples < 1:
        raise ValueError("--append-ms must be at least one sample")
    recorder = Recorder()
    threading.setprofile(recorder)  # threads started from now on (the engine, gRPC's)
    sys.setprofile(recorder)
    worker = WorkerServer(WorkerConfig(model="parrot", device="cpu", metrics_port=-1, torch_threads=1))
    await worker.start()
    session = SessionServer(
        ServiceConfig(
            plugin="parrot",
            workers=(worker.address,),
            listen="127.0.0.1:0",
            metrics_port=-1,
            replica_id="trace",
            # Only the traced append may clock a reply frame out.
            runner=RunnerConfig(silence_continuation=False),
        ),
        load_plugin("session_service.plugins.parrot:ParrotPlugin"),
    )
    await session.start()
    await session.wait_ready(10)
    x, rate = read_wav(example_path("hello.wav"))
    speech = encode(resample(to_mono(x), rate, RATE), PCM16K_MONO) + b"\0\0" * RATE
    chunks = priming(speech, append_samples)
    held = (sum(len(c) for c in chunks) // 2) % WORKER_FRAME
    try:
        async with grpc.aio.insecure_channel(session.address) as channel:
            stub = session_pb2_grpc.DuplexSessionStub(channel)
            out: asyncio.Queue[session_pb2.ClientEvent | None] = asyncio.Queue()
            cfg = session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto())
            out.put_nowait(session_pb2.ClientEvent(open=session_pb2.SessionOpen(model="parrot", config=cfg)))
            events = _conversation(stub, out)
            seq = 0
            for chunk in chunks:
                seq += 1
                out.put_nowait(
                    session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=seq, pcm=chunk))
                )

            async def talked() -> None:
                async for ev in events:  # until the reply streams and the input is all consumed
                    if ev.HasField("input_ack") and ev.input_ack.seq == seq:
                        return
                raise NoMeasurement("the session ended before its input was acknowledged")

            try:
                await asyncio.wait_for(talked(), TIMEOUT_S)
            except TimeoutError as exc:
                raise NoMeasurement(
                    f"the talk before the traced append was not acknowledged in {TIMEOUT_S:g} s"
                ) from exc
            await asyncio.sleep(0.5)  # everything queued is stepped; the reply waits for input
            recorder.armed = True
            t0 = time.perf_counter()
            seq += 1
            out.put_nowait(
                session_pb2.ClientEvent(
                    append=session_pb2.InputAudioAppend(seq=seq, pcm=b"\1\0" * append_samples)
                )
            )

            async def answered() -> None:
                acked = audio = False
                async for ev in events:
                    acked = acked or (ev.HasField("input_ack") and ev.input_ack.seq == seq)
                    audio = audio or ev.HasField("audio_delta")
                    if acked and audio:
                        return
                raise NoMeasurement("the session ended before the traced append was answered")

            try:
                await asyncio.wait_for(answered(), TIMEOUT_S)
            except TimeoutError as exc:
                raise NoMeasurement(
                    f"the traced append had no ack and reply audio in {TIMEOUT_S:g} s"
                ) from exc
            finally:
                recorder.armed = False
            seconds = time.perf_counter() - t0
            out.put_nowait(None)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # None turns it off
        await session.stop()
        await worker.stop()
    return Trace(append_ms, (held + append_samples) // WORKER_FRAME, recorder, seconds)


def summary(t: Trace) -> dict[str, Any]:
    """The trace as numbers and lists (``--json``; what ``main`` prints)."""
    rec = t.recorder
    modules: dict[str, list[str]] = {}
    for module, func in rec.seen:
        modules.setdefault(module, []).append(func)
    return {
        "append_ms": t.append_ms,
        "worker_frames": t.worker_frames,
        "seconds": round(t.seconds, 4),
        "functions": len(rec.seen),
        "named_functions": sum(1 for _, func in rec.seen if "<" not in func),  # no lambdas
        "modules": modules,
        "handoffs": len(rec.handoffs),
        "thread_handoffs": sum(1 for h in rec.handoffs if h.kind == "thread"),
        "task_handoffs": sum(1 for h in rec.handoffs if h.kind == "task"),
        "queue_handoffs": len(rec.wakeups),
        "path": [
            {
                "kind": h.kind,
                "from": rec.name(h.source),
                "to": rec.name(h.target),
                "function": h.function,
                "via": list(h.via),
            }
            for h in rec.handoffs
        ],
        "wakeups": list(rec.wakeups),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--append-ms",
        type=float,
        default=20.0,
        help="the traced append's length, as clients send it (default: %(default)g)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the trace as JSON")
    args = p.parse_args(argv)
    try:
        t = asyncio.run(trace(args.append_ms))
    except NoMeasurement as exc:
        return fail(str(exc))
    s = summary(t)
    print(
        f"one {t.append_ms:g} ms append ({t.worker_frames} worker frame(s) completed), append to "
        f"reply audio: {s['functions']} functions ({s['named_functions']} named) "
        f"in {len(s['modules'])} modules, {1000 * t.seconds:.1f} ms traced"
    )
    for module, funcs in s["modules"].items():
        print(f"  {module}")
        for func in funcs:
            print(f"      {func}")
    print(
        f"hand-offs observed: {s['handoffs']} ({s['thread_handoffs']} between threads, "
        f"{s['task_handoffs']} between tasks and loop callbacks); "
        f"queue hand-offs (wake-ups the project issued): {s['queue_handoffs']}"
    )
    for i, h in enumerate(s["path"], 1):
        print(f"  {i:2}. {h['kind']:<6} {h['from']}  ->  {h['to']}: {h['function']}")
        for note in h["via"]:
            print(f"            after {note}")
    write_result(args.json, "frame_trace", s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
