"""Shared helpers of the worker tests: fixtures, an in-process server, a Run-stream client, a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import struct_pb2

from duplex.audio import PCM16K_MONO, encode, read_wav
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from session_service.workers.command_form import build_command
from tests.procs import spawn
from worker_service.config import WorkerConfig
from worker_service.server import WorkerServer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FRAME = 512
APPEND = worker_pb2.SUBMISSION_KIND_APPEND
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
STARTED = worker_pb2.VadEvent.KIND_SPEECH_STARTED
STOPPED = worker_pb2.VadEvent.KIND_SPEECH_STOPPED


def load_speech(name: str) -> np.ndarray:
    """A fixture as float32 mono at 16 kHz."""
    x, rate = read_wav(FIXTURES / name)
    assert rate == 16000
    return np.ascontiguousarray(x[:, 0], dtype=np.float32)


def pad_frames(x: np.ndarray, silence_s: float = 0.0) -> np.ndarray:
    """Append ``silence_s`` of zeros and pad to a whole number of frames."""
    x = np.concatenate([x, np.zeros(int(silence_s * 16000), np.float32)])
    return np.concatenate([x, np.zeros(-len(x) % FRAME, np.float32)])


def quantize(x: np.ndarray) -> np.ndarray:
    """What the worker sees of float audio sent as s16le."""
    return np.frombuffer(encode(x, PCM16K_MONO), dtype="<i2").astype(np.float32) / 32768.0


def pcm(x: np.ndarray) -> bytes:
    return encode(x, PCM16K_MONO)


def fence(session: str, epoch: int = 1, turn: int = 0) -> common_pb2.Fence:
    return common_pb2.Fence(session_id=session, epoch=epoch, turn_id=turn)


def sub(
    request_id: str,
    session: str,
    kind: int,
    *,
    epoch: int = 1,
    turn: int = 0,
    seq: int = 0,
    data: bytes = b"",
    params: dict[str, Any] | None = None,
) -> worker_pb2.Submission:
    s = worker_pb2.Submission(
        request_id=request_id,
        fence=fence(session, epoch, turn),
        kind=kind,
        seq=seq,
        pcm=data,  # type: ignore[arg-type]
    )
    if params is not None:
        st = struct_pb2.Struct()
        st.update(params)
        s.params.CopyFrom(st)
    return s


@contextlib.asynccontextmanager
async def worker(
    model_factory: Callable[..., Any] | None = None, **config: Any
) -> AsyncIterator[tuple[WorkerServer, worker_pb2_grpc.DuplexWorkerStub]]:
    """An in-process worker on an ephemeral port and a stub for it."""
    config.setdefault("metrics_port", -1)
    config.setdefault("drain_grace_s", 0.2)
    # No real-time admission unless asked for: the engine shares this process's GIL with the test.
    config.setdefault("max_tick_load", 0.0)
    server = WorkerServer(WorkerConfig(**config), model_factory=model_factory)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, worker_pb2_grpc.DuplexWorkerStub(channel)
    finally:
        await channel.close()
        await asyncio.wait_for(server.stop(grace=0.2), 15)


class RunClient:
    """One owner's Run stream: send commands, receive StepOutputs with timeouts."""

    def __init__(
        self,
        stub: worker_pb2_grpc.DuplexWorkerStub,
        owner: str,
        *,
        releases: tuple[worker_pb2.Release, ...] = (),
        columns: bool = False,
    ) -> None:
        """``releases``: carried by the stream's first command (with the owner); ``columns``:
        the stream asks for steps in columns (``WorkerCommand.step_columns``) and sends its
        APPENDs in columns (``AppendColumns``) as the session service does."""
        self.owner = owner
        self._frame_bytes = FRAME * 2 if columns else 0
        self._out: asyncio.Queue[worker_pb2.WorkerCommand | None] = asyncio.Queue()
        self._out.put_nowait(worker_pb2.WorkerCommand(owner=owner, release=releases, step_columns=columns))
        self.call = stub.Run(self._commands())
        self.received: list[worker_pb2.StepOutput] = []
        self.held: list[worker_pb2.StepOutput] = []
        """The stream's reconciliation lists (``held_sessions``), kept apart from the rest."""

    async def _commands(self) -> AsyncIterator[worker_pb2.WorkerCommand]:
        while True:
            cmd = await self._out.get()
            if cmd is None:
                return
            yield cmd

    def send(
        self,
        *submissions: worker_pb2.Submission,
        aborts: tuple[worker_pb2.Abort, ...] = (),
        releases: tuple[worker_pb2.Release, ...] = (),
    ) -> None:
        self._out.put_nowait(build_command(submissions, aborts, releases, frame_bytes=self._frame_bytes))

    async def recv(self, wait_s: float = 5.0) -> worker_pb2.StepOutput:
        """The next StepOutput; reconciliation lists (a new stream's ``held_sessions``) go to
        ``held`` instead."""
        deadline = time.monotonic() + wait_s
        while True:
            msg = await asyncio.wait_for(self.call.read(), max(0.01, deadline - time.monotonic()))
            assert msg is not grpc.aio.EOF, "Run stream ended"
            if msg.held_sessions:
                self.held.append(msg)
                continue
            self.received.append(msg)
            return msg

    async def held_list(self, wait_s: float = 5.0) -> list[tuple[str, int]]:
        """The stream's reconciliation list, as (session id, epoch) pairs: it comes first."""
        msg = await asyncio.wait_for(self.call.read(), wait_s)
        assert msg is not grpc.aio.EOF, "Run stream ended"
        assert msg.held_sessions, f"not a reconciliation list: {msg}"
        self.held.append(msg)
        return [(f.session_id, f.epoch) for f in msg.held_sessions]

    async def until(
        self, pred: Callable[[worker_pb2.StepOutput], bool], wait_s: float = 10.0
    ) -> list[worker_pb2.StepOutput]:
        """Receive until ``pred`` holds for a message; returns everything received on the way."""
        got: list[worker_pb2.StepOutput] = []
        deadline = time.monotonic() + wait_s
        while True:
            msg = await self.recv(max(0.01, deadline - time.monotonic()))
            got.append(msg)
            if pred(msg):
                return got

    async def quiet(self, seconds: float = 0.3) -> list[worker_pb2.StepOutput]:
        """Everything that arrives within ``seconds``."""
        got: list[worker_pb2.StepOutput] = []
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(await self.recv(seconds))
        return got

    def close(self) -> None:
        self.call.cancel()


