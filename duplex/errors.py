"""Stable error codes, the typed exceptions that carry them, and the one place they become gRPC statuses.

Domain code raises one of the exception types below; servicers never pick status codes
themselves. A client sees the code either in an ``Error`` server event (recoverable, the
session goes on) or as the gRPC status of the call plus a ``google.rpc.ErrorInfo`` detail
whose ``reason`` is the code (fatal).
"""

from __future__ import annotations

import json
import reprlib
from enum import StrEnum
from typing import Final, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "duplex.v1"

# The trailer in which grpc-status carries the serialized google.rpc.Status of a failed call.
_STATUS_DETAILS_KEY: Final = "grpc-status-details-bin"

#: Most characters of a client-provided value that an error message shows (``echo``).
MAX_ECHO_CHARS: Final = 64

#: Most bytes (UTF-8) of a status message. A call-ending status carries its message twice in
#: the trailers (``grpc-message``, percent-encoded, and inside ``grpc-status-details-bin``);
#: clients refuse trailers past 8 KiB (soft) / 16 KiB (hard), and the call would then end with
#: a transport error instead of its stable code.
MAX_STATUS_MESSAGE_BYTES: Final = 1024

_ECHO_REPR = reprlib.Repr()  # bounded: at most a few items of each container, 2 levels deep
_ECHO_REPR.maxlevel = 2
_ECHO_REPR.maxstring = _ECHO_REPR.maxother = MAX_ECHO_CHARS

# Any servicer's request and response types: abort() ends calls of every service here.
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class ErrorCode(StrEnum):
    """Stable machine-readable codes. Clients branch on these; never rename one."""

    INVALID_EVENT = "invalid_event"
    SESSION_NOT_OPEN = "session_not_open"
    ALREADY_OPEN = "already_open"
    INVALID_CONFIG = "invalid_config"
    INVALID_RUNTIME_CONFIG = "invalid_runtime_config"
    PRIVATE_RUNTIME_KEY = "private_runtime_key"
    UNSUPPORTED_AUDIO_FORMAT = "unsupported_audio_format"
    AUDIO_FORMAT_MISMATCH = "audio_format_mismatch"
    INVALID_PCM_LENGTH = "invalid_pcm_length"
    CHUNK_TOO_LARGE = "chunk_too_large"
    SEQ_OUT_OF_ORDER = "seq_out_of_order"
    NO_COMMITTED_INPUT = "no_committed_input"
    RESPONSE_IN_PROGRESS = "response_in_progress"
    NO_ACTIVE_RESPONSE = "no_active_response"
    MODEL_CHANGE_REFUSED = "model_change_refused"
    CONTEXT_LOCKED = "context_locked"
    MODEL_MISMATCH = "model_mismatch"
    UNKNOWN_SESSION = "unknown_session"
    INVALID_RESUME_TOKEN = "invalid_resume_token"
    UNAUTHENTICATED = "unauthenticated"
    NOT_SESSION_OWNER = "not_session_owner"
    SESSION_CLOSED = "session_closed"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    TOO_MANY_CALLS = "too_many_calls"
    IDENTITY_NOT_ALLOWED = "identity_not_allowed"
    SLOW_CONSUMER = "slow_consumer"
    FENCED = "fenced"
    STALE_EPOCH = "stale_epoch"
    NOT_OWNER = "not_owner"
    WORKER_UNAVAILABLE = "worker_unavailable"
    DRAINING = "draining"
    IDLE_TIMEOUT = "idle_timeout"
    INPUT_ABANDONED = "input_abandoned"
    MODEL_ERROR = "model_error"
    UNSUPPORTED_BY_MODEL = "unsupported_by_model"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UNKNOWN_CALL_ID = "unknown_call_id"
    FUNCTION_CALL_ANSWERED = "function_call_answered"
    FUNCTION_CALL_CANCELLED = "function_call_cancelled"
    INTERNAL = "internal"


