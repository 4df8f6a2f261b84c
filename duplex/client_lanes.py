"""Many sessions of one client on ONE ``ConverseMany`` stream ("lanes"), for the Python client.

A backend that holds many conversations pays gRPC's per-message cost once per message, not once
per event: ``Lanes`` writes the events that all its sessions sent meanwhile as one
``ClientBatch`` (while one message is being written, the next one fills), and hands each
output of a ``ServerBatch`` to its session. Each session is the same ``duplex.client.Session``
as on its own ``Converse`` call (``events()``, ``send_audio``, ``close``...)::

    async with DuplexClient(target, token=...) as client, Lanes(client) as lanes:
        a = await lanes.open_session(model="parrot")
        b = await lanes.open_session(model="parrot")

What differs from a ``Converse`` call per session:

- A lane ends with the status its ``Converse`` call would have had (``LaneEnded``); the other
  lanes go on. A bad open raises the same typed error.
- The stream is the sessions' one transport: if it fails, every session on it fails with its
  error; ``Lanes.close()`` half-closes it, which closes every session on it.
- A session that is sent ``go_away`` resumes on a ``Converse`` call of its own
  (``Session.reconnect``); ``DuplexClient.resume`` resumes a lane's session the same way.
- ``Session.close()`` closes the session; cancelling a session's call (after ``close`` timed
  out) only stops reading its lane here: the session is let go when the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from types import TracebackType
from typing import Any, Self

import grpc

from duplex.client import SESSION_CLOSED, DuplexClient, Session, SessionClosedError
from duplex.errors import error_for, from_rpc_error, to_rpc_status
from duplex.v1 import session_pb2

log = logging.getLogger("duplex.client")

#: Size a client message is cut at: the service takes messages of up to 320 KiB.
MAX_BATCH_BYTES = 256 * 1024

_EOF = object()
_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


class _LaneCall:
    """One lane, as a ``Session`` sees its call (``duplex.client.EventCall``)."""

    def __init__(self, lanes: Lanes, name: str) -> None:
        self._lanes = lanes
        self.name = name
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._over = False
        self._status = grpc.StatusCode.OK
        self._details = ""
        self._trailing: Any = ()
        self._error: grpc.aio.AioRpcError | None = None
        """Raised by reads once the lane is over: the stream failed, or this lane was cancelled."""

    async def read(self) -> object:
        item = await self._queue.get()
        if item is _EOF:
            self._queue.put_nowait(_EOF)  # every later read ends too
            if self._error is not None:
                raise self._error
            return grpc.aio.EOF
        return item

    async def write(self, request: session_pb2.ClientEvent) -> None:
        if self._over:
            raise asyncio.InvalidStateError("the lane has ended")  # as a call that ended does
        await self._lanes._send(self.name, request)

    async def done_writing(self) -> None:
        """Nothing to do: a lane ends with its session (``close``), or with the stream."""

    def cancel(self) -> bool:
        if self._over:
            return False
        self._lanes._forget(self.name)
        self._fail(_rpc_error(grpc.StatusCode.CANCELLED, "the lane was cancelled here"))
        return True

    async def code(self) -> grpc.StatusCode:
        return self._status

    async def details(self) -> str:
        return self._details

    async def trailing_metadata(self) -> Any:
        return self._trailing

    def _put(self, event: session_pb2.ServerEvent) -> None:
        self._queue.put_nowait(event)

    def _end(self, ended: session_pb2.LaneEnded) -> None:
        """The server ended the lane: with the status, code and message its ``Converse`` call
        would have had (the same trailers, so the same typed error)."""
        if self._over:
            return
        self._over = True
        if ended.status:
            status = _STATUS_BY_VALUE.get(ended.status, grpc.StatusCode.UNKNOWN)
            rpc = to_rpc_status(error_for(status, ended.code, ended.message, ended.retryable))
            self._status, self._details, self._trailing = status, rpc.details, rpc.trailing_metadata
        self._queue.put_nowait(_EOF)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._over:
            return
        self._over = True
        self._error = error
        self._status, self._details = error.code(), error.details() or ""
        self._trailing = error.trailing_metadata()
        self._queue.put_nowait(_EOF)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Lanes:
    """One ``ConverseMany`` stream of ``client``'s, holding sessions opened or resumed on it."""

    def __init__(self, client: DuplexClient) -> None:
        self._client = client
        self._call: Any = None
        self._lanes: dict[str, _LaneCall] = {}
        self._names = itertools.count(1)
        self._pending: list[tuple[str, session_pb2.ClientEvent, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._failure: grpc.aio.AioRpcError | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.messages_sent = 0
        """``ClientBatch`` messages written so far."""
        self.events_sent = 0
        """Client events written so far, all sessions together."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def usable(self) -> bool:
        """Whether new sessions can still be opened on this stream (it has neither failed nor
        been closed)."""
        return self._failure is None and not self._closing

    # ---- sessions ----------------------------------------------------------------------------

    async def open_session(
        self,
        *,
        raise_on_error: bool = False,
        auto_resume: bool = True,
        timeout_s: float = 15.0,
        **config: Any,
    ) -> Session:
        """``DuplexClient.open_session`` on a lane of this stream (``config``: the settings
        ``DuplexClient.open_event`` takes)."""
        return await self._start(self._client.open_event(**config), raise_on_error, auto_resume, timeout_s)

    async def resume(
        self,
        session_id: str,
        token: str,
        *,
        raise_on_error: bool = False,
        auto_resume: bool = True,
        timeout_s: float = 15.0,
    ) -> Session:
        """``DuplexClient.resume`` on a lane of this stream (a session of any stream of the
        same caller, ``Converse`` or lanes)."""
        first = self._client.resume_event(session_id, token)
        return await self._start(first, raise_on_error, auto_resume, timeout_s)

    async def _start(
        self, first: session_pb2.ClientEvent, raise_on_error: bool, auto_resume: bool, timeout_s: float
    ) -> Session:
        if self._failure is not None:
            raise from_rpc_error(self._failure)
        if self._closing:
            raise SessionClosedError(SESSION_CLOSED, "the lanes' stream is closing")
        self._ensure_stream()
        name = str(next(self._names))
        lane = self._lanes[name] = _LaneCall(self, name)
        call, opened = await self._client._start(first, timeout_s, call=lane)
        return Session(self._client, call, opened, raise_on_error=raise_on_error, auto_resume=auto_resume)

    def _forget(self, name: str) -> None:
        """Outputs of lane ``name`` are dropped from now on (its session no longer reads them)."""
        self._lanes.pop(name, None)

    # ---- the stream --------------------------------------------------------------------------

    def _ensure_stream(self) -> None:
        if self._call is None:
            stub = self._client._ensure_channel()
            self._call = stub.ConverseMany(metadata=self._client.metadata())
            self._tasks = [
                asyncio.create_task(self._write_loop(), name="duplex-lanes-writer"),
                asyncio.create_task(self._read_loop(), name="duplex-lanes-reader"),
            ]

    async def _send(self, name: str, event: session_pb2.ClientEvent) -> None:
        """Queue ``event`` for the next message; returns once that message is written."""
        if self._failure is not None:
            raise self._failure
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((name, event, done))
        self._wake.set()
        await done

    async def _write_loop(self) -> None:
        """Every event queued while the last message was written goes in the next one (cut
        near ``MAX_BATCH_BYTES``); a half-close once nothing is left to write."""
        try:
            while self._failure is None:
                if not self._pending:
                    if self._closing:
                        await self._call.done_writing()
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                pending, self._pending = self._pending, []
                batch, size = session_pb2.ClientBatch(), 0
                waiting: list[asyncio.Future[None]] = []
                for name, event, done in pending:
                    n = event.ByteSize() + len(name) + 8
                    if size and size + n > MAX_BATCH_BYTES:
                        await self._write(batch, waiting)
                        batch, waiting, size = session_pb2.ClientBatch(), [], 0
                    batch.events.add(lane=name, event=event)
                    waiting.append(done)
                    size += n
                await self._write(batch, waiting)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            failure = exc if isinstance(exc, grpc.aio.AioRpcError) else None
            self._stream_over(failure or _rpc_error(grpc.StatusCode.UNAVAILABLE, "the stream ended"))

    async def _write(self, batch: session_pb2.ClientBatch, waiting: list[asyncio.Future[None]]) -> None:
        try:
            await self._call.write(batch)
        except BaseException as exc:
            error = exc if isinstance(exc, grpc.aio.AioRpcError) else asyncio.InvalidStateError()
            for done in waiting:
                if not done.done():
                    done.set_exception(error)
            raise
        self.messages_sent += 1
        self.events_sent += len(waiting)
        for done in waiting:
            if not done.done():
                done.set_result(None)

    async def _read_loop(self) -> None:
        failure: grpc.aio.AioRpcError | None = None
        try:
            async for batch in self._call:
                for out in batch.outputs:
                    lane = self._lanes.get(out.lane)
                    if lane is None:
                        if out.HasField("event") and out.event.HasField("error"):
                            err = out.event.error
                            log.warning("the lanes' stream: %s: %s", err.code, err.message)
                        continue
                    if out.HasField("ended"):
                        del self._lanes[out.lane]
                        lane._end(out.ended)
                    else:
                        lane._put(out.event)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        self._stream_over(failure)

    def _stream_over(self, failure: grpc.aio.AioRpcError | None) -> None:
        """The stream ended: every lane still held ends with it (OK after a half-close: the
        server ended them all first)."""
        if failure is not None and self._failure is None:
            self._failure = failure
        for _, _, done in self._pending:
            if not done.done():
                done.set_exception(self._failure or asyncio.InvalidStateError())
        self._pending.clear()
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            if self._failure is not None:
                lane._fail(self._failure)
            else:
                lane._end(session_pb2.LaneEnded())

    async def close(self, timeout_s: float = 5.0) -> None:
        """Half-close the stream (every session on it is closed, and ends), and wait for its end;
        cancel it after ``timeout_s``. Idempotent."""
        self._closing = True
        self._wake.set()
        if not self._tasks:
            return
        done, _ = await asyncio.wait(self._tasks, timeout=timeout_s)
        if len(done) < len(self._tasks):
            self.cancel()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def cancel(self) -> None:
        """Drop the stream: every session on it is detached (a resume finds it for the server's
        detached grace), and fails here with ``CANCELLED``."""
        self._closing = True
        if self._call is not None:
            self._call.cancel()
        self._stream_over(_rpc_error(grpc.StatusCode.CANCELLED, "the lanes' stream was cancelled here"))
        self._wake.set()  # the writer ends


__all__ = ["MAX_BATCH_BYTES", "Lanes"]
