"""The Realtime edge's ``error`` events: the error type, and the OpenAI Realtime API's codes and
messages for the cases it defines (no I/O).

Frameworks branch on OpenAI's codes (Pipecat ignores ``response_cancel_not_active`` and
``conversation_already_has_active_response`` and treats any other error as fatal; LiveKit
recognises a failed cancel by its message), so where the API has a code for a case the edge
sends that code and OpenAI's message, and keeps the session service's own code in
``duplex_code``, a field of its own.
"""

from __future__ import annotations

from typing import Any, Final

from duplex.errors import echo

#: Session-service error codes that are the server's fault, not the request's.
SERVER_CODES: Final = frozenset(
    {"internal", "worker_unavailable", "unavailable", "draining", "fenced", "upstream_unavailable"}
)

# OpenAI's codes (GA Realtime API).
CANCEL_NOT_ACTIVE: Final = "response_cancel_not_active"
ACTIVE_RESPONSE: Final = "conversation_already_has_active_response"
COMMIT_EMPTY: Final = "input_audio_buffer_commit_empty"
DUPLICATE_ITEM: Final = "item_create_duplicate_item_id"


class RealtimeError(Exception):
    """A client event the edge refuses: sent back as an ``error`` event; the connection goes on."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        type: str = "invalid_request_error",
        duplex_code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.type = type
        self.duplex_code = duplex_code

    def to_error(self) -> dict[str, Any]:
        """The ``error`` object of an ``error`` event."""
        error: dict[str, Any] = {
            "type": self.type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "event_id": self.event_id,
        }
        if self.duplex_code and self.duplex_code != self.code:
            error["duplex_code"] = self.duplex_code
        return error


def cancel_not_active(duplex_code: str = "no_active_response") -> RealtimeError:
    return RealtimeError(
        CANCEL_NOT_ACTIVE, "Cancellation failed: no active response found", duplex_code=duplex_code
    )


def active_response(response_id: str, duplex_code: str = "response_in_progress") -> RealtimeError:
    return RealtimeError(
        ACTIVE_RESPONSE,
        f"Conversation already has an active response in progress: {response_id or 'unknown'}. "
        "Wait until the response is finished before creating a new one.",
        duplex_code=duplex_code,
    )


def commit_empty(buffered_ms: float = 0.0, duplex_code: str = "no_committed_input") -> RealtimeError:
    return RealtimeError(
        COMMIT_EMPTY,
        "Error committing input audio buffer: buffer too small. Expected at least 100ms of audio, "
        f"but buffer only has {buffered_ms:.2f}ms of audio.",
        duplex_code=duplex_code,
    )


def item_not_found(action: str, item_id: str, *, param: str = "item_id") -> RealtimeError:
    """``item_{action}_invalid_item_id`` (``action``: truncate, delete, retrieve)."""
    verb = {"truncate": "truncating", "delete": "deleting", "retrieve": "retrieving"}.get(action, action)
    return RealtimeError(
        f"item_{action}_invalid_item_id",
        f"Error {verb} item: the item with id '{echo(item_id)}' does not exist.",
        param=param,
        duplex_code="item_not_found",
    )


def from_session(code: str, message: str, command: str, active_response_id: str) -> RealtimeError:
    """A session-service error answering a client command of kind ``command`` (the command's
    class name, "" when unknown), in OpenAI's terms where the API has them."""
    if code == "no_active_response" and command == "CancelResponse":
        return cancel_not_active(code)
    if code == "response_in_progress":
        return active_response(active_response_id, code)
    if code == "no_committed_input" and command in ("CommitAudio", ""):
        return commit_empty(0.0, code)
    kind = "server_error" if code in SERVER_CODES else "invalid_request_error"
    return RealtimeError(code, message, type=kind)
