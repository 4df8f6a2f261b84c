"""``session.update`` as a command: what the edge applies, what it keeps to report back, and what
it did not apply (no I/O).

An update applies what it can. A field with a bad value is refused alone (an ``error`` naming
it, ``param``), the rest of the update still applies; a field of the API that this model cannot
act on (input transcription, noise reduction, a voice, tools) is accepted, kept where the API
reports it back (``tools``, ``tool_choice``, ...) and listed as not applied in the
``session.updated`` that answers the update (``session.duplex.not_applied``). Only an update
that is not one at all (no ``session`` object, another session type) is refused whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from duplex.audio import PCMA_8K, PCMU_8K, S16LE, PcmFormat
from duplex.errors import echo
from duplex.v1 import session_pb2
from realtime_service.errors import RealtimeError

#: ``audio/pcm``: 16-bit little-endian mono at 24 kHz, the only rate the API names.
PCM24K: Final = PcmFormat(S16LE, 24_000, 1)

#: Realtime format type -> the session service's format.
FORMATS: Final[dict[str, PcmFormat]] = {"audio/pcm": PCM24K, "audio/pcmu": PCMU_8K, "audio/pcma": PCMA_8K}

#: Bounds of ``turn_detection.silence_duration_ms`` (the session service's).
MIN_SILENCE_MS: Final = 100
MAX_SILENCE_MS: Final = 10_000

#: ``semantic_vad``'s eagerness -> the silence that ends a turn: the model's turn detector is a
#: VAD, and how long it waits after speech is what eagerness means to it (``auto`` is medium).
EAGERNESS_SILENCE_MS: Final = {"low": 1000, "medium": 500, "auto": 500, "high": 300}

#: Read-only fields a client may send back as it got them (no effect).
READ_ONLY_FIELDS: Final = frozenset({"type", "object", "id", "model", "expires_at"})

#: Session fields the edge keeps and reports back but does not act on (no token limits, no
#: tracing here; tools only for a model that calls them: ``capabilities.function_calling``, when
#: ``tools`` and ``tool_choice`` go on to the session); a value other than the API's default is
#: listed as not applied.
STORED_FIELDS: Final[dict[str, object]] = {
    "tools": [],
    "tool_choice": "auto",
    "max_output_tokens": "inf",
    "tracing": None,
    "truncation": None,
    "prompt": None,
    "include": None,
    "reasoning": None,
    "parallel_tool_calls": None,
}

#: Fields of the API this model does not have: accepted, not applied, reported as not in force.
_NOT_HERE: Final = {
    "session.voice": "one voice: the model's own",
    "session.audio.input.transcription": "input audio is not transcribed here",
    "session.audio.input.noise_reduction": "no noise reduction here",
    "session.audio.output.voice": "one voice: the model's own",
    "session.audio.output.speed": "the model speaks at its own speed",
    "session.audio.input.turn_detection.threshold": "the model's VAD keeps its own threshold",
    "session.audio.input.turn_detection.prefix_padding_ms": "the model's VAD keeps its own padding",
    "session.audio.input.turn_detection.idle_timeout_ms": "no idle timeout response here",
}
_DEFAULTS: Final[dict[str, object]] = {"session.audio.output.speed": 1.0}

T = TypeVar("T")


@dataclass(frozen=True)
class TurnSetting:
    """``audio.input.turn_detection``: ``server_vad`` or ``semantic_vad`` (``vad``), or ``null`` /
    ``false`` (the client commits)."""

    vad: bool
    silence_ms: int = 0
    create_response: bool = True
    interrupt_response: bool = True
    kind: str = "server_vad"
    eagerness: str = ""
    """``semantic_vad``'s, as the client gave it (its silence length is ``EAGERNESS_SILENCE_MS``)."""

    def to_proto(self) -> session_pb2.TurnDetection:
        if not self.vad:
            return session_pb2.TurnDetection(auto_respond=False, barge_in=False)
        silence = self.silence_ms
        if self.kind == "semantic_vad":
            silence = EAGERNESS_SILENCE_MS[self.eagerness or "auto"]
        return session_pb2.TurnDetection(
            auto_respond=self.create_response, silence_ms=silence, barge_in=self.interrupt_response
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
    stored: tuple[tuple[str, Any], ...] = ()
    """``STORED_FIELDS`` the update sets, to report back."""
    not_applied: tuple[tuple[str, str], ...] = ()
    """(param, why) of each field accepted with no effect, or refused (why: its error code)."""
    problems: tuple[RealtimeError, ...] = ()
    """The refused fields' errors; the rest of the update applies."""


class _Fields:
    """What one update sets, refuses and does not apply, gathered field by field."""

    def __init__(self) -> None:
        self.problems: list[RealtimeError] = []
        self.not_applied: list[tuple[str, str]] = []

    def take(self, parse: Callable[[], T]) -> T | None:
        """``parse()``, or None (the field refused) when it raises ``RealtimeError``."""
        try:
            return parse()
        except RealtimeError as err:
            self.problems.append(err)
            self.not_applied.append((err.param or "session", err.code))
            return None

    def known(self, obj: dict[str, Any], known: frozenset[str], prefix: str) -> None:
        for key in obj:
            param = f"{prefix}.{key}"
            if param in _NOT_HERE:
                if obj[key] is not None and obj[key] != _DEFAULTS.get(param):
                    self.not_applied.append((param, _NOT_HERE[param]))
            elif key not in known:
                self.take(functools.partial(_unknown, param))


def _unknown(param: str) -> None:
    raise RealtimeError("unknown_parameter", f"unknown parameter '{echo(param)}'", param=param)


def obj(value: object, param: str, *, nullable: bool = False) -> dict[str, Any] | None:
    if value is None and nullable:
        return None
    if not isinstance(value, dict):
        raise RealtimeError("invalid_type", f"'{param}' must be an object", param=param)
    return value


def integer(o: dict[str, Any], key: str, param: str, *, low: int = 0, high: int = 2**53) -> int:
    value = o.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RealtimeError("invalid_type", f"'{param}' must be an integer", param=param)
    if not low <= value <= high:
        raise RealtimeError("invalid_value", f"'{param}' must be within {low}..{high}", param=param)
    return value


def boolean(o: dict[str, Any], key: str, param: str, default: bool) -> bool:
    value = o.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RealtimeError("invalid_type", f"'{param}' must be a boolean", param=param)
    return value


def parse_format(value: object, param: str) -> PcmFormat:
    """A Realtime audio format object to the session service's format."""
    fmt = obj(value, param)
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


def parse_turn_detection(value: object, param: str, fields: _Fields | None = None) -> TurnSetting:
    """``turn_detection``: null or false (off), ``server_vad`` or ``semantic_vad``; raises
    ``RealtimeError``. ``fields`` gathers what is not applied (the VAD's own tuning)."""
    if value is None or value is False:
        return TurnSetting(vad=False)
    td = obj(value, param)
    assert td is not None
    kind = td.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            "invalid_value",
            f"'{param}.type' must be server_vad or semantic_vad (got {echo(kind)})",
            param=f"{param}.type",
        )
    shared = {"type", "create_response", "interrupt_response"}
    own = {"silence_duration_ms"} if kind == "server_vad" else {"eagerness"}
    if fields is not None:
        fields.known(td, frozenset(shared | own), param)
    silence = 0
    eagerness = ""
    if kind == "server_vad" and td.get("silence_duration_ms") is not None:
        silence = integer(
            td, "silence_duration_ms", f"{param}.silence_duration_ms", low=MIN_SILENCE_MS, high=MAX_SILENCE_MS
        )
    if kind == "semantic_vad":
        eagerness = td.get("eagerness") or "auto"
        if eagerness not in EAGERNESS_SILENCE_MS:
            raise RealtimeError(
                "invalid_value",
                f"'{param}.eagerness' must be one of {', '.join(EAGERNESS_SILENCE_MS)}",
                param=f"{param}.eagerness",
            )
    return TurnSetting(
        vad=True,
        silence_ms=silence,
        create_response=boolean(td, "create_response", f"{param}.create_response", True),
        interrupt_response=boolean(td, "interrupt_response", f"{param}.interrupt_response", True),
        kind=kind,
        eagerness=eagerness,
    )


