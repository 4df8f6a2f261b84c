"""Session settings between the wire and the domain: ``SessionConfig`` and ``extra_body``.

Used by opens (``sessions``) and updates (``runner``); every bad value raises a
``BadEventError`` with a stable code, which an open turns into a call-ending status and an
update into an error event. Client values quoted in a message are bounded and escaped
(``duplex.errors.echo``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from google.protobuf import struct_pb2

from duplex.audio import PCM16K_MONO, PcmFormat
from duplex.errors import BadEventError, ErrorCode, echo
from duplex.v1 import session_pb2
from session_service.plugin import Capabilities, SessionSettings, TurnDetection

#: Bounds of ``turn_detection.silence_ms`` (checked here so a bad value fails the open or
#: update with a clear code instead of a worker rejection later).
MIN_SILENCE_MS = 100
MAX_SILENCE_MS = 10_000

#: Largest ``extra_body`` accepted. Checked on the wire size (computed in C) before the
#: pure-Python conversion, which a huge Struct would otherwise run on the event loop.
MAX_EXTRA_BODY_BYTES = 16 * 1024

#: Deepest nesting of objects and lists in ``extra_body`` (the body itself is level 1). The
#: wire already refuses about 32 levels (protobuf's limit of 100 nested messages; a Struct
#: level takes three); no model option needs more than a few.
MAX_EXTRA_BODY_DEPTH = 16

#: Largest ``instructions``: bytes of their JSON string encoding in UTF-8, what the resume
#: token stores (``"``, ``\`` and control characters count as their escapes: ``\n`` 2 bytes,
#: ``\u0000`` 6). With it, a session's whole state fits in a resume token
#: (``session_service.trust.resume_tokens.MAX_TOKEN_CHARS``) for principals of up to 1 KiB and the longest
#: worker ids; tests hold a maximal session to that.
MAX_INSTRUCTIONS_BYTES = 4096

#: Output modalities a client may ask for (the plugin's capabilities narrow them).
MODALITIES = ("audio", "text")


def settings_from_proto(
    cfg: session_pb2.SessionConfig,
    base: SessionSettings | None,
    *,
    require_input: bool,
    default_turn: TurnDetection | None = None,
    capabilities: Capabilities | None = None,
    default_modalities: tuple[str, ...] = ("audio",),
) -> SessionSettings:
    """Domain settings from a wire config; unset fields keep ``base`` (or, for a new session,
    the plugin's defaults: ``default_turn``, ``default_modalities``). ``capabilities`` (the
    plugin's) bound what may be asked for: input formats, modalities, turn detection, and the
    output's default encoding. Raises BadEventError."""
    if cfg.HasField("input_format"):
        input_format = PcmFormat.from_proto(cfg.input_format)
        if capabilities is not None and input_format not in capabilities.input_formats:
            raise BadEventError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                f"{capabilities.model} does not take {input_format} input (see capabilities.input_formats)",
            )
    elif base is not None and not require_input:
        input_format = base.input_format
    else:
        raise BadEventError(ErrorCode.INVALID_CONFIG, "config.input_format is required")
    if cfg.HasField("output_format"):
        output_format = PcmFormat.from_proto(cfg.output_format)
    elif base is not None and not require_input:
        output_format = base.output_format
    else:
        # Default (session.proto): the input's rate with the model's encoding, mono.
        model = capabilities.output_format if capabilities is not None else PCM16K_MONO
        output_format = PcmFormat(model.encoding, input_format.sample_rate_hz, 1)
    if capabilities is not None and capabilities.model_native:
        # The model takes turns itself: a turn detection asked for (a Realtime client's default
        # server_vad, say) has nothing to apply to; ``opened`` says the policy instead.
        turn = TurnDetection(auto_respond=False, barge_in=False)
    elif cfg.HasField("turn_detection"):
        td = cfg.turn_detection
        if td.silence_ms and not MIN_SILENCE_MS <= td.silence_ms <= MAX_SILENCE_MS:
            raise BadEventError(
                ErrorCode.INVALID_CONFIG,
                "turn_detection.silence_ms must be 0 (the model's default) "
                f"or in [{MIN_SILENCE_MS}, {MAX_SILENCE_MS}]",
            )
        turn = TurnDetection(auto_respond=td.auto_respond, silence_ms=td.silence_ms, barge_in=td.barge_in)
        if turn.auto_respond and capabilities is not None and not capabilities.turn_detection:
            raise BadEventError(
                ErrorCode.INVALID_CONFIG,
                f"{capabilities.model} has no server turn detection: "
                "set turn_detection.auto_respond=false and commit yourself",
            )
    else:
        turn = base.turn_detection if base is not None else (default_turn or TurnDetection())
    modalities = _modalities(cfg.modalities, capabilities)
    if cfg.instructions:
        check_instructions(cfg.instructions)
    return SessionSettings(
        input_format=input_format,
        output_format=output_format,
        instructions=cfg.instructions or (base.instructions if base else ""),
        turn_detection=turn,
        modalities=modalities or (base.modalities if base else default_modalities),
        idle_timeout_s=cfg.idle_timeout_s or (base.idle_timeout_s if base else 0),
    )


