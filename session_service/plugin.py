"""The duplex model plugin contract, its loader, and the PCM append buffer most plugins share.

One plugin object per model binds session policy (capabilities, client ``extra_body``
validation, runtime config, per-session model state) and engine policy (sampling params,
append planning into worker submissions, output decisions, data-plane projection, model
context commits), so the two halves cannot disagree. The model itself runs in a worker that
advertises a ``model_id``; the plugin refuses any other.
"""

from __future__ import annotations

import copy
import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from google.protobuf import struct_pb2

from duplex.audio import PCM16K_MONO, PcmFormat, StreamConverter
from duplex.errors import BadEventError, BadRequestError, ErrorCode
from duplex.v1 import common_pb2, session_pb2, worker_pb2

# ---------------------------------------------------------------------------------------------
# Errors


class RuntimeConfigError(BadEventError):
    """A plugin rejected client-visible runtime configuration (an error event, or a bad open)."""

    def __init__(self, message: str, *, code: ErrorCode | str = ErrorCode.INVALID_RUNTIME_CONFIG) -> None:
        super().__init__(code, message)


class PluginLoadError(BadRequestError):
    """The plugin path cannot be loaded or the plugin breaks its contract."""

    def __init__(self, message: str, *, code: ErrorCode | str = ErrorCode.INVALID_CONFIG) -> None:
        super().__init__(code, message)


def reject_private_runtime_keys(extra_body: Mapping[str, object], private_keys: frozenset[str]) -> None:
    """Refuse keys the plugin reserves for itself (code ``private_runtime_key``)."""
    found = sorted(private_keys.intersection(extra_body))
    if found:
        raise RuntimeConfigError(
            "extra_body may not set private runtime keys: " + ", ".join(found),
            code=ErrorCode.PRIVATE_RUNTIME_KEY,
        )


# ---------------------------------------------------------------------------------------------
# Domain types the plugin speaks


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a model can do; sent to clients in ``opened``."""

    model: str
    """The plugin id."""
    input_formats: tuple[PcmFormat, ...]
    """Client input formats accepted (converted to the worker format on the way in)."""
    output_format: PcmFormat
    """The model's native output format."""
    modalities: tuple[str, ...]
    """Output modalities the model can produce."""
    max_sessions: int
    """Sessions this replica accepts."""
    max_append_bytes: int
    """Largest append chunk accepted, in bytes."""
    turn_detection: bool
    """Whether server turn detection is available."""

    def to_proto(self) -> session_pb2.Capabilities:
        return session_pb2.Capabilities(
            model=self.model,
            input_formats=[f.to_proto() for f in self.input_formats],
            output_format=self.output_format.to_proto(),
            modalities=list(self.modalities),
            max_sessions=self.max_sessions,
            max_append_bytes=self.max_append_bytes,
            turn_detection=self.turn_detection,
        )


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """Server turn detection settings of a session."""

    auto_respond: bool = True
    """End the user's turn on silence and respond without a client commit."""
    silence_ms: int = 0
    """Silence that ends a turn (0 = the model's default)."""
    barge_in: bool = True
    """User speech during a response cancels it."""


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """The client-visible settings of one session (the domain form of ``SessionConfig``)."""

    input_format: PcmFormat
    """Format of client appends."""
    output_format: PcmFormat
    """Format of audio sent to the client."""
    instructions: str = ""
    """Free-form model instructions (locked after the first response)."""
    turn_detection: TurnDetection = field(default_factory=TurnDetection)
    """Server turn detection."""
    modalities: tuple[str, ...] = ("audio",)
    """Output modalities."""
    idle_timeout_s: int = 0
    """Idle timeout requested by the client (0 = server default)."""

    def to_proto(self) -> session_pb2.SessionConfig:
        td = self.turn_detection
        return session_pb2.SessionConfig(
            input_format=self.input_format.to_proto(),
            output_format=self.output_format.to_proto(),
            instructions=self.instructions,
            turn_detection=session_pb2.TurnDetection(
                auto_respond=td.auto_respond, silence_ms=td.silence_ms, barge_in=td.barge_in
            ),
            modalities=list(self.modalities),
            idle_timeout_s=self.idle_timeout_s,
        )


@dataclass(frozen=True, slots=True)
class Fence:
    """``(session_id, epoch, turn_id)``: carried by every submission, checked on every output."""

    session_id: str
    epoch: int
    turn_id: int

    def to_proto(self) -> common_pb2.Fence:
        return common_pb2.Fence(session_id=self.session_id, epoch=self.epoch, turn_id=self.turn_id)


