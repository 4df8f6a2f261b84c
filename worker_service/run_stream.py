"""One owner's ``Run`` stream: opening it, reconciling, reading its commands, writing its output.

A new stream first lists what the worker holds for its owner (``StepOutput.held_sessions``),
which the owner reconciles by releasing what it no longer has; the stream's first command is
applied before that list is converted, so a session it releases is not listed. Commands are
read by a task of their own and applied in order (``commands.CommandHandler.handle``); the
engine's results reach the stream through the owner's channel (``delivery``) and are converted
on the way out (``outputs.to_proto``). Each command is followed on the engine by a
``CommandMark`` (the stream's count of commands), so each step can tell the owner how many of
its commands it had applied (``StepOutput.commands_applied``). When the owner's last stream
ends, its orphan reap starts (``sessions.SessionTable.owner_left``).

Output is written with ``context.write()``: a write that waits for an owner that stopped reading
fails when the stream is dropped, and it fails here, where that is expected, not inside gRPC's
handling of a response generator (which logs it as an error with a traceback).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from duplex.errors import BadRequestError, DuplexError, ErrorCode
from duplex.v1 import worker_pb2
from worker_service.commands import CommandHandler, check_id_length
from worker_service.delivery import OutputHub, OwnerChannel
from worker_service.engine_types import CommandMark, OwnerStep
from worker_service.identity import IdentityPolicy
from worker_service.outputs import to_proto
from worker_service.sessions import SessionTable

logger = logging.getLogger(__name__)

#: Most sessions listed in one reconciliation StepOutput (a longer list is split): each entry is
#: a fence of at most ~140 bytes, so one message stays far below the 16 MiB message limit.
HELD_PER_MESSAGE = 4096

_Context = grpc.aio.ServicerContext[Any, Any]

_STREAM_NUMBERS = itertools.count(1)


class RunStreams:
    """Opens the owners' Run streams."""

    def __init__(
        self, hub: OutputHub, sessions: SessionTable, commands: CommandHandler, identity: IdentityPolicy
    ) -> None:
        self._hub = hub
        self._sessions = sessions
        self._commands = commands
        self._identity = identity

    def owner(self, first: worker_pb2.WorkerCommand, identify: Callable[[], str | None]) -> str:
        """The owner key of a stream whose first command is ``first`` (raises when it names none,
        an over-long one, or one the caller's identity may not use)."""
        if not first.owner:
            raise BadRequestError(ErrorCode.INVALID_EVENT, "the first WorkerCommand must set owner")
        check_id_length(first.owner)
        owner, _ = self._identity.owner(first.owner, identify)
        return owner

    def open(
        self, owner: str, first: worker_pb2.WorkerCommand, rest: AsyncIterator[worker_pb2.WorkerCommand]
    ) -> RunStream:
        """Open ``owner``'s stream (ending an older one of the same owner), queue its
        reconciliation list, apply ``first`` and start reading ``rest``."""
        logger.info("owner %r opened a Run stream", owner)
        self._sessions.owner_returned(owner)
        channel = self._hub.open(owner)
        # Reconciliation: the stream's first StepOutputs list the sessions held for the owner,
        # so that it releases those it no longer has (closed or moved while it was away; its
        # releases for them may never have been sent). Queued before anything else; the first
        # command (which may carry such releases) is applied before the list is converted, and
        # the conversion leaves out whatever is no longer the owner's by then.
        held = self._sessions.fences.live_sessions_of(owner)
        for i in range(0, len(held), HELD_PER_MESSAGE):
            channel.push(OwnerStep(step=0, held=held[i : i + HELD_PER_MESSAGE]))
        stream = RunStream(owner, channel, self._hub, self._sessions, self._commands, next(_STREAM_NUMBERS))
        stream.start(first, rest)
        return stream


class RunStream:
    """One open Run stream of one owner."""

    def __init__(
        self,
        owner: str,
        channel: OwnerChannel,
        hub: OutputHub,
        sessions: SessionTable,
        commands: CommandHandler,
        number: int = 0,
    ) -> None:
        self.owner = owner
        self.number = number
        """Tells this stream's ``CommandMark`` from those of the owner's other streams."""
        self.commands = 0
        """Commands handled on this stream (each step tells the owner how many it had)."""
        self._channel = channel
        self._hub = hub
        self._sessions = sessions
        self._commands = commands
        self._reader: asyncio.Task[None] | None = None
        self._columns = False
        """The owner reads steps in columns (``WorkerCommand.step_columns``, first command)."""

    def start(self, first: worker_pb2.WorkerCommand, rest: AsyncIterator[worker_pb2.WorkerCommand]) -> None:
        """Apply the first command; if the stream goes on, read the others in a task."""
        self._columns = first.step_columns
        if self._apply(first):
            self._reader = asyncio.create_task(self._read(first.owner, rest))

    async def serve(self, context: _Context) -> None:
        """Write the owner's output until the stream is over; raises the error it was ended
        with (superseded, too slow, a bad command, the engine failed)."""
        while True:
            item = await self._channel.get()
            if item is None:
                return
            msg = to_proto(self._sessions.fences, self.owner, item, columns=self._columns)
            if msg is not None and not await _write(context, msg):
                return  # the stream ended while the write waited

    def close(self) -> None:
        """The stream is over: stop reading, drop its channel, and start the owner's orphan
        reap unless another stream of it is open."""
        if self._reader is not None:
            self._reader.cancel()
        self._hub.discard(self._channel)
        self._commands.stream_ended(self.owner, self.number)
        logger.info("owner %r: Run stream ended", self.owner)
        self._sessions.owner_left(self.owner)

    async def _read(self, owner_id: str, commands: AsyncIterator[worker_pb2.WorkerCommand]) -> None:
        """Apply the stream's commands after its first (``start`` applied that one)."""
        channel = self._channel
        try:
            async for cmd in commands:
                if channel.closed:
                    return
                if cmd.owner and cmd.owner != owner_id:
                    raise BadRequestError(ErrorCode.INVALID_EVENT, "owner changed within a Run stream")
                if not self._apply(cmd):
                    return
            channel.close()  # half-close: the stream ends once what is queued is sent
        except asyncio.CancelledError:
            raise
        except DuplexError as err:
            channel.close(err)
        except Exception:
            logger.exception("reading the Run stream failed")
            channel.close(DuplexError(ErrorCode.INTERNAL, "internal error"))

    def _apply(self, cmd: worker_pb2.WorkerCommand) -> bool:
        """``CommandHandler.handle``; a failure of the stream as a whole (the worker stops
        serving, a bug) closes the channel with its error and returns False."""
        self.commands += 1
        try:
            self._commands.handle(self.owner, cmd, CommandMark(self.owner, self.number, self.commands))
        except DuplexError as err:
            self._channel.close(err)
            return False
        except Exception:
            logger.exception("Run command handling failed")
            self._channel.close(DuplexError(ErrorCode.INTERNAL, "internal error"))
            return False
        return True


async def _write(context: _Context, msg: worker_pb2.StepOutput) -> bool:
    """Write one StepOutput; False when the stream ended while the write waited (a failed
    write means the transport gave up on the call; gRPC may not have marked the context
    cancelled yet)."""
    try:
        await context.write(msg)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not (context.cancelled() or context.done()):
            logger.info("a write to an owner failed (%s): the stream is over", type(exc).__name__)
        return False
    return True
