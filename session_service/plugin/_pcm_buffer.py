"""The PCM append buffer: client audio in, whole worker frames out, reserved until handed on.

A runner reserves the frames an append produces, submits them, and then commits the
reservation (they reached the worker) or rolls it back (the write failed: the buffer is as it
was before, so the input timeline has no hole where the lost frames were).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from duplex.audio import PcmFormat, StreamConverter


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
        """Reserve everything held back (the converter's tail included) padded with silence to
        whole frames (for a commit: the end of the user's input)."""


class _FrameReservation(AppendReservation):
    def __init__(self, buffer: FramePacketizer, frames: bytes, byte_count: int, remainder: bytes) -> None:
        self._buffer = buffer
        self._frames = frames
        self._byte_count = byte_count
        self._remainder = remainder
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
        self._settle()
        self._buffer._remainder = self._remainder

    def rollback(self) -> None:
        self._settle()
        self._buffer._converter.reset()

    def _settle(self) -> None:
        if not self._active:
            raise RuntimeError("reservation already settled")
        if self._buffer._reserved is not self:
            raise RuntimeError("not the open reservation")
        self._active = False
        self._buffer._reserved = None


class FramePacketizer(PcmAppendBuffer):
    """Converts client PCM to the worker format and cuts it into whole frames, keeping the rest.

    The held-back remainder changes only when a reservation commits. A rollback starts the
    converter afresh instead of restoring a copy of it: copying the resampler's state on every
    append would cost more than the append itself, and a failed write abandons the session's
    input until commit, clear or cancel anyway, so the resampler history it loses (tens of
    milliseconds) is never heard.
    """

    def __init__(self, client_format: PcmFormat, worker_format: PcmFormat, frame_samples: int) -> None:
        self.client_format = client_format
        self.worker_format = worker_format
        self.frame_bytes = frame_samples * worker_format.frame_bytes
        self._converter = StreamConverter(client_format, worker_format)
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
        self._converter.reset()

    def reserve_append(self, pcm: bytes) -> AppendReservation:
        self._check_free()
        data = self._remainder + self._converter.convert(pcm)  # raises before any state changes
        cut = len(data) - len(data) % self.frame_bytes
        res = self._reserved = _FrameReservation(self, data[:cut], len(pcm), data[cut:])
        return res

    def reserve_flush(self) -> AppendReservation:
        self._check_free()
        # The resampler holds back the last tens of milliseconds of input (libsoxr works in
        # blocks): they belong to this turn, so the commit ends the stream.
        frames = self._remainder + self._converter.flush()
        if len(frames) % self.frame_bytes:
            frames += b"\x00" * (self.frame_bytes - len(frames) % self.frame_bytes)
        res = self._reserved = _FrameReservation(self, frames, 0, b"")
        return res

    def _check_free(self) -> None:
        # One reservation at a time: later appends wait for earlier ones (the runner is serial).
        if self._reserved is not None:
            raise RuntimeError("an append reservation is still open")
