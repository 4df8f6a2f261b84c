"""The domain types a plugin speaks: capabilities, session settings, output decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from duplex.audio import PcmFormat
from duplex.v1 import session_pb2


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
    resume_scope: str = "deployment"
    """Where a resume token works: "deployment" (shared resume secrets) or "replica" (none:
    set by the session service, not the plugin)."""
    turn_failover: bool = False
    """Whether a turn survives the loss of its worker (the plugin is ``replayable`` and the
    service keeps turns' input: set by the session service, not the plugin)."""
    model_native: bool = False
    """The model decides itself when to speak (``TURN_POLICY_MODEL_NATIVE``; set by the session
    service from the plugin)."""
    frame_period_ms: int = 0
    """The model's frame period (set by the session service from the plugin)."""
    input_transcription: bool = False
    """The model recognizes the user's words (``transcript_delta{role="user"}``,
    ``input_transcribed``)."""
    function_calling: bool = False
    """The model calls the client's tools (``extra_body.tools``): ``function_call`` events, answered
    with ``function_call_output``."""

    def turn_policy(self, *, auto_respond: bool) -> session_pb2.TurnPolicy.ValueType:
        """The policy of a session with these capabilities and its ``auto_respond`` setting."""
        if self.model_native:
            return session_pb2.TURN_POLICY_MODEL_NATIVE
        if self.turn_detection and auto_respond:
            return session_pb2.TURN_POLICY_SERVER_VAD
        return session_pb2.TURN_POLICY_CLIENT_COMMIT

    def to_proto(self, *, auto_respond: bool = True) -> session_pb2.Capabilities:
        return session_pb2.Capabilities(
            model=self.model,
            input_formats=[f.to_proto() for f in self.input_formats],
            output_format=self.output_format.to_proto(),
            modalities=list(self.modalities),
            max_sessions=self.max_sessions,
            max_append_bytes=self.max_append_bytes,
            turn_detection=self.turn_detection,
            resume_scope=self.resume_scope,
            turn_failover=self.turn_failover,
            turn_policy=self.turn_policy(auto_respond=auto_respond),
            model_barge_in=self.model_native,
            frame_period_ms=self.frame_period_ms,
            input_transcription=self.input_transcription,
            function_calling=self.function_calling,
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
    """The client-visible settings of one session (the domain form of ``SessionConfig``;
    ``session_service.session.settings`` converts the wire form)."""

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
