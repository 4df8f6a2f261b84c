"""Realtime client events as typed commands, and the edge's view of a session (no I/O).

The OpenAI Realtime API (GA shape) names its events ``session.update``,
``input_audio_buffer.append`` and so on, as JSON text frames. ``parse_client_event`` turns one
frame into a frozen command or raises ``RealtimeError``, which the connection sends back as an
``error`` event in OpenAI's shape (``type``, ``code``, ``message``, ``param``, ``event_id``);
the connection stays up.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from duplex.audio import PCMA_8K, PCMU_8K, S16LE, PcmFormat
from duplex.errors import echo
from duplex.v1 import session_pb2

#: ``audio/pcm``: 16-bit little-endian mono at 24 kHz, the only rate the API names.
PCM24K: Final = PcmFormat(S16LE, 24_000, 1)

#: Realtime format type -> the session service's format.
FORMATS: Final[dict[str, PcmFormat]] = {"audio/pcm": PCM24K, "audio/pcmu": PCMU_8K, "audio/pcma": PCMA_8K}

#: Longest client ``event_id`` echoed back in an ``error`` (as the session service bounds it).
MAX_EVENT_ID_CHARS: Final = 256

#: Bounds of ``turn_detection.silence_duration_ms`` (the session service's).
MIN_SILENCE_MS: Final = 100
MAX_SILENCE_MS: Final = 10_000

#: Session fields a Realtime client may send that the edge accepts and does not act on (their
#: values change nothing here: one voice, no tracing, no token limits). Anything else unknown
#: is refused with ``unknown_parameter``, as OpenAI does.
IGNORED_SESSION_FIELDS: Final = frozenset(
    {
        "type",
        "object",
        "id",
        "model",
        "expires_at",
        "include",
        "max_output_tokens",
        "prompt",
        "tool_choice",
        "tracing",
        "truncation",
        "parallel_tool_calls",
        "reasoning",
        "voice",  # the beta's place for it; GA clients send audio.output.voice
    }
)
IGNORED_INPUT_FIELDS: Final = frozenset({"transcription", "noise_reduction"})
IGNORED_OUTPUT_FIELDS: Final = frozenset({"voice", "speed"})


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
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.type = type

    def to_error(self) -> dict[str, Any]:
        """The ``error`` object of an ``error`` event."""
        return {
            "type": self.type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "event_id": self.event_id,
        }


# ---- commands -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnSetting:
    """``audio.input.turn_detection``: ``server_vad`` (``vad``) or ``null`` (the client commits)."""

    vad: bool
    silence_ms: int = 0
    create_response: bool = True
    interrupt_response: bool = True

    def to_proto(self) -> session_pb2.TurnDetection:
        if not self.vad:
            return session_pb2.TurnDetection(auto_respond=False, barge_in=False)
        return session_pb2.TurnDetection(
            auto_respond=self.create_response, silence_ms=self.silence_ms, barge_in=self.interrupt_response
        )


#: ``audio.input.turn_detection`` when the client has not set it: the API's default.
DEFAULT_TURN: Final = TurnSetting(vad=True)


@dataclass(frozen=True)
class UpdateSession:
    event_id: str | None
    input_format: PcmFormat | None = None
    output_format: PcmFormat | None = None
    turn: TurnSetting | None = None
    instructions: str | None = None
    output_modalities: tuple[str, ...] | None = None


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
class CreateItem:
    """``conversation.item.create`` of what the model can take: a user message of audio (appended
    and committed as a turn) or a function call's output."""

    event_id: str | None
    item_id: str
    audio: bytes = b""
    call_id: str = ""
    output: str = ""
    previous_item_id: str | None = None
    kind: str = field(default="audio")


Command = (
    UpdateSession
    | AppendAudio
    | CommitAudio
    | ClearAudio
    | CreateResponse
    | CancelResponse
    | TruncateItem
    | CreateItem
)

#: Client event types of the API that the edge does not serve (each answered with an error
#: naming it, ``unsupported_event``); any other type is ``unknown_event``.
UNSUPPORTED_EVENTS: Final = frozenset(
    {
        "conversation.item.delete",
        "conversation.item.retrieve",
        "output_audio_buffer.clear",
        "transcription_session.update",
    }
)


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


