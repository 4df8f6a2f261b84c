"""``duplex.v1.DuplexWorker``: a thin adapter between protobuf messages and the domain.

Each call passes the serving gate (``ServingState.serving_model``) and hands its messages to the
module that does the job: ``commands`` (Attach, and each Run command: fenced, validated, turned
into engine work), ``run_stream`` (a Run stream: reconciliation, reading, converting and writing
output), ``identity`` (owner keys and who may own or take over sessions: the caller's certificate
is read here), ``sessions`` (the fence table and each session's bookkeeping: request ids, queue
counters, attach leases, orphan reaps). Errors are typed ``DuplexError``s; ``duplex.errors.abort``,
here, is the one place they become statuses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from duplex.errors import DuplexError, ErrorCode, UnavailableError, abort
from duplex.tls import peer_identity
from duplex.v1 import worker_pb2, worker_pb2_grpc
from worker_service.commands import CommandHandler
from worker_service.config import WorkerConfig
from worker_service.delivery import OutputHub
from worker_service.engine import Engine
from worker_service.fencing import FenceTable
from worker_service.identity import MAX_REFUSED_IDENTITIES_LOGGED, OWNER_SEPARATOR, IdentityPolicy, owner_key
from worker_service.run_stream import HELD_PER_MESSAGE, RunStreams
from worker_service.serving_state import ServingState
from worker_service.sessions import SessionTable

# Names that lived here before the split stay importable from here.
__all__ = [
    "HELD_PER_MESSAGE",
    "MAX_REFUSED_IDENTITIES_LOGGED",
    "OWNER_SEPARATOR",
    "SERVICE_NAME",
    "DuplexWorkerServicer",
    "ServingState",
    "owner_key",
]

SERVICE_NAME: str = worker_pb2.DESCRIPTOR.services_by_name["DuplexWorker"].full_name

_Context = grpc.aio.ServicerContext[Any, Any]


def _identify(context: _Context) -> Callable[[], str | None]:
    """The caller's certificate identity, read only when asked (with mutual TLS)."""
    return lambda: peer_identity(context)


class DuplexWorkerServicer(worker_pb2_grpc.DuplexWorkerServicer):
    def __init__(
        self, config: WorkerConfig, state: ServingState, engine: Engine, hub: OutputHub, fences: FenceTable
    ) -> None:
        self._config = config
        self._state = state
        self._identity = IdentityPolicy(config, authorize=fences.authorizes)
        self._sessions = SessionTable(fences, config, has_stream=hub.has, submit=engine.submit)
        self._commands = CommandHandler(config, state, engine, hub, self._sessions, self._identity)
        self._streams = RunStreams(hub, self._sessions, self._commands, self._identity)

    @property
    def fences(self) -> FenceTable:
        return self._sessions.fences

    def cancel_reapers(self) -> None:
        """Stop pending orphan reaps and attach leases (server shutdown)."""
        self._sessions.cancel_timers()

    def handle_command(self, owner: str, cmd: worker_pb2.WorkerCommand) -> None:
        """Fence and validate one command of ``owner``'s Run stream (``CommandHandler.handle``)."""
        self._commands.handle(owner, cmd)

    async def Describe(
        self,
        request: worker_pb2.DescribeRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DescribeRequest, worker_pb2.WorkerDescription],
    ) -> worker_pb2.WorkerDescription:
        model = self._state.model
        if model is None:
            await abort(context, UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the model is loading"))
        return worker_pb2.WorkerDescription(
            model_id=model.model_id,
            device=str(model.device),
            max_batch=self._config.max_batch,
            audio_format=model.audio_format.to_proto(),
            frame_samples=model.frame_samples,
            worker_id=self._config.worker_id,
            max_sessions=self._config.max_sessions,
            append_columns=True,
        )

    async def Attach(
        self,
        request: worker_pb2.AttachRequest,
        context: grpc.aio.ServicerContext[worker_pb2.AttachRequest, worker_pb2.AttachResponse],
    ) -> worker_pb2.AttachResponse:
        try:
            admission, was_live = self._commands.attach(request, _identify(context))
        except DuplexError as err:
            await abort(context, err)
        return worker_pb2.AttachResponse(epoch=admission.epoch, resumed=was_live)

    async def Run(  # type: ignore[override]  # a coroutine writing with context.write
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerCommand],
        context: grpc.aio.ServicerContext[worker_pb2.WorkerCommand, worker_pb2.StepOutput],
    ) -> None:
        """The owner's stream (``run_stream``), written with ``context.write()``."""
        try:
            self._state.serving_model()
            first = await anext(request_iterator, None)
            if first is None:
                return
            owner = self._streams.owner(first, _identify(context))
        except DuplexError as err:
            await abort(context, err)
        stream = self._streams.open(owner, first, request_iterator)
        try:
            await stream.serve(context)
        except DuplexError as err:
            await abort(context, err)
        finally:
            stream.close()