def _modalities(asked: Sequence[str], capabilities: Capabilities | None) -> tuple[str, ...]:
    """The modalities a config asks for (empty: unchanged), each known, offered by the model
    (``capabilities.modalities``) and named once."""
    offered = capabilities.modalities if capabilities is not None else MODALITIES
    seen: list[str] = []
    for m in asked:
        if m not in MODALITIES:
            raise BadEventError(
                ErrorCode.INVALID_CONFIG, f"unknown modality {echo(m)} (known: {', '.join(MODALITIES)})"
            )
        if m not in offered:
            model = capabilities.model if capabilities is not None else "the model"
            raise BadEventError(
                ErrorCode.INVALID_CONFIG,
                f"{model} cannot produce {m} (capabilities.modalities: {', '.join(offered)})",
            )
        if m in seen:
            raise BadEventError(ErrorCode.INVALID_CONFIG, f"modality {m} is listed twice")
        seen.append(m)
    return tuple(seen)


def instructions_size(text: str) -> int:
    """The size ``MAX_INSTRUCTIONS_BYTES`` bounds: bytes of ``text`` as a JSON string (UTF-8,
    without the quotes)."""
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


def check_instructions(text: str) -> None:
    """Refuse instructions over ``MAX_INSTRUCTIONS_BYTES`` (``invalid_config``)."""
    if len(text) * 6 <= MAX_INSTRUCTIONS_BYTES:
        return  # no character takes more than 6 bytes (a JSON \u escape; UTF-8 needs at most 4)
    # Past the limit in characters already: not encoded (a huge string costs nothing more).
    long = len(text) > MAX_INSTRUCTIONS_BYTES
    size = len(text) if long else instructions_size(text)
    if size > MAX_INSTRUCTIONS_BYTES:
        raise BadEventError(
            ErrorCode.INVALID_CONFIG,
            f"instructions take {'at least ' if long else ''}{size} bytes; the limit is "
            f'{MAX_INSTRUCTIONS_BYTES} (UTF-8, with ", \\ and control characters counted as '
            "their JSON escapes: 2 or 6 bytes)",
        )


def struct_to_dict(s: struct_pb2.Struct) -> dict[str, object]:
    """A client Struct as a dict of plain JSON values (numbers as floats); raises
    ``invalid_runtime_config`` when it is too large, nested too deeply or holds a number that is
    not finite (NaN, Infinity: nothing downstream can carry them, JSON included)."""
    size = s.ByteSize()
    if size > MAX_EXTRA_BODY_BYTES:
        raise BadEventError(
            ErrorCode.INVALID_RUNTIME_CONFIG,
            f"extra_body is {size} bytes; the limit is {MAX_EXTRA_BODY_BYTES}",
        )
    return _struct(s, 1, "extra_body")


def _struct(s: struct_pb2.Struct, depth: int, path: str) -> dict[str, object]:
    if depth > MAX_EXTRA_BODY_DEPTH:
        raise _too_deep()
    return {key: _value(v, depth, f"{path}.{key}" if depth == 1 else path) for key, v in s.fields.items()}


def _value(v: struct_pb2.Value, depth: int, path: str) -> object:
    """One Struct value; ``path`` names the top-level key it is under (for messages)."""
    kind = v.WhichOneof("kind")
    if kind == "number_value":
        x = v.number_value
        if not math.isfinite(x):
            raise BadEventError(
                ErrorCode.INVALID_RUNTIME_CONFIG,
                f"{echo(path)} holds {x}: extra_body numbers must be finite",
            )
        return x
    if kind == "string_value":
        return v.string_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "struct_value":
        return _struct(v.struct_value, depth + 1, path)
    if kind == "list_value":
        if depth + 1 > MAX_EXTRA_BODY_DEPTH:
            raise _too_deep()
        return [_value(x, depth + 1, path) for x in v.list_value.values]
    return None  # null_value, or a Value with nothing set (JSON null, as json_format reads it)


def _too_deep() -> BadEventError:
    return BadEventError(
        ErrorCode.INVALID_RUNTIME_CONFIG,
        f"extra_body is nested more than {MAX_EXTRA_BODY_DEPTH} levels deep",
    )
