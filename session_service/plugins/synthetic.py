"""The plugin for the "synthetic" worker model: load tests and benchmarks.

The synthetic model (``worker_service.models.synthetic``) has no turn detection: it buffers
what it is sent, COMMIT makes that the utterance, and RESPOND replies with ``reply_frames``
frames of generated audio, one every ``emit_every``-th step. So clients commit and create
responses themselves (``turn_detection`` is advertised as unavailable and sessions default to
``auto_respond=False, barge_in=False``). Its compute cost (hidden size, layers, seed) is fixed
when the worker starts and is never a client's to choose.

Session plumbing (input formats, data plane, frame format, append limits) is the parrot's:
this plugin subclasses ``ParrotPlugin`` and replaces its model policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from duplex.audio import PCM16K_MONO
from duplex.errors import ErrorCode, echo
from session_service.plugin import (
    Capabilities,
    RuntimeConfigError,
    SessionSettings,
    TurnDetection,
    reject_private_runtime_keys,
)
from session_service.plugins.parrot import ParrotPlugin

#: Client-settable options and their inclusive ranges (the worker model's own bounds).
OPTION_RANGES: dict[str, tuple[int, int]] = {
    "emit_every": (1, 1000),
    "reply_frames": (1, 100_000),
}


@dataclass(frozen=True, slots=True)
class SyntheticSampling:
    """The synthetic model's only stage; ``None`` keeps the worker's own default."""

    emit_every: int | None = None
    """A replying request emits audio on every k-th of its steps."""
    reply_frames: int | None = None
    """Frames in one reply."""


class SyntheticPlugin(ParrotPlugin):
    """Session and engine policy for the synthetic model (manual commit / response only)."""

    plugin_id = "synthetic"
    model_id = "synthetic"
    # Server-owned: the model's compute cost and where it comes from.
    private_runtime_config_keys = frozenset(
        {"_worker_params", "model_path", "hidden_size", "layers", "seed", "initial_slots"}
    )
    sampling_defaults: tuple[object, ...] = (SyntheticSampling(),)
    # Free-running: replies advance without input, so no silence is fed during them.
    silence_continuation = False
    # Its reply depends only on the committed input's length and its options: replayable (the
    # parrot's setting, inherited, says so).

    # ---- session policy ----

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        return dataclasses.replace(super().capabilities(max_sessions=max_sessions), turn_detection=False)

    def default_settings(self) -> SessionSettings:
        return SessionSettings(
            input_format=PCM16K_MONO,
            output_format=PCM16K_MONO,
            turn_detection=TurnDetection(auto_respond=False, barge_in=False),
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        reject_private_runtime_keys(extra_body, self.private_runtime_config_keys)
        for key, value in extra_body.items():
            if key == "model":
                continue  # checked by the runner (model changes are refused, not "invalid")
            bounds = OPTION_RANGES.get(key)
            if bounds is None:
                raise RuntimeConfigError(
                    f"unknown extra_body key {echo(key)} (synthetic takes {', '.join(sorted(OPTION_RANGES))})"
                )
            _whole_number(key, value, *bounds)

    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return _merge(dict.fromkeys(OPTION_RANGES), extra_body)

    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        return _merge(dict(current), extra_body)

    # ---- engine policy ----

    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        base = defaults[0] if defaults and isinstance(defaults[0], SyntheticSampling) else SyntheticSampling()
        emit_every = runtime_config.get("emit_every")
        reply_frames = runtime_config.get("reply_frames")
        return (
            SyntheticSampling(
                emit_every=emit_every if isinstance(emit_every, int) else base.emit_every,
                reply_frames=reply_frames if isinstance(reply_frames, int) else base.reply_frames,
            ),
        )

    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        # params replace the session's model options on the worker; a key left out takes the
        # worker's default (its --emit-every / --reply-frames), so only chosen values are sent.
        # No turn-detection keys: the synthetic model has none (and refuses unknown options).
        del settings, runtime_config
        stage = sampling[0]
        assert isinstance(stage, SyntheticSampling)
        params: dict[str, Any] = {}
        if stage.emit_every is not None:
            params["emit_every"] = stage.emit_every
        if stage.reply_frames is not None:
            params["reply_frames"] = stage.reply_frames
        return params


def _whole_number(key: str, value: object, lo: int, hi: int) -> None:
    # Struct numbers arrive as floats: 25.0 is 25, 2.5 is refused.
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise RuntimeConfigError(f"{key} must be a whole number", code=ErrorCode.INVALID_RUNTIME_CONFIG)
    if not lo <= value <= hi:
        raise RuntimeConfigError(f"{key} must be in [{lo}, {hi}], got {value:g}")


def _merge(config: dict[str, object], extra_body: Mapping[str, object]) -> dict[str, object]:
    for key in OPTION_RANGES:
        value = extra_body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            config[key] = int(value)
    return config