class OutputAction(StrEnum):
    """What the runner does with a response after an update."""

    CONTINUE = "continue"
    COMPLETE = "complete"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class OutputDecision:
    """The plugin's verdict on one worker update for the active response."""

    action: OutputAction
    reason: str = ""


# ---------------------------------------------------------------------------------------------
# PCM append buffer: reserve, then commit or roll back


class AppendReservation(ABC):
    """Worker-format frames taken from the buffer, kept out of it until commit or rollback."""

    @property
    @abstractmethod
    def active(self) -> bool: ...

    @property
    @abstractmethod
    def frames(self) -> bytes:
        """Whole worker frames to submit (possibly empty)."""

    @property
    @abstractmethod
    def byte_count(self) -> int:
        """Client bytes this reservation accounts for."""

    @abstractmethod
    def commit(self) -> None:
        """The frames were handed on: make the buffer's new state final."""

    @abstractmethod
    def rollback(self) -> None:
        """The frames were not handed on: restore the buffer as it was before the reservation."""


class PcmAppendBuffer(ABC):
    """Client PCM in, whole worker frames out, with at most one reservation open at a time."""

    @property
    @abstractmethod
    def pending_byte_count(self) -> int:
        """Worker-format bytes held back (less than one frame)."""

    @abstractmethod
    def has_reserved(self) -> bool: ...

    @abstractmethod
    def clear(self) -> None:
        """Drop the held-back remainder (input clear)."""

    @abstractmethod
    def reserve_append(self, pcm: bytes) -> AppendReservation:
        """Convert and packetize ``pcm``; raises ``invalid_pcm_length`` on a partial sample frame."""

    @abstractmethod
    def reserve_flush(self) -> AppendReservation:
        """Reserve the remainder padded with silence to one whole frame (for a commit)."""


class _FrameReservation(AppendReservation):
    def __init__(
        self, buffer: FramePacketizer, frames: bytes, byte_count: int, remainder: bytes, snap: object
    ) -> None:
        self._buffer = buffer
        self._frames = frames
        self._byte_count = byte_count
        self._remainder = remainder
        self._snap = snap
        self._active = True

    @property
    def active(self) -> bool:
        return self._active

    @property
    def frames(self) -> bytes:
        return self._frames

    @property
    def byte_count(self) -> int:
        return self._byte_count

    def commit(self) -> None:
        if not self._active:
            raise RuntimeError("reservation already settled")
        self._active = False
        self._buffer._settle(self, remainder=self._remainder, snap=None)

    def rollback(self) -> None:
        if not self._active:
            raise RuntimeError("reservation already settled")
        self._active = False
        self._buffer._settle(self, remainder=None, snap=self._snap)


class FramePacketizer(PcmAppendBuffer):
    """Converts client PCM to the worker format and cuts it into whole frames, keeping the rest.

    While a reservation is open the buffer's remainder and converter state are those *after*
    the reservation, so a rollback restores the snapshot taken before it.
    """

    def __init__(self, client_format: PcmFormat, worker_format: PcmFormat, frame_samples: int) -> None:
        self.client_format = client_format
        self.worker_format = worker_format
        self.frame_bytes = frame_samples * worker_format.frame_bytes
        self._converter = StreamConverter(client_format, worker_format)
        # A converter between equal formats holds no state: nothing to snapshot for a rollback
        # (a deep copy per append was the costliest part of the append path).
        self._stateless = client_format == worker_format
        self._remainder = b""
        self._reserved: _FrameReservation | None = None

    @property
    def pending_byte_count(self) -> int:
        return len(self._remainder)

    def has_reserved(self) -> bool:
        return self._reserved is not None

    def clear(self) -> None:
        self._check_free()
        self._remainder = b""
        self._converter = StreamConverter(self.client_format, self.worker_format)

    def _snapshot(self) -> tuple[bytes, StreamConverter]:
        return (self._remainder, self._converter if self._stateless else copy.deepcopy(self._converter))

    def reserve_append(self, pcm: bytes) -> AppendReservation:
        self._check_free()
        snap = self._snapshot()
        data = self._remainder + self._converter.convert(pcm)  # raises before any state changes
        cut = len(data) - len(data) % self.frame_bytes
        return self._open(_FrameReservation(self, data[:cut], len(pcm), data[cut:], snap))

    def reserve_flush(self) -> AppendReservation:
        self._check_free()
        snap = self._snapshot()
        frames = self._remainder
        if frames:
            frames += b"\x00" * (self.frame_bytes - len(frames))
        return self._open(_FrameReservation(self, frames, 0, b"", snap))

    def _open(self, res: _FrameReservation) -> AppendReservation:
        self._reserved = res
        return res

    def _check_free(self) -> None:
        # One reservation at a time: later appends wait for earlier ones (the runner is serial).
        if self._reserved is not None:
            raise RuntimeError("an append reservation is still open")

    def _settle(self, res: _FrameReservation, *, remainder: bytes | None, snap: object) -> None:
        if res is not self._reserved:
            raise RuntimeError("not the open reservation")
        self._reserved = None
        if remainder is not None:
            self._remainder = remainder
        if snap is not None:
            self._remainder, self._converter = snap  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Per-session model state