def _instructions(session: dict[str, Any]) -> str:
    value = session["instructions"]
    if not isinstance(value, str):
        raise RealtimeError(
            "invalid_type", "'session.instructions' must be a string", param="session.instructions"
        )
    return value


def _modalities(session: dict[str, Any]) -> tuple[str, ...]:
    value = session["output_modalities"]
    if not isinstance(value, list) or not value or any(m not in ("audio", "text") for m in value):
        raise RealtimeError(
            "invalid_value",
            "session.output_modalities must be a non-empty list of 'audio' and 'text'",
            param="session.output_modalities",
        )
    return tuple(dict.fromkeys(value))


def _stored(session: dict[str, Any], key: str) -> Any:
    value = session[key]
    if key == "tools" and value is not None and not isinstance(value, list):
        raise RealtimeError("invalid_type", "'session.tools' must be a list", param="session.tools")
    return value


def parse_session_update(event: dict[str, Any], event_id: str | None) -> UpdateSession:
    """``session.update`` to a command; raises ``RealtimeError`` only for an update that is not
    one (the rest is gathered in ``problems`` and ``not_applied``)."""
    session = obj(event.get("session"), "session")
    assert session is not None
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise RealtimeError(
            "unsupported_session_type",
            f"session.type must be realtime (got {echo(kind)})",
            param="session.type",
        )
    f = _Fields()
    f.known(
        session,
        READ_ONLY_FIELDS | STORED_FIELDS.keys() | {"instructions", "output_modalities", "audio"},
        "session",
    )
    instructions = f.take(lambda: _instructions(session)) if "instructions" in session else None
    modalities = f.take(lambda: _modalities(session)) if "output_modalities" in session else None
    stored: list[tuple[str, Any]] = []
    for key, default in STORED_FIELDS.items():
        if key not in session:
            continue
        value = f.take(functools.partial(_stored, session, key))
        if value is None and session[key] is not None:
            continue  # refused
        stored.append((key, value))
        if value not in (None, default):
            why = (
                "kept; this model calls no tools"
                if key.startswith(("tool", "parallel"))
                else "kept; no effect here"
            )
            f.not_applied.append((f"session.{key}", why))

    input_format = output_format = None
    turn: TurnSetting | None = None
    audio = f.take(lambda: obj(session.get("audio"), "session.audio", nullable=True)) or {}
    f.known(audio, frozenset({"input", "output"}), "session.audio")
    inp = f.take(lambda: obj(audio.get("input"), "session.audio.input", nullable=True)) or {}
    f.known(inp, frozenset({"format", "turn_detection"}), "session.audio.input")
    if inp.get("format") is not None:
        input_format = f.take(lambda: parse_format(inp["format"], "session.audio.input.format"))
    if "turn_detection" in inp:
        param = "session.audio.input.turn_detection"
        turn = f.take(lambda: parse_turn_detection(inp["turn_detection"], param, f))
    out = f.take(lambda: obj(audio.get("output"), "session.audio.output", nullable=True)) or {}
    f.known(out, frozenset({"format"}), "session.audio.output")
    if out.get("format") is not None:
        output_format = f.take(lambda: parse_format(out["format"], "session.audio.output.format"))
    for err in f.problems:
        err.event_id = event_id
    return UpdateSession(
        event_id,
        input_format,
        output_format,
        turn,
        instructions,
        modalities,
        stored=tuple(stored),
        not_applied=tuple(dict.fromkeys(f.not_applied)),
        problems=tuple(f.problems),
    )


