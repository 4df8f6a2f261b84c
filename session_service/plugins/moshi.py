"""The Moshi family's plugin: model-native full duplex (the worker's ``--model moshi``).

The model decides itself when to speak (``model_native``): the session feeds it every frame of
input, the client's audio or real-time silence when the client sends none
(``silence_continuation``), and each of its speech spans is a response with its audio and the
text it thinks aloud (as ``transcript_delta``). Commit, clear, ``response_create`` and
``barge_in`` presume turns and are refused with ``unsupported_by_model``; a ``response_cancel``
silences the current span until the model falls silent. Its state is the whole conversation, so
it is not replayable: a lost worker resets the model's context (``context_reset``).

Sampling is the worker's (``duplex worker --model moshi --temperature T --top-k K``): one
``LMGen`` steps the whole batch of slots, so there are no per-session model options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from duplex.audio import F32LE, PCMA_8K, PCMU_8K, S16LE, SUPPORTED_RATES, PcmFormat
from duplex.errors import echo
from session_service.plugin import (
    Capabilities,
    DuplexModelPlugin,
    PcmDataPlane,
    RuntimeConfigError,
    SessionSettings,
    TurnDetection,
    reject_private_runtime_keys,
)

PCM24K_MONO = PcmFormat(S16LE, 24000, 1)


class MoshiPlugin(DuplexModelPlugin):
    """Session and engine policy for Moshi-layout models served by the worker's moshi model."""

    plugin_id = "moshi"
    model_id = "moshi"
    private_runtime_config_keys = frozenset({"_worker_params", "model_path", "checkpoint", "temperature"})
    worker_format = PCM24K_MONO
    frame_samples = 1920  # 80 ms: Mimi's frame
    sampling_defaults: tuple[object, ...] = (None,)  # the worker's own (one LMGen for the batch)
    max_append_bytes = 256 * 1024
    model_native = True
    silence_continuation = True
    replayable = False

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
            turn_detection=False,
        )

    def default_settings(self) -> SessionSettings:
        return SessionSettings(
            input_format=PCM24K_MONO,
            output_format=PCM24K_MONO,
            turn_detection=TurnDetection(auto_respond=False, barge_in=False),
            modalities=("audio", "text"),
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        reject_private_runtime_keys(extra_body, self.private_runtime_config_keys)
        for key in extra_body:
            if key != "model":  # checked by the runner (model changes are refused, not "invalid")
                raise RuntimeConfigError(
                    f"unknown extra_body key {echo(key)} (moshi takes none: sampling is the worker's)"
                )

    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return {}

    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return dict(current)

    # ---- engine policy ----

    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        return defaults

    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        return {}
