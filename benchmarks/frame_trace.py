"""The path one input frame takes: from a client's append to the reply audio it clocks out.

Runs a parrot worker and a session service in this process, opens a session, talks until the
reply streams (parrot is lockstep: each input frame clocks one reply frame out), then sends ONE
more 32 ms append and records every function of the project that runs, on any thread, until
the reply frame it produced (and its ack) reach the client. Prints them in order of first call,
grouped by module, with the counts a maintainer cares about: functions, modules, and the
hand-offs between tasks and threads the frame crosses.

    python -m benchmarks.frame_trace
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

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
FRAME_BYTES = 512 * 2

#: Where work crosses from one task or thread to another: (module, function) of the side that
#: takes it over. Counted when the traced path runs them.
HANDOFFS = {
    (
        "session_service/session/runner.py",
        "SessionRunner._next_item",
    ): "client event -> the session's mailbox task",
    ("session_service/workers/link.py", "WorkerLink._send_loop"): "submission -> the link's sender task",
    ("worker_service/servicer.py", "DuplexWorkerServicer._read"): "gRPC: session service -> worker",
    ("worker_service/engine.py", "Engine._iterate"): "command -> the engine thread",
    ("worker_service/delivery.py", "OutputHub.deliver"): "step result -> the event loop",
    ("worker_service/servicer.py", "DuplexWorkerServicer.Run"): "owner channel -> the Run stream",
    ("session_service/workers/link.py", "WorkerLink._read_loop"): "gRPC: worker -> session service",
    (
        "session_service/api/servicer.py",
        "DuplexSessionServicer.Converse",
    ): "outbound queue -> the client stream",
}


class Recorder:
    """A profile hook that keeps the project's functions in order of first call, while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.armed:
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(ROOT)):
            return
        rel = Path(path).relative_to(ROOT).as_posix()
        if not rel.startswith(PACKAGES) or rel.startswith("duplex/v1/"):
            return
        key = (rel, frame.f_code.co_qualname)
        with self._lock:
            self.seen[key] = self.seen.get(key, 0) + 1


async def _conversation(
    stub: DuplexSessionAsyncStub, out: asyncio.Queue[session_pb2.ClientEvent | None]
) -> AsyncIterator[session_pb2.ServerEvent]:
    async def requests() -> AsyncIterator[session_pb2.ClientEvent]:
        while (ev := await out.get()) is not None:
            yield ev

    async for ev in stub.Converse(requests()):
        yield ev


async def trace() -> Recorder:
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
    speech = encode(resample(to_mono(x), rate, 16000), PCM16K_MONO) + b"\0\0" * 16000
    try:
        async with grpc.aio.insecure_channel(session.address) as channel:
            stub = session_pb2_grpc.DuplexSessionStub(channel)
            out: asyncio.Queue[session_pb2.ClientEvent | None] = asyncio.Queue()
            cfg = session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto())
            out.put_nowait(session_pb2.ClientEvent(open=session_pb2.SessionOpen(model="parrot", config=cfg)))
            events = _conversation(stub, out)
            seq = 0
            for i in range(0, len(speech), FRAME_BYTES):
                seq += 1
                out.put_nowait(
                    session_pb2.ClientEvent(
                        append=session_pb2.InputAudioAppend(seq=seq, pcm=speech[i : i + FRAME_BYTES])
                    )
                )
            async for ev in events:  # until the reply streams and the input is all consumed
                if ev.HasField("input_ack") and ev.input_ack.seq == seq:
                    break
            await asyncio.sleep(0.5)  # everything queued is stepped; the reply waits for input
            recorder.armed = True
            seq += 1
            out.put_nowait(
                session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=seq, pcm=b"\1\0" * 512))
            )
            acked = audio = False
            async for ev in events:
                acked = acked or (ev.HasField("input_ack") and ev.input_ack.seq == seq)
                audio = audio or ev.HasField("audio_delta")
                if acked and audio:
                    break
            recorder.armed = False
            out.put_nowait(None)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None turns it off
        await session.stop()
        await worker.stop()
    return recorder


def main() -> int:
    recorder = asyncio.run(trace())
    modules: dict[str, list[str]] = {}
    for (module, func), _ in recorder.seen.items():
        modules.setdefault(module, []).append(func)
    handoffs = [why for key, why in HANDOFFS.items() if key in recorder.seen]
    named = sum(1 for _, func in recorder.seen if "<" not in func)  # not comprehensions, lambdas
    print(
        f"one input frame, append to reply audio: {len(recorder.seen)} functions "
        f"({named} named) in {len(modules)} modules"
    )
    for module, funcs in modules.items():
        print(f"  {module}")
        for func in funcs:
            print(f"      {func}")
    print(f"hand-offs between tasks, threads and processes: {len(handoffs)}")
    for why in handoffs:
        print(f"  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
