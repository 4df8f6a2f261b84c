"""``duplex.v1.DuplexSession`` over gRPC: a thin adapter between the stream and the runners.

``Converse`` holds one session. Its first client event must be ``open`` or ``resume`` (anything
else is answered with a ``session_not_open`` error event). After that a reader task feeds the
session's mailbox while this handler writes the session's one outbound queue to the stream
(``context.write``). A dropped stream leaves the runner alive for a resume for the detached
grace; a half-closed stream closes the session. ``ConverseMany`` holds many sessions of one
caller on one stream (``session_service.api.lanes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from duplex.errors import BadRequestError, DuplexError, ErrorCode, FencedError, abort
from duplex.v1 import session_pb2, session_pb2_grpc
from session_service.api.calls import (
    MAX_REFUSED_BEFORE_OPEN,
    CallCut,
    close_if_current,
    half_closed,
    let_go,
    not_open_error,
    open_or_resume,
    read_messages,
    slow_consumer,
    unparsable,
    write_message,
)
from session_service.api.lanes import LaneStream
from session_service.metrics import ERRORS_BY_CODE, EVENTS_IN, STREAMS
from session_service.session.manager import SessionManager
from session_service.session.runner import SessionRunner
from session_service.trust.auth import PrincipalOf, anonymous

log = logging.getLogger(__name__)

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["DuplexSession"].full_name


class DuplexSessionServicer(session_pb2_grpc.DuplexSessionServicer):
    def __init__(
        self, manager: SessionManager, *, open_timeout_s: float, principal_of: PrincipalOf = anonymous
    ) -> None:
        self._manager = manager
        self._open_timeout_s = open_timeout_s
        self._principal_of = principal_of

    async def Converse(  # type: ignore[override]  # a coroutine writing with context.write
        self,
        request_iterator: AsyncIterator[session_pb2.ClientEvent],
        context: grpc.aio.ServicerContext[session_pb2.ClientEvent, session_pb2.ServerEvent],
    ) -> None:
        STREAMS.inc()
        try:
            await self._converse(request_iterator, context)
        finally:
            STREAMS.dec()

    async def _converse(
        self,
        request_iterator: AsyncIterator[session_pb2.ClientEvent],
        context: grpc.aio.ServicerContext[session_pb2.ClientEvent, session_pb2.ServerEvent],
    ) -> None:
        """The call, read with ``context.read()`` (see ``calls.read_messages``) and written with
        ``context.write()``: a write that waits for a client that stopped reading fails when the
        call ends (dropped, or cut off here as a slow consumer), and it fails here, where that
        is expected, not inside gRPC's handling of a response generator (which logs it as an
        error with a traceback)."""
        try:
            principal = self._principal_of(context)
        except DuplexError as err:
            await self._abort(context, err)
        del request_iterator  # read with context.read(): see calls.read_messages
        it = aiter(read_messages(context, session_pb2.ClientEvent))
        runner: SessionRunner | None = None
        acks_on_output = False
        refused = 0
        # One deadline for the whole stream: refused events do not extend it.
        deadline = asyncio.get_running_loop().time() + self._open_timeout_s
        while runner is None:
            try:
                async with asyncio.timeout_at(deadline):
                    ev = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await self._abort(
                    context, BadRequestError(ErrorCode.SESSION_NOT_OPEN, "no open or resume in time")
                )
            if ev is None:
                await self._abort(
                    context, BadRequestError(ErrorCode.INVALID_EVENT, unparsable("ClientEvent"))
                )
            kind = ev.WhichOneof("event")
            EVENTS_IN[kind or "none"].inc()
            try:
                runner, acks_on_output = await open_or_resume(self._manager, ev, principal=principal)
            except DuplexError as err:
                await self._abort(context, err)
            if runner is None:
                refused += 1
                if refused > MAX_REFUSED_BEFORE_OPEN:
                    await self._abort(
                        context,
                        BadRequestError(
                            ErrorCode.SESSION_NOT_OPEN,
                            f"no open or resume in the first {MAX_REFUSED_BEFORE_OPEN} events",
                        ),
                    )
                if not await write_message(context, not_open_error(ev.event_id, refused)):
                    return
        cut = CallCut(context)

        def on_slow_consumer() -> None:
            # From the runner, while this handler may be blocked writing to a client that does
            # not read: the call is aborted from another task, at once.
            cut(slow_consumer("the session"))

        def on_cut_off() -> None:
            # Displaced by a resume and still writing after the handover timeout.
            cut(FencedError(ErrorCode.FENCED, "the session was resumed on another stream"))

        attachment = runner.attach_stream(
            on_slow_consumer=on_slow_consumer, cut_off=on_cut_off, acks_on_output=acks_on_output
        )
        reader = asyncio.create_task(self._pump(it, runner, attachment, context))
        writing = False
        try:
            while True:
                out = await runner.outbound.get(attachment)
                if out is None:
                    break
                writing = True
                if not await cut.write(out):
                    break  # the call ended while the write waited
                writing = False
            await cut.wait()  # when cut: the call ends with the cut's status, not OK
        finally:
            if writing:  # not written (the call ended first): the stream that resumes gets it
                runner.outbound.unsent(attachment)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            let_go(runner, attachment)

    async def ConverseMany(  # type: ignore[override]  # a coroutine writing with context.write
        self,
        request_iterator: AsyncIterator[session_pb2.ClientBatch],
        context: grpc.aio.ServicerContext[session_pb2.ClientBatch, session_pb2.ServerBatch],
    ) -> None:
        """Many sessions of one caller on one stream (``session_service.api.lanes``)."""
        STREAMS.inc()
        try:
            try:
                principal = self._principal_of(context)
            except DuplexError as err:
                await self._abort(context, err)
            del request_iterator  # read with context.read(), as Converse
            stream = LaneStream(
                self._manager, context, principal=principal, open_timeout_s=self._open_timeout_s
            )
            await stream.run()
        finally:
            STREAMS.dec()

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        err: DuplexError,
    ) -> NoReturn:
        ERRORS_BY_CODE[err.code].inc()
        await abort(context, err)

    async def _pump(
        self,
        it: AsyncIterator[session_pb2.ClientEvent | None],
        runner: SessionRunner,
        attachment: int,
        context: grpc.aio.ServicerContext[session_pb2.ClientEvent, session_pb2.ServerEvent],
    ) -> None:
        try:
            async for ev in it:
                # Stamped on the runner's clock as it arrives; one that did not parse is an empty
                # event for the runner (invalid_event, and the session goes on).
                await runner.post(ev if ev is not None else session_pb2.ClientEvent())
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError):
            return  # dropped stream: the runner waits the detached grace for a resume
        except grpc.aio.AbortError:
            return  # the call was ended here (a slow consumer cut off) while a read waited
        except Exception:
            log.exception("session %s: reading the client stream failed", runner.session_id)
            return
        if await half_closed(context):
            await close_if_current(runner, attachment)