@dataclass(slots=True)
class ModelSessionState:
    """Model-owned per-session state, owned by the session's runner (never shared)."""

    audio_buffer: PcmAppendBuffer
    """Client PCM to worker frames."""
    input_since_commit_samples: int = 0
    """Worker-format samples handed on since the last commit."""
    speech_since_commit: bool = False
    """The worker heard speech since the last commit."""
    context_locked: bool = False
    """Set at the first response: instructions may no longer change."""
    committed_turns: int = 0
    """Turns committed to the model context."""
    continuation_units: int = 0
    """Silence frames fed in the active response."""
    last_native_submit_monotonic: float | None = None
    """When real client input was last handed on; silence is skipped while input flows."""
    silence_deadline_monotonic: float | None = None
    """The next silence continuation deadline (deadline-aligned, not drift-prone sleeps)."""

    def clear_continuation(self) -> None:
        self.continuation_units = 0
        self.silence_deadline_monotonic = None


# ---------------------------------------------------------------------------------------------
# Data plane: raw step outputs to client events


@dataclass(slots=True)
class ResponseProjection:
    """Per-response projection state: output conversion and position."""

    response_id: str
    turn_id: int
    epoch: int
    converter: StreamConverter
    output_format: PcmFormat
    samples_out: int = 0
    text: list[str] = field(default_factory=list)

    @property
    def audio_ms(self) -> int:
        return self.samples_out * 1000 // self.output_format.sample_rate_hz


class DataPlane(ABC):
    """Projects one model's raw step outputs into client events."""

    @abstractmethod
    def begin_response(
        self,
        *,
        response_id: str,
        turn_id: int,
        epoch: int,
        worker_format: PcmFormat,
        output_format: PcmFormat,
    ) -> ResponseProjection: ...

    @abstractmethod
    def project_audio(
        self, proj: ResponseProjection, payload: common_pb2.AudioPayload
    ) -> list[session_pb2.ServerEvent]: ...

    @abstractmethod
    def project_text(self, proj: ResponseProjection, text: str) -> list[session_pb2.ServerEvent]: ...


class PcmDataPlane(DataPlane):
    """Audio deltas in the session's output format; text as assistant transcript."""

    def begin_response(
        self,
        *,
        response_id: str,
        turn_id: int,
        epoch: int,
        worker_format: PcmFormat,
        output_format: PcmFormat,
    ) -> ResponseProjection:
        return ResponseProjection(
            response_id, turn_id, epoch, StreamConverter(worker_format, output_format), output_format
        )

    def project_audio(
        self, proj: ResponseProjection, payload: common_pb2.AudioPayload
    ) -> list[session_pb2.ServerEvent]:
        if payload.HasField("format") and PcmFormat.from_proto(payload.format) != proj.converter.src:
            raise BadEventError(ErrorCode.MODEL_ERROR, "worker audio in an unexpected format")
        pcm = proj.converter.convert(payload.pcm)
        if not pcm:
            return []
        offset_ms = proj.audio_ms
        proj.samples_out += len(pcm) // proj.output_format.frame_bytes
        # Filled in place: constructing the delta first and passing it in would copy it (PCM too).
        event = session_pb2.ServerEvent()
        delta = event.audio_delta
        delta.response_id = proj.response_id
        delta.turn_id = proj.turn_id
        delta.epoch = proj.epoch
        delta.pcm = pcm
        delta.offset_ms = offset_ms
        return [event]

    def project_text(self, proj: ResponseProjection, text: str) -> list[session_pb2.ServerEvent]:
        if not text:
            return []
        proj.text.append(text)
        delta = session_pb2.TranscriptDelta(response_id=proj.response_id, role="assistant", text=text)
        return [session_pb2.ServerEvent(transcript_delta=delta)]