class WorkerErrorCode(StrEnum):
    """The codes of ``WorkerError.code`` in ``duplex.v1.worker`` (one request's failure).

    Exactly the set ``proto/duplex/v1/worker.proto`` documents (a test keeps them equal);
    ``docs/worker-protocol.md`` says when each is sent.
    """

    # The work's fence epoch is below the session's highest accepted epoch; it never runs.
    STALE_EPOCH = "stale_epoch"
    # The work comes from an owner other than the session's current one (e.g. after a takeover).
    NOT_OWNER = "not_owner"
    # The session is not attached on this worker (never attached, or released).
    UNKNOWN_SESSION = "unknown_session"
    # The submission is malformed: PCM that is not whole frames, or bad model options (params).
    BAD_SUBMISSION = "bad_submission"
    # RESPOND arrived with no committed utterance to reply to.
    NO_COMMITTED_INPUT = "no_committed_input"
    # The model failed for this request; the rest of the batch goes on.
    MODEL_ERROR = "model_error"
    # No room for the work: the request's input queue on the worker is full.
    CAPACITY = "capacity"
    # A service the model calls (a chat stage's language model server) did not answer in time or
    # at all; trying the turn again may succeed.
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"


class DuplexError(Exception):
    """Base of every error that carries a stable code and a gRPC status."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False

    def __init__(self, code: ErrorCode | str, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        if retryable is not None:
            self.retryable = retryable

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class BadEventError(DuplexError):
    """A client event is malformed or not allowed now; answered with an error event, the session goes on."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class BadRequestError(DuplexError):
    """A request that cannot start (bad open, unknown model, bad command line value); ends the call."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class UnauthenticatedError(DuplexError):
    """Missing or wrong credentials (including a bad resume token)."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(DuplexError):
    """The caller is authenticated but may not do this (e.g. resume another principal's session)."""

    status = grpc.StatusCode.PERMISSION_DENIED


class NotFoundError(DuplexError):
    """The named session does not exist (any more)."""

    status = grpc.StatusCode.NOT_FOUND


class CapacityError(DuplexError):
    """No room for another session or request right now."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class FencedError(DuplexError):
    """The work carries an epoch (or owner) the fencing authority has moved past."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(DuplexError):
    """A dependency (a worker) cannot be reached, or the service is draining."""

    status = grpc.StatusCode.UNAVAILABLE
    retryable = True


class InternalError(DuplexError):
    """A bug or a model failure; the details are logged, not sent."""

    status = grpc.StatusCode.INTERNAL


