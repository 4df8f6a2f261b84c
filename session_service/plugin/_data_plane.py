"""The data plane: one model's raw step outputs projected into client events."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from duplex.audio import PcmFormat, StreamConverter
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2, session_pb2


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

    def end_response(self, proj: ResponseProjection) -> list[session_pb2.ServerEvent]:
        """The last output of a response that completed (what a converter still holds); a
        cancelled or failed response is not asked. Default: nothing."""
        del proj
        return []


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
        if payload.HasField("format"):
            fmt, src = payload.format, proj.converter.src  # compared as is: no conversion per frame
            if (fmt.encoding, fmt.sample_rate_hz, fmt.channels) != (
                src.encoding,
                src.sample_rate_hz,
                src.channels,
            ):
                raise BadEventError(ErrorCode.MODEL_ERROR, "worker audio in an unexpected format")
        return self._delta(proj, proj.converter.convert(payload.pcm))

    def end_response(self, proj: ResponseProjection) -> list[session_pb2.ServerEvent]:
        # A resampling converter holds back the reply's last tens of milliseconds.
        return self._delta(proj, proj.converter.flush())

    @staticmethod
    def _delta(proj: ResponseProjection, pcm: bytes) -> list[session_pb2.ServerEvent]:
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