# ---------------------------------------------------------------------------------------------
# The plugin


class DuplexModelPlugin(ABC):
    """Everything the session service needs to know about one full-duplex model."""

    plugin_id: str = ""
    """The id clients name in ``open.model``."""
    model_id: str = ""
    """The worker ``model_id`` this plugin drives (defaults to ``plugin_id``)."""
    private_runtime_config_keys: frozenset[str] = frozenset()
    """extra_body keys reserved for the server (rejected with ``private_runtime_key``)."""
    data_plane: DataPlane
    """Projection of step outputs into client events."""
    worker_format: PcmFormat = PCM16K_MONO
    """Format of PCM on the worker stream."""
    frame_samples: int = 0
    """Samples per worker frame; appends carry whole frames."""
    sampling_defaults: tuple[object, ...] = ()
    """One sampling parameter object per stage; configured values must keep each type."""
    max_append_bytes: int = 256 * 1024
    """Largest client append chunk."""
    silence_continuation: bool = False
    """The model is lockstep (clocked by input frames, e.g. parrot): while a response is active
    and the client sends no audio, the runner feeds silence at real-time deadlines so the turn
    goes on. Free-running models leave it off."""

    # ---- session policy ----

    @abstractmethod
    def capabilities(self, *, max_sessions: int) -> Capabilities: ...

    @abstractmethod
    def default_settings(self) -> SessionSettings:
        """Settings of a session resumed on a replica that never saw its open."""

    @abstractmethod
    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        """Raise ``RuntimeConfigError`` (private keys: code ``private_runtime_key``)."""

    @abstractmethod
    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        """The runtime config of a new session (may do I/O, e.g. load a voice)."""

    @abstractmethod
    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        """The runtime config after a session update (already validated extra_body)."""

    def runtime_config_for_function_output(
        self, settings: SessionSettings, current: Mapping[str, object], call_id: str, output: str
    ) -> dict[str, object] | None:
        """A runtime config patch for a function-call result; models without tools keep None."""
        del settings, current, call_id, output
        return None

    def runtime_config_after_model_output(
        self, current: Mapping[str, object], update: worker_pb2.RequestUpdate
    ) -> dict[str, object] | None:
        """A runtime config patch after a model output was observed (default: none)."""
        del current, update
        return None

    def create_session_state(self, settings: SessionSettings) -> ModelSessionState:
        return ModelSessionState(
            audio_buffer=FramePacketizer(settings.input_format, self.worker_format, self.frame_samples)
        )

    # ---- engine policy ----

    @abstractmethod
    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        """One sampling parameter per stage, each of its default's type."""

    @abstractmethod
    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        """The worker's model options (``Submission.params``) for this session."""

    def plan_append(
        self, *, request_id: str, fence: Fence, seq: int, frames: bytes, params: Mapping[str, Any] | None
    ) -> list[worker_pb2.Submission]:
        """Submissions that hand ``frames`` (whole worker frames) to the worker."""
        if not frames:
            return []
        sub = worker_pb2.Submission(
            request_id=request_id, kind=worker_pb2.SUBMISSION_KIND_APPEND, seq=seq, pcm=frames
        )
        _set_fence(sub, fence)
        _set_params(sub, params)
        return [sub]

    def plan_control(
        self, *, request_id: str, fence: Fence, kind: int, params: Mapping[str, Any] | None
    ) -> worker_pb2.Submission:
        """A COMMIT, RESPOND or CLEAR submission."""
        sub = worker_pb2.Submission(request_id=request_id, kind=kind)  # type: ignore[arg-type]
        _set_fence(sub, fence)
        _set_params(sub, params)
        return sub

    def decide_output(self, update: worker_pb2.RequestUpdate) -> OutputDecision | None:
        """What an update means for the active response (None: nothing)."""
        if update.HasField("error"):
            return OutputDecision(OutputAction.FAIL, update.error.code or ErrorCode.MODEL_ERROR.value)
        if update.response_finished:
            return OutputDecision(OutputAction.COMPLETE)
        return None

    def commit_model_context(self, *, session_id: str, assistant_text: str) -> None:
        """Persist model-context history at a turn boundary (default: nothing to keep)."""
        del session_id, assistant_text