async def wait_until(pred: Callable[[], bool], *, within: float = 10.0, every: float = 0.01) -> None:
    """Until ``pred()`` holds (checked every ``every`` s), for state with no event to await (a
    metric, a gauge); ``within`` is a backstop, not a timing claim."""
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110  (no event to await: polled state)
            await asyncio.sleep(every)


def updates_of(msgs: list[worker_pb2.StepOutput], request_id: str) -> list[worker_pb2.RequestUpdate]:
    return [u for m in msgs for u in m.updates if u.request_id == request_id]


def batch_ids(msg: worker_pb2.StepOutput) -> list[str]:
    """A step's requests in batch order, in either form (rows or columns)."""
    if msg.HasField("columns"):
        return list(msg.columns.request_id)
    return [e.request_id for e in msg.batch]


def acks_of(msgs: list[worker_pb2.StepOutput], request_id: str) -> list[int]:
    """The input a request's steps acknowledged (``input_seq``), in either form."""
    out: list[int] = []
    for m in msgs:
        if m.HasField("columns"):
            c = m.columns
            out += [
                seq for rid, seq in zip(c.request_id, c.input_seq, strict=True) if rid == request_id and seq
            ]
        out += [u.input_seq for u in m.updates if u.request_id == request_id and u.input_seq]
    return out


def audio_of(msgs: list[worker_pb2.StepOutput], request_id: str) -> bytes:
    out = b""
    for m in msgs:
        mm = m.outputs
        if mm.sparse_audio:
            out += b"".join(p.pcm for rid, p in zip(mm.req_id, mm.audio, strict=True) if rid == request_id)
        else:
            ids = batch_ids(m)
            out += b"".join(p.pcm for rid, p in zip(ids, mm.audio, strict=True) if rid == request_id)
    return out


def error_codes(msgs: list[worker_pb2.StepOutput], request_id: str) -> list[str]:
    return [u.error.code for u in updates_of(msgs, request_id) if u.error.code]


@contextlib.contextmanager
def worker_process(
    *args: str, timeout: float = 30.0
) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """``python -m duplex worker ARGS`` until its listening line; killed (by pid) on exit."""
    proc = spawn(["worker", "--listen", "127.0.0.1:0", "--metrics-port", "0", *args], stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            _, err = proc.communicate(timeout=5)
            raise AssertionError(f"worker did not print its listening line; stderr:\n{err}")
        info = json.loads(line)
        assert info["event"] == "listening", info
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