def _object(value: object, param: str, *, nullable: bool = False) -> dict[str, Any] | None:
    if value is None and nullable:
        return None
    if not isinstance(value, dict):
        raise RealtimeError("invalid_type", f"'{param}' must be an object", param=param)
    return value


def _check_known(obj: dict[str, Any], known: frozenset[str], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise RealtimeError(
                "unknown_parameter", f"unknown parameter '{prefix}.{echo(key)}'", param=f"{prefix}.{key}"
            )


def _string(obj: dict[str, Any], key: str, param: str, *, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RealtimeError("invalid_type", f"'{param}' must be a string", param=param)
    return value


def _int(obj: dict[str, Any], key: str, param: str, *, low: int = 0, high: int = 2**53) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RealtimeError("invalid_type", f"'{param}' must be an integer", param=param)
    if not low <= value <= high:
        raise RealtimeError("invalid_value", f"'{param}' must be within {low}..{high}", param=param)
    return value


def _bool(obj: dict[str, Any], key: str, param: str, default: bool) -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RealtimeError("invalid_type", f"'{param}' must be a boolean", param=param)
    return value


def parse_format(value: object, param: str) -> PcmFormat:
    """A Realtime audio format object to the session service's format."""
    fmt = _object(value, param)
    assert fmt is not None
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in FORMATS:
        raise RealtimeError(
            "invalid_value",
            f"'{param}.type' must be one of {', '.join(FORMATS)} (got {echo(kind)})",
            param=f"{param}.type",
        )
    rate = fmt.get("rate")
    if kind == "audio/pcm" and rate is not None and rate != PCM24K.sample_rate_hz:
        raise RealtimeError(
            "invalid_value", f"'{param}.rate' must be 24000 for audio/pcm", param=f"{param}.rate"
        )
    return FORMATS[kind]


def format_object(fmt: PcmFormat) -> dict[str, Any]:
    """The Realtime format object of a format ``FORMATS`` holds."""
    for kind, known in FORMATS.items():
        if known == fmt:
            return {"type": kind, "rate": fmt.sample_rate_hz} if kind == "audio/pcm" else {"type": kind}
    raise ValueError(f"no Realtime format for {fmt}")


def parse_turn_detection(value: object, param: str) -> TurnSetting:
    if value is None:
        return TurnSetting(vad=False)
    td = _object(value, param)
    assert td is not None
    kind = td.get("type", "server_vad")
    if kind != "server_vad":
        raise RealtimeError(
            "unsupported_turn_detection",
            f"'{param}.type' must be server_vad or the whole field null (got {echo(kind)})",
            param=f"{param}.type",
        )
    silence = 0
    if td.get("silence_duration_ms") is not None:
        silence = _int(
            td, "silence_duration_ms", f"{param}.silence_duration_ms", low=MIN_SILENCE_MS, high=MAX_SILENCE_MS
        )
    return TurnSetting(
        vad=True,
        silence_ms=silence,
        create_response=_bool(td, "create_response", f"{param}.create_response", True),
        interrupt_response=_bool(td, "interrupt_response", f"{param}.interrupt_response", True),
    )


def _session_update(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> UpdateSession:
    session = _object(event.get("session"), "session")
    assert session is not None
    known = IGNORED_SESSION_FIELDS | {"instructions", "output_modalities", "audio", "tools"}
    _check_known(session, known, "session")
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise RealtimeError(
            "unsupported_session_type",
            f"session.type must be realtime (got {echo(kind)})",
            param="session.type",
        )
    if session.get("tools"):
        raise RealtimeError(
            "unsupported_tools",
            "this model calls no tools: session.tools must be empty",
            param="session.tools",
        )
    instructions = (
        _string(session, "instructions", "session.instructions") if "instructions" in session else None
    )
    modalities: tuple[str, ...] | None = None
    if "output_modalities" in session:
        value = session["output_modalities"]
        if not isinstance(value, list) or not value or any(m not in ("audio", "text") for m in value):
            raise RealtimeError(
                "invalid_value",
                "session.output_modalities must be a non-empty list of 'audio' and 'text'",
                param="session.output_modalities",
            )
        modalities = tuple(dict.fromkeys(value))
    input_format = output_format = None
    turn: TurnSetting | None = None
    audio = _object(session.get("audio"), "session.audio", nullable=True) or {}
    _check_known(audio, frozenset({"input", "output"}), "session.audio")
    inp = _object(audio.get("input"), "session.audio.input", nullable=True) or {}
    _check_known(inp, IGNORED_INPUT_FIELDS | {"format", "turn_detection"}, "session.audio.input")
    if inp.get("format") is not None:
        input_format = parse_format(inp["format"], "session.audio.input.format")
    if "turn_detection" in inp:
        turn = parse_turn_detection(inp["turn_detection"], "session.audio.input.turn_detection")
    out = _object(audio.get("output"), "session.audio.output", nullable=True) or {}
    _check_known(out, IGNORED_OUTPUT_FIELDS | {"format"}, "session.audio.output")
    if out.get("format") is not None:
        output_format = parse_format(out["format"], "session.audio.output.format")
    return UpdateSession(event_id, input_format, output_format, turn, instructions, modalities)


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


def _append(event: dict[str, Any], event_id: str | None, fmt: PcmFormat) -> AppendAudio:
    return AppendAudio(event_id, decode_audio(event.get("audio"), "audio", fmt))


def _commit(_event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> CommitAudio:
    return CommitAudio(event_id)


def _clear(_event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> ClearAudio:
    return ClearAudio(event_id)


def _response_create(event: dict[str, Any], event_id: str | None, _fmt: PcmFormat) -> CreateResponse:
    response = _object(event.get("response"), "response", nullable=True) or {}
    if response.get("conversation") == "none":
        raise RealtimeError(
            "unsupported_parameter",
            "out-of-band responses (response.conversation = none) are not supported",
            param="response.conversation",
        )
    if response.get("input"):
        raise RealtimeError(
            "unsupported_parameter",
            "response.input is not supported: the model answers the conversation",
            param="response.input",
        )
    return CreateResponse(event_id)


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


def _item_create(event: dict[str, Any], event_id: str | None, fmt: PcmFormat) -> CreateItem:
    item = _object(event.get("item"), "item")
    assert item is not None
    item_id = _string(item, "id", "item.id", required=False)
    previous = event.get("previous_item_id")
    previous_id = previous if isinstance(previous, str) else None
    kind = item.get("type")
    if kind == "function_call_output":
        return CreateItem(
            event_id,
            item_id,
            call_id=_string(item, "call_id", "item.call_id"),
            output=_string(item, "output", "item.output"),
            previous_item_id=previous_id,
            kind="function_call_output",
        )
    if kind != "message":
        raise RealtimeError(
            "unsupported_item", f"items of type {echo(kind)} are not supported", param="item.type"
        )
    if item.get("role") != "user":
        raise RealtimeError(
            "unsupported_item", "only user messages can be added: the model writes its own", param="item.role"
        )
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("invalid_value", "item.content must be a non-empty list", param="item.content")
    audio = bytearray()
    for i, part in enumerate(content):
        part_obj = _object(part, f"item.content[{i}]")
        assert part_obj is not None
        if part_obj.get("type") != "input_audio":
            raise RealtimeError(
                "unsupported_content",
                "this model takes audio only: content parts must be input_audio",
                param=f"item.content[{i}].type",
            )
        audio += decode_audio(part_obj.get("audio"), f"item.content[{i}].audio", fmt)
    return CreateItem(event_id, item_id, audio=bytes(audio), previous_item_id=previous_id)


_PARSERS: Final[dict[str, Callable[[dict[str, Any], str | None, PcmFormat], Command]]] = {
    "session.update": _session_update,
    "input_audio_buffer.append": _append,
    "input_audio_buffer.commit": _commit,
    "input_audio_buffer.clear": _clear,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
    "conversation.item.truncate": _truncate,
    "conversation.item.create": _item_create,
}

#: Every client event type the edge serves.
CLIENT_EVENTS: Final = tuple(_PARSERS)
