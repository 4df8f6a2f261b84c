"""The reference plugin: drives the "parrot" worker model (Silero VAD turns, pitch-shifted echo)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from duplex.audio import F32LE, PCM16K_MONO, PCMA_8K, PCMU_8K, S16LE, SUPPORTED_RATES, PcmFormat
from duplex.errors import ErrorCode, echo
from session_service.plugin import (
    Capabilities,
    DuplexModelPlugin,
    PcmDataPlane,
    RuntimeConfigError,
    SessionSettings,
    TurnDetection,
    reject_private_runtime_keys,
)

PITCH_RANGE = (-12.0, 12.0)
SILENCE_MS_RANGE = (100, 5000)
DEFAULT_PITCH = 4.0
DEFAULT_SILENCE_MS = 500


@dataclass(frozen=True, slots=True)
class ParrotSampling:
    """The parrot's only stage: how the reply is altered."""

    pitch_semitones: float = DEFAULT_PITCH
    """Pitch shift of the echoed utterance."""


class ParrotPlugin(DuplexModelPlugin):
    """Session and engine policy for the parrot model."""

    plugin_id = "parrot"
    model_id = "parrot"
    # Server-owned knobs: a client must not point the worker elsewhere or rewrite its options.
    private_runtime_config_keys = frozenset({"_worker_params", "model_path", "auto_commit", "threshold"})
    worker_format = PCM16K_MONO
    frame_samples = 512
    sampling_defaults: tuple[object, ...] = (ParrotSampling(),)
    max_append_bytes = 256 * 1024
    # The parrot worker model is lockstep: one reply frame per input frame.
    silence_continuation = True
    # Its state (VAD, uncommitted input, the committed utterance) is a function of its recent
    # input: replaying that input on another worker rebuilds it. It keeps at most 15 s of
    # utterance, so 15 s of each (committed, and since) is enough, and a replay of both stays
    # within the worker's per-request input queue (1024 frames, ~33 s).
    replayable = True
    replay_window_s = 15.0

    def __init__(self) -> None:
        self.data_plane = PcmDataPlane()

    # ---- session policy ----

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        formats = (
            *(PcmFormat(e, rate, ch) for e in (S16LE, F32LE) for rate in SUPPORTED_RATES for ch in (1, 2)),
            *(PCMU_8K, PCMA_8K),  # telephone audio, converted where the PCM formats are
        )
        return Capabilities(
            model=self.plugin_id,
            input_formats=formats,
            output_format=self.worker_format,
            modalities=("audio",),
            max_sessions=max_sessions,
            max_append_bytes=self.max_append_bytes,
            turn_detection=True,
        )

    def default_settings(self) -> SessionSettings:
        return SessionSettings(
            input_format=PCM16K_MONO, output_format=PCM16K_MONO, turn_detection=TurnDetection()
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        reject_private_runtime_keys(extra_body, self.private_runtime_config_keys)
        for key, value in extra_body.items():
            if key == "model":
                continue  # checked by the runner (model changes are refused, not "invalid")
            if key == "pitch_semitones":
                _number(key, value, *PITCH_RANGE)
            elif key == "silence_ms":
                _number(key, value, *SILENCE_MS_RANGE)
            else:
                raise RuntimeConfigError(
                    f"unknown extra_body key {echo(key)} (parrot takes pitch_semitones, silence_ms)"
                )

    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        config: dict[str, object] = {"pitch_semitones": DEFAULT_PITCH, "silence_ms": None}
        return self._merge(config, extra_body)

    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return self._merge(dict(current), extra_body)

    @staticmethod
    def _merge(config: dict[str, object], extra_body: Mapping[str, object]) -> dict[str, object]:
        for key in ("pitch_semitones", "silence_ms"):
            if key in extra_body:
                value = extra_body[key]
                assert isinstance(value, int | float)
                config[key] = float(value) if key == "pitch_semitones" else round(value)
        return config

    # ---- engine policy ----

    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        base = defaults[0] if defaults and isinstance(defaults[0], ParrotSampling) else ParrotSampling()
        pitch = runtime_config.get("pitch_semitones", base.pitch_semitones)
        return (ParrotSampling(float(pitch) if isinstance(pitch, int | float) else base.pitch_semitones),)

    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        stage = sampling[0]
        assert isinstance(stage, ParrotSampling)
        silence = runtime_config.get("silence_ms")
        if not isinstance(silence, int):
            silence = settings.turn_detection.silence_ms or DEFAULT_SILENCE_MS
        return {
            "pitch_semitones": stage.pitch_semitones,
            "silence_ms": silence,
            "auto_commit": settings.turn_detection.auto_respond,
        }


def _number(key: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RuntimeConfigError(f"{key} must be a number", code=ErrorCode.INVALID_RUNTIME_CONFIG)
    if not lo <= value <= hi:
        raise RuntimeConfigError(f"{key} must be in [{lo:g}, {hi:g}], got {value:g}")