_STATUS_TO_ERROR: dict[grpc.StatusCode, type[DuplexError]] = {
    cls.status: cls
    for cls in (
        BadRequestError,
        UnauthenticatedError,
        PermissionDeniedError,
        NotFoundError,
        CapacityError,
        FencedError,
        UnavailableError,
        InternalError,
    )
}


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A client-provided value as an error message may show it: bounded and escaped.

    A string is shown in double quotes with ``"``, ``\\``, control and non-ASCII characters
    escaped as JSON escapes them, cut after at most ``limit`` characters of that (the cut is
    said, with the full length); anything else by a bounded ``repr``, escaped the same way. The
    result is ASCII and at most ``limit`` + 30 characters, whatever the client sent.
    """
    if isinstance(value, str):
        shown, used = _escape(value, limit)
        note = "" if used == len(value) else f"... ({len(value)} characters)"
        return f'"{shown}"{note}'
    return _escape(_ECHO_REPR.repr(value), limit)[0]


def _escape(text: str, limit: int) -> tuple[str, int]:
    """``text`` escaped (printable ASCII but ``"`` and ``\\`` as is), at most ``limit``
    characters of it, and how many characters of ``text`` that took."""
    out: list[str] = []
    width = 0
    for used, ch in enumerate(text):
        e = ch if " " <= ch <= "~" and ch not in '"\\' else json.dumps(ch)[1:-1]
        if width + len(e) > limit:
            return "".join(out), used
        out.append(e)
        width += len(e)
    return "".join(out), len(text)


def bound_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """``message`` cut to at most ``limit`` bytes of UTF-8 (on a character boundary)."""
    data = message.encode()
    if len(data) <= limit:
        return message
    return data[: limit - 3].decode(errors="ignore") + "..."


def to_rpc_status(err: DuplexError) -> grpc.Status:
    """The rich gRPC status for an error: its status code, message and an ErrorInfo with the code.

    The message is bounded (``MAX_STATUS_MESSAGE_BYTES``) so the trailers always fit."""
    info = error_details_pb2.ErrorInfo(reason=err.code, domain=ERROR_DOMAIN)
    if err.retryable:
        info.metadata["retryable"] = "true"
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=err.status.value[0], message=bound_message(err.message), details=[detail])
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext[_Request, _Response], err: DuplexError) -> NoReturn:
    """End an RPC with the status that belongs to ``err`` (the single mapping site for servers)."""
    await context.abort_with_status(to_rpc_status(err))
    raise AssertionError("abort_with_status returned")  # pragma: no cover - it always raises


def from_rpc_error(exc: grpc.RpcError) -> DuplexError:
    """Rebuild the typed error from a failed call (client side), keeping the stable code when present."""
    code_attr = getattr(exc, "code", None)
    status_code: grpc.StatusCode = code_attr() if callable(code_attr) else grpc.StatusCode.UNKNOWN
    details_attr = getattr(exc, "details", None)
    details: str | None = details_attr() if callable(details_attr) else None
    message = details or str(exc)
    code = _default_code(status_code)
    retryable: bool | None = None
    try:
        status = _rich_status(exc, status_code, details)
    except Exception:  # a malformed trailer must not hide the original failure
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                code = info.reason or code
                retryable = info.metadata.get("retryable") == "true"
    return error_for(status_code, code, message, retryable)


def error_for(
    status_code: grpc.StatusCode, code: str, message: str, retryable: bool | None = None
) -> DuplexError:
    """The typed error of a gRPC status with a stable ``code`` ("" = the status's default)."""
    cls = _STATUS_TO_ERROR.get(status_code, DuplexError)
    err = cls(code or _default_code(status_code), message, retryable=retryable)
    err.status = status_code
    return err


def _rich_status(
    exc: grpc.RpcError, status_code: grpc.StatusCode, details: str | None
) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` the server attached to a failed call, if any.

    What ``grpc_status.rpc_status.from_call`` reads, for sync and aio errors alike (it is
    typed for ``grpc.Call``, which an ``aio.AioRpcError`` is not). A status whose code or
    message disagrees with the call's code and details is not this call's: None.
    """
    trailing_attr = getattr(exc, "trailing_metadata", None)  # absent on a bare grpc.RpcError
    for key, value in (trailing_attr() if callable(trailing_attr) else None) or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            if status.code != status_code.value[0] or status.message != details:
                return None
            return status
    return None


def _default_code(status_code: grpc.StatusCode) -> str:
    return {
        grpc.StatusCode.UNAVAILABLE: ErrorCode.WORKER_UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.CAPACITY_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.FENCED,
        grpc.StatusCode.UNAUTHENTICATED: ErrorCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_EVENT,
        grpc.StatusCode.NOT_FOUND: ErrorCode.UNKNOWN_SESSION,
        grpc.StatusCode.PERMISSION_DENIED: ErrorCode.NOT_SESSION_OWNER,
    }.get(status_code, ErrorCode.INTERNAL).value


__all__ = [
    "ERROR_DOMAIN",
    "MAX_ECHO_CHARS",
    "MAX_STATUS_MESSAGE_BYTES",
    "BadEventError",
    "BadRequestError",
    "CapacityError",
    "DuplexError",
    "ErrorCode",
    "FencedError",
    "InternalError",
    "NotFoundError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "UnavailableError",
    "WorkerErrorCode",
    "abort",
    "bound_message",
    "echo",
    "error_for",
    "from_rpc_error",
    "to_rpc_status",
]
