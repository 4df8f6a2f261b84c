"""The cascade: a speech model in three stages, each on its own workers (ASR -> responder -> TTS).

The worked example of a plugin served in stages (``DuplexModelPlugin.stages``):

- ``asr`` (the worker's ``--model asr``): the session's audio goes to it, as to any model. Silero
  VAD ends turns (as the parrot's does) and PocketSphinx recognizes the user's words: they reach
  the client as they are heard (``transcript_delta{role="user"}``) and whole at the turn's end
  (``input_transcribed``). It never replies; its input is replayed on another worker if its
  worker is lost, as the parrot's is.
- ``responder`` (``--model responder``): the turn's transcript in, the reply's text out, a word
  at a time. Built in and deterministic ("You said: ..."); a language model stage implements the
  same interface (``worker_service.models.responder.TextResponder``).
- ``tts`` (``--model tts``): the reply's text in, sentence by sentence as the responder writes it
  (``forward_text``), speech out (eSpeak NG, in process), each sentence's text with its first
  frame of audio (``transcript_delta{role="assistant"}``, in step with what is heard).

Options (``extra_body``, at open or in ``session.update``): ``silence_ms`` (the silence that ends
a turn), ``voice`` and ``wpm`` (the speech synthesizer's voice and pace), ``overlap_turns`` (the
contract's concurrent turns: once the reply's text is written, the user's next turn is heard and
answered after it without cancelling it; off: speech barges in as on any model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from duplex.audio import F32LE, PCM16K_MONO, PCMA_8K, PCMU_8K, S16LE, SUPPORTED_RATES, PcmFormat
from duplex.errors import ErrorCode, echo
from session_service.plugin import (
    Capabilities,
    DuplexModelPlugin,
    Flow,
    PcmDataPlane,
    RuntimeConfigError,
    SessionSettings,
    Stage,
    TurnDetection,
    reject_private_runtime_keys,
)

SILENCE_MS_RANGE = (100, 5000)
WPM_RANGE = (80, 450)
DEFAULT_SILENCE_MS = 500
DEFAULT_VOICE = "en-us"
DEFAULT_WPM = 160
MAX_VOICE_CHARS = 32

STAGES = (
    Stage("asr", "asr", takes=Flow.AUDIO, gives=Flow.TEXT, responds=False),
    Stage("responder", "responder", takes=Flow.TEXT, gives=Flow.TEXT),
    Stage("tts", "tts", takes=Flow.TEXT, gives=Flow.AUDIO),
)


@dataclass(frozen=True, slots=True)
class Voice:
    """The TTS stage's sampling: how the reply is spoken."""

    voice: str = DEFAULT_VOICE
    wpm: int = DEFAULT_WPM


class CascadePlugin(DuplexModelPlugin):
    """Session and engine policy of the ASR -> responder -> TTS cascade."""

    plugin_id = "cascade"
    model_id = "asr"
    private_runtime_config_keys = frozenset({"_worker_params", "model_path", "skip_samples"})
    worker_format = PCM16K_MONO
    frame_samples = 512
    stages = STAGES
    sampling_defaults: tuple[object, ...] = (None, None, Voice())
    max_append_bytes = 256 * 1024
    # Its first stage is the parrot's turn detection: its state is a function of its recent input.
    replayable = True
    replay_window_s = 15.0

    def __init__(self) -> None:
        self.data_plane = PcmDataPlane()

    # ---- session policy ----

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        formats = (
            *(PcmFormat(e, rate, ch) for e in (S16LE, F32LE) for rate in SUPPORTED_RATES for ch in (1, 2)),
            *(PCMU_8K, PCMA_8K),
        )
        return Capabilities(
            model=self.plugin_id,
            input_formats=formats,
            output_format=self.worker_format,
            modalities=("audio", "text"),
            max_sessions=max_sessions,
            max_append_bytes=self.max_append_bytes,
            turn_detection=True,
            input_transcription=True,
        )

    def default_settings(self) -> SessionSettings:
        return SessionSettings(
            input_format=PCM16K_MONO,
            output_format=PCM16K_MONO,
            turn_detection=TurnDetection(),
            modalities=("audio", "text"),
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        reject_private_runtime_keys(extra_body, self.private_runtime_config_keys)
        for key, value in extra_body.items():
            if key == "model":
                continue  # checked by the runner (model changes are refused, not "invalid")
            if key == "silence_ms":
                _number(key, value, *SILENCE_MS_RANGE)
            elif key == "wpm":
                _number(key, value, *WPM_RANGE)
            elif key == "voice":
                if not isinstance(value, str) or not 0 < len(value) <= MAX_VOICE_CHARS:
                    raise RuntimeConfigError(
                        f"voice must be an eSpeak NG voice name of 1..{MAX_VOICE_CHARS} characters"
                    )
                if not value.replace("-", "").replace("+", "").isalnum():
                    raise RuntimeConfigError(f"voice {echo(value)} is not an eSpeak NG voice name")
            elif key == "overlap_turns":
                if not isinstance(value, bool):
                    raise RuntimeConfigError("overlap_turns must be true or false")
            else:
                raise RuntimeConfigError(
                    f"unknown extra_body key {echo(key)} "
                    "(cascade takes silence_ms, voice, wpm, overlap_turns)"
                )

    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return self.runtime_config_for_update(settings, {}, extra_body)

    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        config = dict(current)
        for key in ("silence_ms", "voice", "wpm", "overlap_turns"):
            if key in extra_body:
                value = extra_body[key]
                config[key] = (
                    round(value) if key in ("silence_ms", "wpm") and isinstance(value, float) else value
                )
        return config

    # ---- engine policy ----

    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        base = defaults[2] if len(defaults) == 3 and isinstance(defaults[2], Voice) else Voice()
        voice = runtime_config.get("voice", base.voice)
        wpm = runtime_config.get("wpm", base.wpm)
        return (
            None,
            None,
            Voice(
                voice if isinstance(voice, str) else base.voice,
                int(wpm) if isinstance(wpm, int) else base.wpm,
            ),
        )

    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        silence = runtime_config.get("silence_ms")
        if not isinstance(silence, int):
            silence = settings.turn_detection.silence_ms or DEFAULT_SILENCE_MS
        return {"silence_ms": silence, "auto_commit": settings.turn_detection.auto_respond}

    def stage_params(
        self,
        stage: Stage,
        *,
        settings: SessionSettings,
        runtime_config: Mapping[str, object],
        sampling: object,
    ) -> dict[str, Any]:
        if stage.name == "tts" and isinstance(sampling, Voice):
            return {"voice": sampling.voice, "wpm": sampling.wpm}
        return {}

    def draining_stages(self, runtime_config: Mapping[str, object]) -> frozenset[str]:
        return frozenset({"tts"}) if runtime_config.get("overlap_turns") is True else frozenset()


def _number(key: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RuntimeConfigError(f"{key} must be a number", code=ErrorCode.INVALID_RUNTIME_CONFIG)
    if not lo <= value <= hi:
        raise RuntimeConfigError(f"{key} must be in [{lo:g}, {hi:g}], got {value:g}")