def _set_fence(sub: worker_pb2.Submission, fence: Fence) -> None:
    f = sub.fence  # in place: no Fence message built and copied per submission
    f.session_id = fence.session_id
    f.epoch = fence.epoch
    f.turn_id = fence.turn_id


def _set_params(sub: worker_pb2.Submission, params: Mapping[str, Any] | None) -> None:
    if params is not None:
        s = struct_pb2.Struct()
        s.update(dict(params))
        sub.params.CopyFrom(s)


# ---------------------------------------------------------------------------------------------
# Loading and validation


def load_plugin(path: str) -> DuplexModelPlugin:
    """Import ``module:Class`` (or ``module.Class``), instantiate it and validate the contract."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, sep, attr = path.rpartition(".")
    if not sep or not module_name or not attr:
        raise PluginLoadError(f"invalid plugin path {path!r}: expected module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginLoadError(f"unknown plugin {path!r}: cannot import {module_name!r} ({exc})") from exc
    plugin_type = getattr(module, attr, None)
    if plugin_type is None:
        raise PluginLoadError(f"unknown plugin {path!r}: {module_name!r} has no {attr!r}")
    if not isinstance(plugin_type, type) or not issubclass(plugin_type, DuplexModelPlugin):
        raise PluginLoadError(f"{path!r} is not a DuplexModelPlugin subclass")
    try:
        plugin = plugin_type()
    except Exception as exc:
        raise PluginLoadError(f"{path!r} failed to construct: {exc}") from exc
    validate_plugin(plugin)
    return plugin


def validate_plugin(plugin: DuplexModelPlugin) -> None:
    """Fail fast on a plugin that breaks the contract (raises ``PluginLoadError``)."""
    name = type(plugin).__name__
    if not isinstance(plugin.plugin_id, str) or not plugin.plugin_id:
        raise PluginLoadError(f"plugin {name} must declare plugin_id")
    if not plugin.model_id:
        plugin.model_id = plugin.plugin_id
    if not isinstance(getattr(plugin, "data_plane", None), DataPlane):
        raise PluginLoadError(f"plugin {name} must declare a DataPlane as data_plane")
    if not isinstance(plugin.worker_format, PcmFormat):
        raise PluginLoadError(f"plugin {name} must declare worker_format as a PcmFormat")
    if not isinstance(plugin.frame_samples, int) or plugin.frame_samples <= 0:
        raise PluginLoadError(f"plugin {name} must declare a positive frame_samples")
    defaults = plugin.sampling_defaults
    if not isinstance(defaults, tuple) or not defaults:
        raise PluginLoadError(f"plugin {name} must declare sampling_defaults, one per stage")
    configured = plugin.configure_sampling_params(runtime_config={}, defaults=defaults)
    if not isinstance(configured, tuple):
        raise PluginLoadError(f"plugin {name} must return sampling parameters as a tuple")
    if len(configured) != len(defaults):
        raise PluginLoadError(
            f"plugin {name} must return one sampling parameter per stage "
            f"({len(defaults)} stages, got {len(configured)})"
        )
    for stage, (value, default) in enumerate(zip(configured, defaults, strict=True)):
        if default is not None and not isinstance(value, type(default)):
            raise PluginLoadError(
                f"plugin {name} sampling parameter type mismatch for stage {stage}: "
                f"expected {type(default).__name__}, got {type(value).__name__}"
            )


def check_worker(plugin: DuplexModelPlugin, desc: worker_pb2.WorkerDescription) -> None:
    """Refuse a worker that serves another model or another frame format."""
    if desc.model_id != plugin.model_id:
        raise PluginLoadError(
            f"worker serves model {desc.model_id!r}, plugin {plugin.plugin_id!r} needs {plugin.model_id!r}",
            code=ErrorCode.MODEL_MISMATCH,
        )
    if desc.frame_samples and desc.frame_samples != plugin.frame_samples:
        raise PluginLoadError(
            f"worker frame is {desc.frame_samples} samples, plugin needs {plugin.frame_samples}",
            code=ErrorCode.MODEL_MISMATCH,
        )
    if desc.HasField("audio_format"):
        try:
            fmt = PcmFormat.from_proto(desc.audio_format)
        except BadEventError as exc:
            raise PluginLoadError(f"worker audio format: {exc}", code=ErrorCode.MODEL_MISMATCH) from exc
        if fmt != plugin.worker_format:
            raise PluginLoadError(
                f"worker audio is {fmt}, plugin needs {plugin.worker_format}", code=ErrorCode.MODEL_MISMATCH
            )
