"""What both client-facing calls (``Converse`` and ``ConverseMany``) do alike: read messages
that may not parse, write one that may find the call over, and start a session from its first
event."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from duplex.errors import ErrorCode
from duplex.v1 import session_pb2
from session_service.auth import ANONYMOUS
from session_service.runner import SessionRunner
from session_service.sessions import SessionManager

log = logging.getLogger(__name__)

#: How long a half-close must stand before it counts as "close" (a cancel looks alike at first).
HALF_CLOSE_GRACE_S = 0.05

#: Why a client message that gRPC could not parse is refused (``invalid_event``).
UNPARSABLE = "the client message is not a valid ClientEvent (malformed, or nested too deeply)"

#: Events a stream may send before its first open (each answered ``session_not_open``) before
#: the call is ended: a stream that never opens must not live on by sending junk.
MAX_REFUSED_BEFORE_OPEN = 8

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


def not_open_error(event_id: str, refused: int) -> session_pb2.ServerEvent:
    """The answer to an event sent before its session's open or resume."""
    return session_pb2.ServerEvent(
        event_id=f"pre_{refused}",
        error=session_pb2.Error(
            code=ErrorCode.SESSION_NOT_OPEN.value, message="open or resume a session first", event_id=event_id
        ),
    )
