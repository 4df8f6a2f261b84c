"""Whether a call gets a slot: calls in progress, counted where they cost.

gRPC's own bound (``maximum_concurrent_rpcs``) counts every call alike and refuses beyond it
with a bare RESOURCE_EXHAUSTED: one caller's idle calls, authenticated or not, would refuse
every other caller's open. Here each call is counted where its cost belongs:

- an authenticated call against its principal, opened or not (``max_calls_per_principal``),
  and against the replica (``max_calls``), from the moment its handler starts to its end;
- a call refused for its credentials against its peer address: such a call waits up to
  ``FIRST_MESSAGE_WAIT_S`` for its first message before the refusal (so that the client reads
  the status and not a transport error), and only ``max_refusals_per_peer`` of them wait at
  once per peer address, ``max_refusals`` in all; the others are refused at once.

Beyond a bound a call is refused with RESOURCE_EXHAUSTED ``too_many_calls`` in its
``ErrorInfo`` (retryable). A principal's bound is below the replica's, so no one caller can
hold every slot. The health service stays open to anyone and bounds its own streams
(``duplex.serving.Health``).

``CallLedger`` is the state (no I/O); ``AdmissionInterceptor`` applies it to every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import grpc

from duplex.errors import CapacityError, DuplexError, ErrorCode, UnauthenticatedError, abort, to_rpc_status
from duplex.serving import Slots, peer_host
from session_service.metrics import CALLS, ERRORS_BY_CODE
from session_service.trust.auth import OPEN_METHOD_PREFIXES, Authenticator

#: How long a refused streaming call may take to send its first message before the refusal.
FIRST_MESSAGE_WAIT_S: Final = 1.0

#: Refused calls that may wait for their first message at once, per peer address and in all.
DEFAULT_MAX_REFUSALS_PER_PEER: Final = 16
DEFAULT_MAX_REFUSALS: Final = 256

_Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True, slots=True)
class CallLimits:
    """The bounds a ``CallLedger`` keeps (0 = unbounded)."""

    max_calls: int
    """Authenticated calls in progress on the replica."""
    max_calls_per_principal: int
    """Authenticated calls in progress of one principal (opened or not)."""
    max_refusals_per_peer: int = DEFAULT_MAX_REFUSALS_PER_PEER
    """Calls refused for their credentials waiting for their first message, per peer address."""
    max_refusals: int = DEFAULT_MAX_REFUSALS
    """The same, in all."""


class CallLedger:
    """Calls in progress by principal and in all, and refusals in progress by peer address
    (``duplex.serving.Slots``)."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self._calls = Slots(limits.max_calls_per_principal, limits.max_calls)
        self._refusals = Slots(limits.max_refusals_per_peer, limits.max_refusals)

    @property
    def calls(self) -> int:
        return self._calls.held

    def calls_of(self, principal: str) -> int:
        return self._calls.by_key.get(principal, 0)

    @property
    def refusals(self) -> int:
        return self._refusals.held

    def refusals_from(self, peer: str) -> int:
        return self._refusals.by_key.get(peer, 0)

    def enter(self, principal: str | None) -> None:
        """Count a call of ``principal`` (None: counted only in all) or raise ``CapacityError``
        (``too_many_calls``)."""
        full = self._calls.full(principal)
        if full is not None:
            bound = (
                f"{self._calls.per_key} calls per caller" if full == "key" else f"{self._calls.total} calls"
            )
            raise CapacityError(ErrorCode.TOO_MANY_CALLS, f"at most {bound} in progress on this replica")
        self._calls.take(principal)
        CALLS.set(self._calls.held)

    def leave(self, principal: str | None) -> None:
        self._calls.give(principal)
        CALLS.set(self._calls.held)

    def refusal_may_wait(self, peer: str) -> bool:
        """Whether a refused call from ``peer`` may wait for its first message (then counted
        until ``refusal_done``), or must be refused at once."""
        if self._refusals.full(peer) is not None:
            return False
        self._refusals.take(peer)
        return True

    def refusal_done(self, peer: str) -> None:
        self._refusals.give(peer)


