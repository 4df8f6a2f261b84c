"""What both client-facing calls (``Converse`` and ``ConverseMany``) do alike: read messages
that may not parse, write one that may find the call over, end a call from another task, and
start a session from its first event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from duplex.errors import CapacityError, DuplexError, ErrorCode, abort
from duplex.v1 import session_pb2
from session_service.metrics import ERRORS_BY_CODE
from session_service.session.emitter import echoed_event_id
from session_service.session.manager import SessionManager
from session_service.session.runner import SessionRunner
from session_service.trust.auth import ANONYMOUS

log = logging.getLogger(__name__)

#: How long a half-close must stand before it counts as "close" (a cancel looks alike at first).
HALF_CLOSE_GRACE_S = 0.05


def unparsable(kind: str) -> str:
    """Why a client message that gRPC could not parse is refused (``invalid_event``); ``kind``
    names the message the call takes (``ClientEvent``, ``ClientBatch``)."""
    return f"the client message is not a valid {kind} (malformed, or nested too deeply)"


#: Events a stream may send before its first open (each answered ``session_not_open``) before
#: the call is ended: a stream that never opens must not live on by sending junk.
MAX_REFUSED_BEFORE_OPEN = 8

#: How long a cut call's handler waits for its abort to be sent (it is at once, unless the status
#: waits behind a message the client does not read).
ABORT_WAIT_S = 1.0

M = TypeVar("M", bound=Message)


async def write_message(
    context: grpc.aio.ServicerContext[Any, Any],
    message: Message,
    *,
    ended: Callable[[], bool] = lambda: False,
) -> bool:
    """Write one message; False when the call ended while the write waited: the client dropped
    it, or ``ended()``, it was aborted here. A failed write means the transport gave up on the
    call (gRPC may not have marked the context cancelled yet): a message already built always
    serializes."""
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not (ended() or context.cancelled() or context.done()):
            log.info("a write to a client failed (%s): the call is over", type(exc).__name__)
        return False
    return True


class CallCut:
    """Ends a call from any task with a ``DuplexError``'s status (a client cut off as a slow
    consumer, a displaced stream). Made in the call's handler, which writes through ``write``.

    The handler may then be waiting in a write to a client that does not read: a message larger
    than the client's receive window waits for it, and an abort does not end that wait. The cut
    stops the write (it cancels the handler while, and only while, it waits in one), so the call
    ends now and not when the client goes away."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context
        self._handler = asyncio.current_task()
        self._writing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def done(self) -> bool:
        """Whether the call was cut."""
        return self._task is not None

    def __call__(self, err: DuplexError) -> None:
        if self._task is not None:
            return
        ERRORS_BY_CODE[err.code].inc()
        self._task = asyncio.create_task(self._abort(err))
        if self._writing and self._handler is not None:
            self._handler.cancel()

    async def _abort(self, err: DuplexError) -> None:
        with contextlib.suppress(Exception):  # AbortError: the call is ended (or was already)
            await abort(self._context, err)

    async def write(self, message: Message) -> bool:
        """``write_message``; False also when the call was cut (before or during the write)."""
        if self._task is not None:
            return False
        self._writing = True
        try:
            return await write_message(self._context, message, ended=lambda: self._task is not None)
        except asyncio.CancelledError:
            if self._task is None or self._handler is None or not self._handler.cancelling():
                raise
            self._handler.uncancel()  # the cut's own cancel: the write is over, the handler goes on
            return False
        finally:
            self._writing = False

    async def wait(self) -> None:
        """Until the cut's abort is done (the call then ends with its status, not OK). An abort
        whose status waits behind a message the client does not read is given up after
        ``ABORT_WAIT_S``: the handler ends all the same."""
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=ABORT_WAIT_S)
            if not done:
                self._task.cancel()


async def read_messages(
    context: grpc.aio.ServicerContext[Any, Any], kind: type[M]
) -> AsyncIterator[M | None]:
    """The call's client messages, None for one gRPC could not parse (corrupt, nested too deep,
    invalid UTF-8). Read with ``context.read()``: a parse error would end the request iterator
    for good, while ``read`` goes on with the next message, so a bad message costs an error
    event, not the stream."""
    while True:
        try:
            msg = await context.read()
        except DecodeError:
            yield None
            continue
        if not isinstance(msg, kind):  # grpc.aio.EOF: the client half-closed
            return
        yield msg


async def open_or_resume(
    manager: SessionManager, ev: session_pb2.ClientEvent, *, principal: str = ANONYMOUS
) -> tuple[SessionRunner | None, bool]:
    """The session ``ev`` opens or resumes, and whether its stream reads acks carried on output;
    (None, False) for any other event. Raises the call-ending ``DuplexError`` of a bad open or
    resume."""
    kind = ev.WhichOneof("event")
    if kind == "open":
        return await manager.open(ev.open, principal=principal), ev.open.acks_on_output
    if kind == "resume":
        return await manager.resume(ev.resume, principal=principal), ev.resume.acks_on_output
    return None, False


def refusal(code: ErrorCode, message: str, event_id: str, refused: int) -> session_pb2.ServerEvent:
    """The ``error`` event (counted by code) that refuses a client event no session took: sent
    before its session's open or resume, or not usable at all. ``refused``: how many the call
    refused so far, this one included (the events are numbered ``pre_N``). The refused
    event's ``event_id`` is echoed bounded, as in every ``error`` (``echoed_event_id``)."""
    ERRORS_BY_CODE[code.value].inc()
    return session_pb2.ServerEvent(
        event_id=f"pre_{refused}",
        error=session_pb2.Error(code=code.value, message=message, event_id=echoed_event_id(event_id)),
    )


def not_open_error(event_id: str, refused: int) -> session_pb2.ServerEvent:
    """``refusal`` of an event sent before its session's open or resume."""
    return refusal(ErrorCode.SESSION_NOT_OPEN, "open or resume a session first", event_id, refused)


def slow_consumer(what: str) -> CapacityError:
    """How a call whose client did not read its events in time ends; ``what`` was closed."""
    return CapacityError(
        ErrorCode.SLOW_CONSUMER,
        f"the client did not read its events in time; {what} is closed",
        retryable=False,
    )


async def half_closed(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether the client half-closed the call, once its requests ended. A cancelled RPC also
    ends them, a moment before the cancellation is visible: wait ``HALF_CLOSE_GRACE_S`` so a
    dropped stream is not mistaken for a half-close (which closes the session)."""
    await asyncio.sleep(HALF_CLOSE_GRACE_S)
    return not (context.cancelled() or context.done())


async def close_if_current(runner: SessionRunner, attachment: int) -> None:
    """Close the session of a stream the client half-closed, unless a resume took it over."""
    if runner.outbound.current_attachment == attachment:
        await runner.post(session_pb2.ClientEvent(close=session_pb2.SessionClose()))


def let_go(runner: SessionRunner, attachment: int) -> None:
    """The stream holding ``attachment`` is over: it writes nothing more, and a session it still
    held (it ended without close: dropped, cancelled, cut off) waits the detached grace for a
    resume, then releases what it holds."""
    runner.outbound.detached(attachment)
    if runner.outbound.current_attachment == attachment:
        runner.detach()
