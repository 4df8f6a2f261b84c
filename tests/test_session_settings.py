"""Wire settings to domain settings (``session_service.session.settings``): defaults, inheritance, bounds."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import session_pb2
from session_service.plugin import TurnDetection
from session_service.session.settings import (
    MAX_EXTRA_BODY_BYTES,
    MAX_SILENCE_MS,
    MIN_SILENCE_MS,
    settings_from_proto,
    struct_to_dict,
)

F32_48K = PcmFormat(F32LE, 48000, 2)


def _cfg(**kw: object) -> session_pb2.SessionConfig:
    return session_pb2.SessionConfig(**kw)  # type: ignore[arg-type]


def test_a_new_session_needs_an_input_format_and_takes_the_plugins_turn_defaults() -> None:
    with pytest.raises(BadEventError) as err:
        settings_from_proto(_cfg(), None, require_input=True)
    assert err.value.code == ErrorCode.INVALID_CONFIG
    plugin_turn = TurnDetection(auto_respond=False, silence_ms=700, barge_in=False)
    s = settings_from_proto(
        _cfg(input_format=F32_48K.to_proto()), None, require_input=True, default_turn=plugin_turn
    )
    assert s.input_format == F32_48K and s.turn_detection == plugin_turn
    # The output defaults to the input's rate with the model's encoding (session.proto), mono.
    assert s.output_format == PcmFormat(S16LE, 48000, 1)
    assert s.modalities == ("audio",) and s.idle_timeout_s == 0 and s.instructions == ""


def test_an_update_keeps_what_it_does_not_set() -> None:
    base = settings_from_proto(
        _cfg(input_format=PCM16K_MONO.to_proto(), instructions="be brief", idle_timeout_s=30),
        None,
        require_input=True,
    )
    new = settings_from_proto(
        _cfg(output_format=PcmFormat(S16LE, 24000, 1).to_proto()), base, require_input=False
    )
    assert new.input_format == PCM16K_MONO and new.output_format == PcmFormat(S16LE, 24000, 1)
    assert new.instructions == "be brief" and new.idle_timeout_s == 30
    assert new.turn_detection == base.turn_detection


@pytest.mark.parametrize(
    ("cfg", "code"),
    [
        (
            _cfg(turn_detection=session_pb2.TurnDetection(silence_ms=MIN_SILENCE_MS - 1)),
            ErrorCode.INVALID_CONFIG,
        ),
        (
            _cfg(turn_detection=session_pb2.TurnDetection(silence_ms=MAX_SILENCE_MS + 1)),
            ErrorCode.INVALID_CONFIG,
        ),
        (_cfg(modalities=["audio", "video"]), ErrorCode.INVALID_CONFIG),
        (
            _cfg(input_format=session_pb2.SessionConfig().input_format.__class__(sample_rate_hz=16000)),
            ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        ),
    ],
)
def test_bad_values_get_their_code(cfg: session_pb2.SessionConfig, code: str) -> None:
    base = settings_from_proto(_cfg(input_format=PCM16K_MONO.to_proto()), None, require_input=True)
    with pytest.raises(BadEventError) as err:
        settings_from_proto(cfg, base, require_input=False)
    assert err.value.code == code


def test_silence_bounds_are_inclusive_and_zero_means_the_models_default() -> None:
    base = settings_from_proto(_cfg(input_format=PCM16K_MONO.to_proto()), None, require_input=True)
    for ms in (0, MIN_SILENCE_MS, MAX_SILENCE_MS):
        td = session_pb2.TurnDetection(silence_ms=ms)
        assert (
            settings_from_proto(_cfg(turn_detection=td), base, require_input=False).turn_detection.silence_ms
            == ms
        )


def test_extra_body_size_is_checked_before_conversion() -> None:
    ok = struct_pb2.Struct()
    ok.update({"pitch_semitones": 3.0})
    assert struct_to_dict(ok) == {"pitch_semitones": 3.0}
    big = struct_pb2.Struct()
    big.update({f"k{i}": "v" * 64 for i in range(MAX_EXTRA_BODY_BYTES // 64)})
    with pytest.raises(BadEventError) as err:
        struct_to_dict(big)
    assert err.value.code == "invalid_runtime_config"
