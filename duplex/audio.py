"""PCM formats, validation, conversion, streaming resampling and WAV files.

Everything here is plain numpy on host memory: it runs in the session service (client
audio to the worker's format and back), in the client (files to the session's format) and
in tests. Samples are float32 in [-1, 1], shaped ``(frames, channels)`` unless noted.
"""

from __future__ import annotations

import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2

FloatArray = npt.NDArray[np.float32]

S16LE = common_pb2.AUDIO_ENCODING_PCM_S16LE
F32LE = common_pb2.AUDIO_ENCODING_PCM_F32LE
_SAMPLE_BYTES: dict[int, int] = {S16LE: 2, F32LE: 4}
#: Rates a session accepts; anything else is "unsupported_audio_format".
SUPPORTED_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
MAX_CHANNELS = 2


class AudioFileError(ValueError):
    """A WAV file that cannot be read (not RIFF/WAVE, compressed, truncated, empty)."""


@dataclass(frozen=True, slots=True)
class PcmFormat:
    """A hashable, validated copy of ``duplex.v1.AudioFormat``."""

    encoding: int
    """An ``AudioEncoding`` value (PCM_S16LE or PCM_F32LE)."""
    sample_rate_hz: int
    """Samples per second per channel."""
    channels: int
    """Interleaved channels."""

    @property
    def sample_bytes(self) -> int:
        return _SAMPLE_BYTES[self.encoding]

    @property
    def frame_bytes(self) -> int:
        """Bytes of one sample for every channel."""
        return self.sample_bytes * self.channels

    def bytes_for_ms(self, ms: float) -> int:
        return round(self.sample_rate_hz * ms / 1000.0) * self.frame_bytes

    def duration_ms(self, n_bytes: int) -> float:
        return 1000.0 * (n_bytes // self.frame_bytes) / self.sample_rate_hz

    def to_proto(self) -> common_pb2.AudioFormat:
        return common_pb2.AudioFormat(
            encoding=self.encoding,  # type: ignore[arg-type]
            sample_rate_hz=self.sample_rate_hz,
            channels=self.channels,
        )

    @classmethod
    def from_proto(cls, fmt: common_pb2.AudioFormat) -> PcmFormat:
        """Validate a wire format; raises ``BadEventError(unsupported_audio_format)``."""
        if fmt.encoding not in _SAMPLE_BYTES:
            raise BadEventError(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, f"unsupported encoding {fmt.encoding}")
        if fmt.sample_rate_hz not in SUPPORTED_RATES:
            raise BadEventError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                f"unsupported sample rate {fmt.sample_rate_hz} Hz (supported: {SUPPORTED_RATES})",
            )
        if not 1 <= fmt.channels <= MAX_CHANNELS:
            raise BadEventError(ErrorCode.UNSUPPORTED_AUDIO_FORMAT, f"unsupported channels {fmt.channels}")
        return cls(int(fmt.encoding), int(fmt.sample_rate_hz), int(fmt.channels))

    def __str__(self) -> str:
        name = "s16le" if self.encoding == S16LE else "f32le"
        return f"{name}/{self.sample_rate_hz}Hz/{self.channels}ch"


#: The format of every worker model in this project: 16 kHz mono 16-bit.
PCM16K_MONO = PcmFormat(S16LE, 16000, 1)