_HandlerFactory = Callable[..., "grpc.RpcMethodHandler[Any, Any]"]

_FACTORIES: Final[dict[tuple[bool, bool], _HandlerFactory]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _behaviour(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    kind = (handler.request_streaming, handler.response_streaming)
    behaviour = {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }[kind]
    assert behaviour is not None, "a handler has the behaviour of its kind"
    return behaviour


def _rebuilt(
    like: grpc.RpcMethodHandler[Any, Any], behaviour: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    factory = _FACTORIES[(like.request_streaming, like.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=like.request_deserializer,
        response_serializer=like.response_serializer,
    )


def refusing_handler(
    err: DuplexError, like: grpc.RpcMethodHandler[Any, Any] | None, ledger: CallLedger
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as ``like`` (a bidi stream for an unknown method) that ends
    the call with ``err``'s rich status and does nothing else.

    A streaming call's first message is awaited (up to ``FIRST_MESSAGE_WAIT_S``, while the
    ledger lets its peer wait) and dropped before the refusal: a client that writes and then
    reads, as the first event of ``Converse`` is written, would otherwise race the status with
    its write, and a grpc.aio client whose write fails because the call has just ended reports
    ``INTERNAL: Internal error from Core`` instead of the status it was sent (grpc/grpc#36066)."""
    status = to_rpc_status(err)

    async def refuse(_request: object, context: _Context) -> None:
        await context.abort_with_status(status)

    async def refuse_stream(requests: AsyncIterable[object], context: _Context) -> None:
        peer = peer_host(context.peer() or "")
        if ledger.refusal_may_wait(peer):
            try:
                with contextlib.suppress(Exception):  # none, late, malformed or cut: refused all the same
                    async with asyncio.timeout(FIRST_MESSAGE_WAIT_S):
                        await anext(aiter(requests))
            finally:
                ledger.refusal_done(peer)
        await context.abort_with_status(status)

    if like is None:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return _rebuilt(like, refuse_stream if like.request_streaming else refuse)


def counted_handler(
    handler: grpc.RpcMethodHandler[Any, Any],
    ledger: CallLedger,
    principal_of: Callable[[_Context], str | None],
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler``, its call counted in ``ledger`` from its start to its end (refused with
    ``too_many_calls`` beyond a bound, before the handler runs)."""
    behaviour = _behaviour(handler)

    async def enter(context: _Context) -> str | None:
        try:
            principal = principal_of(context)
            ledger.enter(principal)
        except DuplexError as err:
            ERRORS_BY_CODE[err.code].inc()
            await abort(context, err)
        return principal

    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: object, context: _Context) -> AsyncIterator[object]:
            principal = await enter(context)
            try:
                async for item in behaviour(request, context):
                    yield item
            finally:
                ledger.leave(principal)

        return _rebuilt(handler, stream)

    async def call(request: object, context: _Context) -> object:
        principal = await enter(context)
        try:
            return await behaviour(request, context)
        finally:
            ledger.leave(principal)

    return _rebuilt(handler, call)


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health's: refused without valid credentials (``UNAUTHENTICATED`` /
    ``unauthenticated``) before its handler runs, so no session state is made for it (unknown
    methods alike: an unauthenticated caller learns nothing about what exists); otherwise
    counted in the ledger, per principal when calls are authenticated."""

    def __init__(self, authenticator: Authenticator, ledger: CallLedger) -> None:
        self._auth = authenticator
        self._ledger = ledger

    def _principal(self, context: _Context) -> str | None:
        # Without authentication every caller is the same anonymous one: only the replica's
        # bound applies.
        return self._auth.principal_of(context) if self._auth.enabled else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        try:
            self._auth.admit(handler_call_details.invocation_metadata)
        except UnauthenticatedError as err:
            ERRORS_BY_CODE[err.code].inc()
            return refusing_handler(err, await continuation(handler_call_details), self._ledger)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return counted_handler(handler, self._ledger, self._principal)