@dataclass
class Settings:
    """The session's effective settings as the edge reports them."""

    input_format: PcmFormat
    output_format: PcmFormat
    turn: TurnSetting = DEFAULT_TURN
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    stored: dict[str, Any] = field(default_factory=lambda: dict(STORED_FIELDS))
    """``STORED_FIELDS`` as the client last set them."""


def turn_from_proto(td: session_pb2.TurnDetection, known: TurnSetting) -> TurnSetting:
    """The turn detection the session service reports, as the client named it (``known``)."""
    if not known.vad:
        return TurnSetting(vad=False)
    return TurnSetting(
        vad=True,
        silence_ms=td.silence_ms,
        create_response=td.auto_respond,
        interrupt_response=td.barge_in,
        kind=known.kind,
        eagerness=known.eagerness,
    )


def turn_object(turn: TurnSetting) -> dict[str, Any] | None:
    """``audio.input.turn_detection`` as the session object reports it."""
    if not turn.vad:
        return None
    td: dict[str, Any] = {
        "type": turn.kind,
        "create_response": turn.create_response,
        "interrupt_response": turn.interrupt_response,
    }
    if turn.kind == "semantic_vad":
        td["eagerness"] = turn.eagerness or "auto"
    else:
        td["silence_duration_ms"] = turn.silence_ms or None
    return td


