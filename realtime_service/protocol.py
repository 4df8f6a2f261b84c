"""Realtime client events as typed commands (no I/O).

The OpenAI Realtime API (GA shape) names its events ``session.update``,
``input_audio_buffer.append`` and so on, as JSON text frames. ``parse_client_event`` turns one
frame into a frozen command or raises ``RealtimeError``, which the connection sends back as an
``error`` event in OpenAI's shape (``type``, ``code``, ``message``, ``param``, ``event_id``);
the connection stays up. ``session.update`` is parsed in ``session_config``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from duplex.audio import PcmFormat
from duplex.errors import echo
from realtime_service.errors import RealtimeError as RealtimeError
from realtime_service.session_config import DEFAULT_TURN as DEFAULT_TURN
from realtime_service.session_config import FORMATS as FORMATS
from realtime_service.session_config import PCM24K as PCM24K
from realtime_service.session_config import TurnSetting as TurnSetting
from realtime_service.session_config import UpdateSession as UpdateSession
from realtime_service.session_config import format_object as format_object
from realtime_service.session_config import obj, parse_session_update

#: Longest client ``event_id`` echoed back in an ``error`` (as the session service bounds it).
MAX_EVENT_ID_CHARS: Final = 256

#: Longest item id a client may give.
MAX_ITEM_ID_CHARS: Final = 256

#: Content part types a message of each role may hold.
CONTENT_TYPES: Final = {
    "user": frozenset({"input_text", "input_audio", "input_image"}),
    "system": frozenset({"input_text"}),
    "assistant": frozenset({"output_text", "output_audio", "text", "audio"}),
}

#: ``response.create`` parameters the API defines that the edge accepts: ``metadata`` and
#: ``output_modalities`` come back in the response; the others (per-response instructions, tools,
#: voice, token limits) are accepted and do not change what this model says.
RESPONSE_FIELDS: Final = frozenset(
    {
        "conversation",
        "input",
        "metadata",
        "output_modalities",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "audio",
        "prompt",
        # the beta's names
        "modalities",
        "voice",
        "temperature",
        "output_audio_format",
        "max_response_output_tokens",
    }
)


# ---- commands -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AppendAudio:
    event_id: str | None
    audio: bytes


@dataclass(frozen=True)
class CommitAudio:
    event_id: str | None


@dataclass(frozen=True)
class ClearAudio:
    event_id: str | None


@dataclass(frozen=True)
class CreateResponse:
    event_id: str | None
    metadata: dict[str, Any] | None = None
    output_modalities: tuple[str, ...] | None = None
    max_output_tokens: int | str | None = None


@dataclass(frozen=True)
class CancelResponse:
    event_id: str | None
    response_id: str = ""


@dataclass(frozen=True)
class TruncateItem:
    event_id: str | None
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class DeleteItem:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class RetrieveItem:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class CreateItem:
    """``conversation.item.create``: the item as the conversation keeps it (``item``, its id ""
    when the client gave none). What the model takes goes on to it: a user message's audio (as a
    committed turn) and a function call's output; the rest (text, images, the client's own
    assistant and system messages, function calls) is kept in the conversation only."""

    event_id: str | None
    item: dict[str, Any]
    previous_item_id: str | None = None
    audio: bytes = b""
    kind: str = field(default="kept")
    """``audio`` (a turn), ``function_call_output`` (to the model) or ``kept``."""

    @property
    def item_id(self) -> str:
        return str(self.item.get("id") or "")

    @property
    def call_id(self) -> str:
        return str(self.item.get("call_id") or "")

    @property
    def output(self) -> str:
        return str(self.item.get("output") or "")


Command = (
    UpdateSession
    | AppendAudio
    | CommitAudio
    | ClearAudio
    | CreateResponse
    | CancelResponse
    | TruncateItem
    | DeleteItem
    | RetrieveItem
    | CreateItem
)

#: Client event types of the API that the edge does not serve (each answered with an error
#: naming it, ``unsupported_event``); any other type is ``unknown_event``.
UNSUPPORTED_EVENTS: Final = frozenset({"output_audio_buffer.clear", "transcription_session.update"})


# ---- parsing ------------------------------------------------------------------------------


def parse_client_event(data: str | bytes, input_format: PcmFormat) -> Command:
    """One client frame to a command; raises ``RealtimeError``. ``input_format``: the session's
    (an append must hold whole samples of it)."""
    try:
        event = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RealtimeError("invalid_json", f"the event is not JSON: {echo(str(exc))}") from None
    if not isinstance(event, dict):
        raise RealtimeError("invalid_event", "an event is a JSON object")
    raw_id = event.get("event_id")
    event_id = raw_id[:MAX_EVENT_ID_CHARS] if isinstance(raw_id, str) else None
    kind = event.get("type")
    try:
        if not isinstance(kind, str):
            raise RealtimeError("missing_type", "the event has no string 'type'", param="type")
        parse = _PARSERS.get(kind)
        if parse is None:
            if kind in UNSUPPORTED_EVENTS:
                raise RealtimeError(
                    "unsupported_event", f"{kind} is not supported by this server", param="type"
                )
            raise RealtimeError("unknown_event", f"unknown event type {echo(kind)}", param="type")
        return parse(event, event_id, input_format)
    except RealtimeError as exc:
        exc.event_id = event_id
        raise


def _string(o: dict[str, Any], key: str, param: str, *, required: bool = True) -> str:
    value = o.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RealtimeError("invalid_type", f"'{param}' must be a string", param=param)
    return value


def _int(o: dict[str, Any], key: str, param: str, *, low: int = 0, high: int = 2**53) -> int:
    value = o.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RealtimeError("invalid_type", f"'{param}' must be an integer", param=param)
    if not low <= value <= high:
        raise RealtimeError("invalid_value", f"'{param}' must be within {low}..{high}", param=param)
    return value


def decode_audio(value: object, param: str, fmt: PcmFormat) -> bytes:
    """Base64 audio of whole samples of ``fmt``; raises ``RealtimeError``."""
    if not isinstance(value, str):
        raise RealtimeError("invalid_type", f"'{param}' must be a base64 string", param=param)
    try:
        audio = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("invalid_base64", f"'{param}' is not valid base64", param=param) from None
    if not audio:
        raise RealtimeError("empty_audio", f"'{param}' holds no audio", param=param)
    if len(audio) % fmt.frame_bytes:
        raise RealtimeError(
            "invalid_audio_length",
            f"'{param}' must hold whole samples ({fmt.frame_bytes} bytes each in the session's input format)",
            param=param,
        )
    return audio


def _session_update(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> UpdateSession:
    return parse_session_update(event, event_id)


def _append(event: dict[str, Any], event_id: str | None, fmt: PcmFormat) -> AppendAudio:
    return AppendAudio(event_id, decode_audio(event.get("audio"), "audio", fmt))


def _commit(_event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> CommitAudio:
    return CommitAudio(event_id)


def _clear(_event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> ClearAudio:
    return ClearAudio(event_id)


def _response_create(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> CreateResponse:
    response = obj(event.get("response"), "response", nullable=True) or {}
    for key in response:
        if key not in RESPONSE_FIELDS:
            param = f"response.{key}"
            raise RealtimeError("unknown_parameter", f"unknown parameter '{echo(param)}'", param=param)
    if response.get("conversation") not in (None, "auto"):
        raise RealtimeError(
            "unsupported_parameter",
            "out-of-band responses (response.conversation other than auto) are not supported",
            param="response.conversation",
        )
    if response.get("input"):
        raise RealtimeError(
            "unsupported_parameter",
            "response.input is not supported: the model answers the conversation",
            param="response.input",
        )
    metadata = obj(response.get("metadata"), "response.metadata", nullable=True)
    modalities = response.get("output_modalities")
    if modalities is not None and (
        not isinstance(modalities, list)
        or not modalities
        or any(m not in ("audio", "text") for m in modalities)
    ):
        raise RealtimeError(
            "invalid_value",
            "response.output_modalities must be a non-empty list of 'audio' and 'text'",
            param="response.output_modalities",
        )
    tokens = response.get("max_output_tokens")
    if tokens is not None and tokens != "inf" and (not isinstance(tokens, int) or isinstance(tokens, bool)):
        raise RealtimeError(
            "invalid_value",
            "response.max_output_tokens must be an integer or 'inf'",
            param="response.max_output_tokens",
        )
    return CreateResponse(
        event_id, metadata, tuple(dict.fromkeys(modalities)) if modalities is not None else None, tokens
    )


def _response_cancel(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> CancelResponse:
    return CancelResponse(event_id, _string(event, "response_id", "response_id", required=False))


def _truncate(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> TruncateItem:
    return TruncateItem(
        event_id,
        item_id=_string(event, "item_id", "item_id"),
        content_index=_int(event, "content_index", "content_index", high=0)
        if "content_index" in event
        else 0,
        audio_end_ms=_int(event, "audio_end_ms", "audio_end_ms"),
    )


def _delete(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> DeleteItem:
    return DeleteItem(event_id, _string(event, "item_id", "item_id"))


def _retrieve(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> RetrieveItem:
    return RetrieveItem(event_id, _string(event, "item_id", "item_id"))


def _content(part: object, i: int, role: str, fmt: PcmFormat) -> tuple[dict[str, Any], bytes]:
    """One content part as kept (audio and image data are not kept), and its audio."""
    param = f"item.content[{i}]"
    p = obj(part, param)
    assert p is not None
    kind = p.get("type")
    if kind not in CONTENT_TYPES[role]:
        allowed = ", ".join(sorted(CONTENT_TYPES[role]))
        raise RealtimeError(
            "invalid_value",
            f"a {role} message's content is {allowed} (got {echo(kind)})",
            param=f"{param}.type",
        )
    if kind in ("input_text", "output_text", "text"):
        return {"type": kind, "text": _string(p, "text", f"{param}.text")}, b""
    if kind == "input_image":
        return {"type": kind, "detail": p.get("detail") or "auto"}, b""
    transcript = _string(p, "transcript", f"{param}.transcript", required=False) or None
    audio = b""
    if kind == "input_audio":
        audio = decode_audio(p.get("audio"), f"{param}.audio", fmt)
    return {"type": kind, "transcript": transcript}, audio


def _item_create(event: dict[str, Any], event_id: str | None, fmt: PcmFormat) -> CreateItem:
    item = obj(event.get("item"), "item")
    assert item is not None
    item_id = _string(item, "id", "item.id", required=False)
    if len(item_id) > MAX_ITEM_ID_CHARS:
        raise RealtimeError("invalid_value", f"item.id is longer than {MAX_ITEM_ID_CHARS}", param="item.id")
    previous = event.get("previous_item_id")
    if previous is not None and not isinstance(previous, str):
        raise RealtimeError("invalid_type", "'previous_item_id' must be a string", param="previous_item_id")
    kept: dict[str, Any] = {"id": item_id, "object": "realtime.item", "type": item.get("type")}
    status = item.get("status") or "completed"
    match item.get("type"):
        case "function_call_output":
            kept |= {
                "status": status,
                "call_id": _string(item, "call_id", "item.call_id"),
                "output": _string(item, "output", "item.output"),
            }
            return CreateItem(event_id, kept, previous, kind="function_call_output")
        case "function_call":
            kept |= {
                "status": status,
                "call_id": _string(item, "call_id", "item.call_id"),
                "name": _string(item, "name", "item.name"),
                "arguments": _string(item, "arguments", "item.arguments", required=False),
            }
            return CreateItem(event_id, kept, previous)
        case "message":
            pass
        case other:
            raise RealtimeError(
                "invalid_value", f"items of type {echo(other)} are not supported", param="item.type"
            )
    role = item.get("role")
    if role not in CONTENT_TYPES:
        raise RealtimeError("invalid_value", "item.role must be user, assistant or system", param="item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("invalid_value", "item.content must be a non-empty list", param="item.content")
    parts: list[dict[str, Any]] = []
    audio = bytearray()
    for i, part in enumerate(content):
        kept_part, part_audio = _content(part, i, str(role), fmt)
        parts.append(kept_part)
        audio += part_audio
    kept |= {"status": status, "role": role, "content": parts}
    return CreateItem(event_id, kept, previous, bytes(audio), kind="audio" if audio else "kept")


_PARSERS: Final[dict[str, Callable[[dict[str, Any], str | None, PcmFormat], Command]]] = {
    "session.update": _session_update,
    "input_audio_buffer.append": _append,
    "input_audio_buffer.commit": _commit,
    "input_audio_buffer.clear": _clear,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
    "conversation.item.truncate": _truncate,
    "conversation.item.delete": _delete,
    "conversation.item.retrieve": _retrieve,
    "conversation.item.create": _item_create,
}

#: Every client event type the edge serves.
CLIENT_EVENTS: Final = tuple(_PARSERS)
