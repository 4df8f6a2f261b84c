"""duplex.errors: the one mapping from typed errors to gRPC statuses, and back on the client."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from duplex import errors
from duplex.errors import (
    BadRequestError,
    CapacityError,
    DuplexError,
    ErrorCode,
    FencedError,
    UnauthenticatedError,
    UnavailableError,
    WorkerErrorCode,
)
from duplex.serving import SERVER_OPTIONS
from duplex.v1 import worker_pb2, worker_pb2_grpc


class _Failing(worker_pb2_grpc.DuplexWorkerServicer):
    def __init__(self, err: DuplexError) -> None:
        self.err = err

    async def Describe(
        self, request: object, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerDescription:
        await errors.abort(context, self.err)


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (BadRequestError(ErrorCode.MODEL_MISMATCH, "wrong model"), grpc.StatusCode.INVALID_ARGUMENT),
        (UnauthenticatedError(ErrorCode.INVALID_RESUME_TOKEN, "bad token"), grpc.StatusCode.UNAUTHENTICATED),
        (CapacityError(ErrorCode.CAPACITY_EXHAUSTED, "full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (FencedError(ErrorCode.STALE_EPOCH, "epoch 3 < 4"), grpc.StatusCode.FAILED_PRECONDITION),
        (UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "no worker"), grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_abort_carries_status_and_stable_code_to_the_client(
    err: DuplexError, status: grpc.StatusCode
) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    worker_pb2_grpc.add_DuplexWorkerServicer_to_server(_Failing(err), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest())
    finally:
        await server.stop(0)
    assert caught.value.code() == status
    rebuilt = errors.from_rpc_error(caught.value)
    assert type(rebuilt) is type(err)
    assert rebuilt.code == err.code
    assert rebuilt.message == err.message
    assert rebuilt.retryable == err.retryable


def test_plain_rpc_error_without_details_gets_a_default_code() -> None:
    class _Bare(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    rebuilt = errors.from_rpc_error(_Bare())
    assert isinstance(rebuilt, UnavailableError)
    assert rebuilt.code == ErrorCode.WORKER_UNAVAILABLE
    assert rebuilt.retryable


def test_error_codes_are_unique_snake_case() -> None:
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    assert all(v == v.lower() and " " not in v for v in values)


async def test_sync_client_errors_keep_the_stable_code_too() -> None:
    # grpc (sync) raises a different error type than grpc.aio; both carry the rich status.
    err = FencedError(ErrorCode.STALE_EPOCH, "epoch 3 < 4")
    server = grpc.aio.server(options=SERVER_OPTIONS)
    worker_pb2_grpc.add_DuplexWorkerServicer_to_server(_Failing(err), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    def call() -> grpc.RpcError:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
            except grpc.RpcError as exc:
                return exc
        raise AssertionError("the call succeeded")

    try:
        exc = await asyncio.to_thread(call)
    finally:
        await server.stop(0)
    assert not isinstance(exc, grpc.aio.AioRpcError)
    rebuilt = errors.from_rpc_error(exc)
    assert isinstance(rebuilt, FencedError)
    assert (rebuilt.code, rebuilt.message) == ("stale_epoch", "epoch 3 < 4")


def test_a_status_trailer_that_disagrees_with_the_call_is_ignored() -> None:
    # A rich status whose code is not the call's own belongs to something else (a proxy
    # rewrote the status): the call's status code decides, with its default code.
    trailer = errors.to_rpc_status(CapacityError(ErrorCode.CAPACITY_EXHAUSTED, "full")).trailing_metadata
    mismatched = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), details="full"
    )
    rebuilt = errors.from_rpc_error(mismatched)
    assert isinstance(rebuilt, UnavailableError)
    assert rebuilt.code == ErrorCode.WORKER_UNAVAILABLE
    matching = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), details="full"
    )
    assert errors.from_rpc_error(matching).code == ErrorCode.CAPACITY_EXHAUSTED


def test_a_bare_rpc_error_becomes_an_internal_error() -> None:
    rebuilt = errors.from_rpc_error(grpc.RpcError("no code, no details, no trailers"))
    assert type(rebuilt) is DuplexError
    assert rebuilt.code == ErrorCode.INTERNAL
    assert rebuilt.message == "no code, no details, no trailers"


def test_worker_error_codes_are_the_ones_worker_proto_documents() -> None:
    proto = (Path(__file__).resolve().parent.parent / "proto/duplex/v1/worker.proto").read_text()
    message = re.search(r"^message WorkerError \{\n(?P<body>.*?)^\}", proto, re.M | re.S)
    assert message is not None, "worker.proto has no WorkerError message"
    # The comment lines right above `string code = 1;` list the codes.
    comment = re.search(r"((?:[ \t]*//.*\n)+)[ \t]*string code = 1;", message["body"])
    assert comment is not None, "WorkerError.code lost its comment"
    documented = re.findall(r'"([a-z_]+)"', comment[1])
    assert len(documented) >= 7, documented
    assert sorted(c.value for c in WorkerErrorCode) == sorted(documented)