_TRANSCRIPTION: Final = "session.audio.input.transcription"
_TOOLS: Final = ("session.tools", "session.tool_choice")


def session_object(
    s: Settings,
    session_id: str,
    model: str,
    caps: session_pb2.Capabilities,
    not_applied: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """The session as ``session.created``/``session.updated`` report it: what is in force, and in
    ``duplex`` (a field of this server's own) what the model can take and, answering an update,
    what of it was not applied."""
    native = caps.turn_policy == session_pb2.TURN_POLICY_MODEL_NATIVE
    duplex: dict[str, Any] = {
        "capabilities": {
            "input": ["audio"],
            "output_modalities": list(caps.modalities) or list(s.output_modalities),
            "function_calling": caps.function_calling,
            "input_transcription": caps.input_transcription,
            "turn_detection": ["semantic_vad"]
            if native
            else ["server_vad", "semantic_vad"]
            if caps.turn_detection
            else [],
            "kept_not_heard": ["input_text", "input_image", "assistant_message", "system_message"],
        },
    }
    turn = turn_object(s.turn)
    if native:
        # The API's nearest word for it: the model itself judges when the user is done (and when
        # to stop); nothing of it can be set (duplex's turn_policy: model_native).
        turn = {
            "type": "semantic_vad",
            "eagerness": "auto",
            "create_response": True,
            "interrupt_response": True,
        }
    elif s.turn.vad:
        duplex["turn_detection"] = {"silence_duration_ms": s.turn.to_proto().silence_ms or None}
    if caps.input_transcription:  # it transcribes whatever the client asked: not "not applied"
        not_applied = tuple((p, why) for p, why in not_applied if not p.startswith(_TRANSCRIPTION))
    if caps.function_calling:  # its session takes the tools (and says so if it refuses them)
        not_applied = tuple((p, why) for p, why in not_applied if p not in _TOOLS)
    if not_applied:
        duplex["not_applied"] = [{"param": p, "reason": why} for p, why in not_applied]
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "audio": {
            "input": {
                "format": format_object(s.input_format),
                "turn_detection": turn,
                # The model's own recognizer (the user's words come whatever was asked).
                "transcription": {"model": model} if caps.input_transcription else None,
                "noise_reduction": None,
            },
            "output": {"format": format_object(s.output_format), "voice": model, "speed": 1.0},
        },
        **s.stored,
        "duplex": duplex,
    }