def decode(pcm: bytes, fmt: PcmFormat) -> FloatArray:
    """Bytes to float32 ``(frames, channels)``; raises ``invalid_pcm_length`` on a partial frame."""
    if len(pcm) % fmt.frame_bytes:
        raise BadEventError(
            ErrorCode.INVALID_PCM_LENGTH,
            f"{len(pcm)} bytes is not a whole number of {fmt.frame_bytes}-byte frames for {fmt}",
        )
    if fmt.encoding == S16LE:
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    else:
        x = np.frombuffer(pcm, dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise BadEventError(ErrorCode.INVALID_EVENT, "float PCM contains NaN or infinity")
        x = np.clip(x, -1.0, 1.0)
    return x.reshape(-1, fmt.channels)


def encode(samples: npt.NDArray[np.floating], fmt: PcmFormat) -> bytes:
    """float ``(frames,)`` or ``(frames, channels)`` to bytes in ``fmt`` (mono input is duplicated)."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 1:
        x = x[:, None]
    if x.shape[1] != fmt.channels:
        x = np.repeat(x.mean(axis=1, keepdims=True), fmt.channels, axis=1)
    x = np.clip(x, -1.0, 1.0)
    if fmt.encoding == S16LE:
        return _to_int16(x).tobytes()
    return x.astype("<f4").tobytes()


def _to_int16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
    # The inverse of decode's /32768, so a round trip is exact to one quantisation step.
    scaled = np.clip(np.round(x * 32768.0), -32768, 32767)
    return scaled.astype("<i2")


def to_mono(samples: FloatArray) -> FloatArray:
    """Average the channels of ``(frames, channels)`` into ``(frames,)``."""
    if samples.ndim == 1:
        return samples
    mono: FloatArray = samples.mean(axis=1).astype(np.float32)
    return mono


class StreamingResampler:
    """Linear-interpolation resampler that keeps its phase across chunks.

    Chunk boundaries are seamless: feeding a signal in pieces gives the same samples as
    feeding it whole. Downsampling first averages with a short box filter to tame aliasing
    of speech-band content; this is a serving layer, not a mastering tool.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._step = src_rate / dst_rate
        self._pos = 0.0  # position of the next output sample, relative to _prev's index 0
        self._prev = np.zeros(0, dtype=np.float32)  # input not yet fully consumed
        self._box = max(1, int(self._step)) if src_rate > dst_rate else 1
        self._box_tail = np.zeros(self._box - 1, dtype=np.float32)

    def process(self, x: FloatArray) -> FloatArray:
        """Resample a mono chunk; returns however many output samples it completes."""
        if self.src_rate == self.dst_rate:
            return np.asarray(x, dtype=np.float32)
        x = np.asarray(x, dtype=np.float32)
        if len(x) == 0:
            return np.zeros(0, dtype=np.float32)
        if self._box > 1:
            padded = np.concatenate([self._box_tail, x])
            kernel = np.full(self._box, 1.0 / self._box, dtype=np.float32)
            filtered = np.convolve(padded, kernel, mode="valid").astype(np.float32)
            self._box_tail = padded[len(padded) - (self._box - 1) :]
            x = filtered
        buf = np.concatenate([self._prev, x])
        # Every output position up to the last sample can be computed now: one between two
        # samples has both neighbours, one exactly on the last sample needs none. (Waiting for a
        # right neighbour there would drop it when it ends a chunk: the output would depend on
        # the chunking.)
        last = len(buf) - 1
        n = int(np.floor((last - self._pos) / self._step)) + 1 if self._pos <= last else 0
        if n <= 0:
            self._prev = buf
            return np.zeros(0, dtype=np.float32)
        idx = self._pos + self._step * np.arange(n, dtype=np.float64)
        out: FloatArray = np.interp(idx, np.arange(len(buf), dtype=np.float64), buf).astype(np.float32)
        next_pos = self._pos + self._step * n
        drop = min(int(np.floor(next_pos)), len(buf))
        self._prev = buf[drop:]
        self._pos = next_pos - drop
        return out


def resample(x: FloatArray, src_rate: int, dst_rate: int) -> FloatArray:
    """Resample a whole mono signal (see ``StreamingResampler``)."""
    if src_rate == dst_rate:
        same: FloatArray = np.asarray(x, dtype=np.float32)
        return same
    out = StreamingResampler(src_rate, dst_rate).process(np.concatenate([x, np.zeros(1, np.float32)]))
    want = round(len(x) * dst_rate / src_rate)
    if len(out) < want:
        out = np.concatenate([out, np.zeros(want - len(out), np.float32)])
    return out[:want]


class StreamConverter:
    """Converts a stream of PCM chunks from one format to another, statefully."""

    def __init__(self, src: PcmFormat, dst: PcmFormat) -> None:
        self.src = src
        self.dst = dst
        self._resampler = StreamingResampler(src.sample_rate_hz, dst.sample_rate_hz)
        self._identity = src == dst

    def convert(self, pcm: bytes) -> bytes:
        """Validate and convert one chunk; raises ``invalid_pcm_length`` on a partial frame."""
        if self._identity:
            if len(pcm) % self.src.frame_bytes:
                decode(pcm, self.src)  # raises the precise error
            return pcm
        mono = to_mono(decode(pcm, self.src))
        return encode(self._resampler.process(mono), self.dst)


def read_wav(path: str | Path) -> tuple[FloatArray, int]:
    """Read a PCM WAV file as float32 ``(frames, channels)`` and its sample rate."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as exc:
        raise AudioFileError(f"{path}: not a readable PCM WAV file ({exc})") from exc
    except OSError as exc:
        raise AudioFileError(f"{path}: cannot open ({exc.strerror or exc})") from exc
    if channels < 1 or rate <= 0:
        raise AudioFileError(f"{path}: invalid header (channels={channels}, rate={rate})")
    if not raw or len(raw) < width * channels:
        raise AudioFileError(f"{path}: no audio frames")
    raw = raw[: len(raw) - len(raw) % (width * channels)]
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise AudioFileError(f"{path}: unsupported sample width {width} bytes")
    return x.reshape(-1, channels), rate


def write_wav(path: str | Path, samples: npt.NDArray[np.floating], sample_rate_hz: int) -> None:
    """Write float ``(frames,)`` or ``(frames, channels)`` as 16-bit PCM WAV."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 1:
        x = x[:, None]
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(2)
        w.setframerate(sample_rate_hz)
        w.writeframes(_to_int16(x).tobytes())


__all__ = [
    "F32LE",
    "PCM16K_MONO",
    "S16LE",
    "SUPPORTED_RATES",
    "AudioFileError",
    "PcmFormat",
    "StreamConverter",
    "StreamingResampler",
    "decode",
    "encode",
    "read_wav",
    "resample",
    "to_mono",
    "write_wav",
]
