"""PCM formats, validation, conversion, streaming resampling and WAV files.

G.711 (mu-law ``PCMU`` and A-law ``PCMA``, 8 kHz mono, the telephone network's audio) is an
encoding like the PCM ones: ``decode`` and ``encode`` convert it, by table, once, where PCM is
converted.

Everything here runs on host memory: in the session service (client audio to the worker's
format and back), in the client (files to the session's format) and in tests. Resampling is
libsoxr's (``soxr``), WAV files are libsndfile's (``soundfile``). Samples are float32 in
[-1, 1], shaped ``(frames, channels)`` unless noted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import soundfile as sf
import soxr

from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2

FloatArray = npt.NDArray[np.float32]

S16LE = common_pb2.AUDIO_ENCODING_PCM_S16LE
F32LE = common_pb2.AUDIO_ENCODING_PCM_F32LE
PCMU = common_pb2.AUDIO_ENCODING_PCMU
PCMA = common_pb2.AUDIO_ENCODING_PCMA
Encoding: TypeAlias = common_pb2.AudioEncoding.ValueType
_SAMPLE_BYTES: dict[Encoding, int] = {S16LE: 2, F32LE: 4, PCMU: 1, PCMA: 1}
#: G.711 is narrowband telephone audio: one rate, one channel.
G711_RATE = 8000
_NAMES: dict[Encoding, str] = {S16LE: "s16le", F32LE: "f32le", PCMU: "pcmu", PCMA: "pcma"}
#: Rates a session accepts; anything else is "unsupported_audio_format".
SUPPORTED_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
MAX_CHANNELS = 2


class AudioFileError(ValueError):
    """A WAV file that cannot be read (missing, not a WAV, malformed, truncated, empty)."""


@dataclass(frozen=True, slots=True)
class PcmFormat:
    """A hashable, validated copy of ``duplex.v1.AudioFormat``."""

    encoding: Encoding
    """An ``AudioEncoding`` value (PCM_S16LE or PCM_F32LE)."""
    sample_rate_hz: int
    """Samples per second per channel."""
    channels: int
    """Interleaved channels."""
    sample_bytes: int = field(init=False, repr=False, compare=False)
    """Bytes of one sample of one channel."""
    frame_bytes: int = field(init=False, repr=False, compare=False)
    """Bytes of one sample for every channel."""

    def __post_init__(self) -> None:
        # Derived once: both are read on every append and every reply frame.
        sample_bytes = _SAMPLE_BYTES.get(self.encoding, 0)
        object.__setattr__(self, "sample_bytes", sample_bytes)
        object.__setattr__(self, "frame_bytes", sample_bytes * self.channels)

    def bytes_for_ms(self, ms: float) -> int:
        return round(self.sample_rate_hz * ms / 1000.0) * self.frame_bytes

    def duration_ms(self, n_bytes: int) -> float:
        return 1000.0 * (n_bytes // self.frame_bytes) / self.sample_rate_hz

    def to_proto(self) -> common_pb2.AudioFormat:
        return common_pb2.AudioFormat(
            encoding=self.encoding,
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
        if fmt.encoding in (PCMU, PCMA) and (fmt.sample_rate_hz != G711_RATE or fmt.channels != 1):
            raise BadEventError(
                ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
                f"G.711 ({_NAMES[fmt.encoding]}) is {G711_RATE} Hz mono, "
                f"not {fmt.sample_rate_hz} Hz with {fmt.channels} channel(s)",
            )
        return cls(fmt.encoding, int(fmt.sample_rate_hz), int(fmt.channels))

    @property
    def g711(self) -> bool:
        """mu-law or A-law: 8 kHz mono, one byte per sample."""
        return self.encoding in (PCMU, PCMA)

    def __str__(self) -> str:
        return f"{_NAMES.get(self.encoding, '?')}/{self.sample_rate_hz}Hz/{self.channels}ch"


#: The format of every worker model in this project: 16 kHz mono 16-bit.
PCM16K_MONO = PcmFormat(S16LE, 16000, 1)
#: Telephone audio: G.711 mu-law and A-law, 8 kHz mono.
PCMU_8K = PcmFormat(PCMU, G711_RATE, 1)
PCMA_8K = PcmFormat(PCMA, G711_RATE, 1)


# ---- G.711 (ITU-T G.711; the segment arithmetic of its reference C code, as sox and most
# telephony stacks use it). Decoding is a 256-entry table; encoding a 65,536-entry table
# indexed by the 16-bit sample, both built once with numpy.

_ULAW_BIAS = 0x84
_ULAW_CLIP = 32635


def _segment(magnitude: npt.NDArray[np.int32], ends: tuple[int, ...]) -> npt.NDArray[np.int32]:
    """The first segment whose end is >= ``magnitude`` (len(ends) when none is)."""
    return np.searchsorted(np.asarray(ends, dtype=np.int32), magnitude, side="left").astype(np.int32)


@functools.cache
def _ulaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(pcm < 0, 0x80, 0x00)
    mag = np.minimum(np.abs(pcm), _ULAW_CLIP) + _ULAW_BIAS
    # Exponent: the position of the highest set bit of mag >> 7 (0..7).
    exponent = np.zeros_like(mag)
    for e in range(1, 8):
        exponent = np.where(mag >= (0x80 << e), e, exponent)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    table: npt.NDArray[np.uint8] = (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)
    return table


@functools.cache
def _ulaw_decode_table() -> npt.NDArray[np.int16]:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + _ULAW_BIAS) << ((u & 0x70) >> 4)
    table: npt.NDArray[np.int16] = np.where(u & 0x80, _ULAW_BIAS - t, t - _ULAW_BIAS).astype(np.int16)
    return table


_ALAW_SEGMENT_ENDS = (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF)


@functools.cache
def _alaw_encode_table() -> npt.NDArray[np.uint8]:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 3
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = _segment(mag, _ALAW_SEGMENT_ENDS)
    low = np.where(seg < 2, (mag >> 1) & 0x0F, (mag >> np.maximum(seg, 1)) & 0x0F)
    aval = np.where(seg >= 8, 0x7F, (seg << 4) | low)
    table: npt.NDArray[np.uint8] = ((aval ^ mask) & 0xFF).astype(np.uint8)
    return table


@functools.cache
def _alaw_decode_table() -> npt.NDArray[np.int16]:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, t + 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    table: npt.NDArray[np.int16] = np.where(a & 0x80, t, -t).astype(np.int16)
    return table


def _g711_decode(data: bytes, encoding: Encoding) -> npt.NDArray[np.int16]:
    table = _ulaw_decode_table() if encoding == PCMU else _alaw_decode_table()
    out: npt.NDArray[np.int16] = table[np.frombuffer(data, dtype=np.uint8)]
    return out


def _g711_encode(samples: npt.NDArray[np.int16], encoding: Encoding) -> bytes:
    table = _ulaw_encode_table() if encoding == PCMU else _alaw_encode_table()
    return table[samples.astype(np.int32) + 32768].tobytes()


def decode(pcm: bytes, fmt: PcmFormat) -> FloatArray:
    """Bytes to float32 ``(frames, channels)``; raises ``invalid_pcm_length`` on a partial frame."""
    if len(pcm) % fmt.frame_bytes:
        raise BadEventError(
            ErrorCode.INVALID_PCM_LENGTH,
            f"{len(pcm)} bytes is not a whole number of {fmt.frame_bytes}-byte frames for {fmt}",
        )
    if fmt.encoding == S16LE:
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    elif fmt.encoding in (PCMU, PCMA):
        x = _g711_decode(pcm, fmt.encoding).astype(np.float32) / 32768.0
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
    if fmt.encoding in (PCMU, PCMA):
        return _g711_encode(_to_int16(x), fmt.encoding)
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


#: libsoxr's "high quality" recipe: 20-bit precision, linear phase, passband to 95% of the
#: lower rate's Nyquist, stopband from that Nyquist on. Measured at 48 -> 16 kHz: tones from
#: 8.5 to 23 kHz come out at least 136 dB down, 1-7 kHz within 0.01 dB (tests/test_audio.py
#: holds it to 60 and 0.5 dB). The other recipes, measured the same way: "MQ" holds back as
#: much output (the latency below) for 16-bit precision; "VHQ" holds back twice as much for
#: precision a 16-bit wire cannot carry; "LQ" half as much, but its passband ends at 80% of
#: Nyquist (-0.3 dB at 6 kHz, -12.8 dB at 7 kHz in a 16 kHz output: the top of speech).
RESAMPLE_QUALITY = "HQ"


def resampled_length(n: int, src_rate: int, dst_rate: int) -> int:
    """Samples that ``n`` input samples become: ``round(n * dst_rate / src_rate)``."""
    return round(n * dst_rate / src_rate)


class StreamingResampler:
    """A mono float32 resampler (libsoxr) that keeps its filter state across chunks.

    Any chunking of a signal, empty chunks included, gives exactly the samples of feeding it
    whole. libsoxr holds back the output it cannot finish yet (its filter's reach plus the DFT
    block it works in): on average about 21 ms at 48 <-> 16 kHz, up to about 37 ms; about
    64 ms (up to 115 ms) at 8 -> 16 kHz. ``flush`` returns it at the end of a stream.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._stream = (
            None
            if src_rate == dst_rate
            else soxr.ResampleStream(src_rate, dst_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY)
        )
        self._samples_in = 0
        self._samples_out = 0

    def process(self, x: npt.NDArray[np.floating]) -> FloatArray:
        """Resample a mono chunk; returns the output samples it completes (possibly none)."""
        chunk: FloatArray = np.ascontiguousarray(x, dtype=np.float32)
        if self._stream is None or len(chunk) == 0:
            return chunk
        out: FloatArray = self._stream.resample_chunk(chunk)
        self._samples_in += len(chunk)
        self._samples_out += len(out)
        return out

    def flush(self) -> FloatArray:
        """End the stream: the samples still held back, then start a fresh stream.

        Everything a stream returned, this included, is ``resampled_length`` of its input.
        """
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail: FloatArray = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        # libsoxr rounds an exact half the other way now and then (e.g. 3 samples at 8 -> 12 kHz
        # give 5, not round(4.5) == 4): trim or pad to the one length contract.
        want = max(0, resampled_length(self._samples_in, self.src_rate, self.dst_rate) - self._samples_out)
        if len(tail) >= want:
            tail = tail[:want]
        else:
            tail = np.concatenate([tail, np.zeros(want - len(tail), np.float32)])
        self.reset()
        return tail

    def reset(self) -> None:
        """Forget the stream so far (held samples and filter history): a fresh stream."""
        if self._stream is not None:
            self._stream.clear()
        self._samples_in = 0
        self._samples_out = 0


def resample(x: npt.NDArray[np.floating], src_rate: int, dst_rate: int) -> FloatArray:
    """Resample a whole mono signal to ``resampled_length(len(x), ...)`` samples.

    The same filter as ``StreamingResampler``: streaming a signal and flushing gives these
    very samples.
    """
    if src_rate == dst_rate:
        same: FloatArray = np.asarray(x, dtype=np.float32)
        return same
    r = StreamingResampler(src_rate, dst_rate)
    head = r.process(x)
    return np.concatenate([head, r.flush()])


class StreamConverter:
    """Converts a stream of PCM chunks from one format to another, statefully.

    Channels are averaged to mono, resampled (``StreamingResampler``) and written out in the
    destination's encoding and channel count. Between equal formats it is the identity: no
    copy and no state.
    """

    def __init__(self, src: PcmFormat, dst: PcmFormat) -> None:
        self.src = src
        self.dst = dst
        self._identity = src == dst
        self._resampler = (
            None
            if src.sample_rate_hz == dst.sample_rate_hz
            else StreamingResampler(src.sample_rate_hz, dst.sample_rate_hz)
        )

    def convert(self, pcm: bytes) -> bytes:
        """Validate and convert one chunk; raises ``invalid_pcm_length`` on a partial frame.

        A chunk that fails validation (a partial frame, NaN float PCM) changes no state.
        """
        if self._identity:
            if len(pcm) % self.src.frame_bytes:
                decode(pcm, self.src)  # raises the precise error
            return pcm
        mono = to_mono(decode(pcm, self.src))
        if self._resampler is not None:
            mono = self._resampler.process(mono)
        return encode(mono, self.dst)

    def flush(self) -> bytes:
        """End the stream (e.g. a reply's end): the samples the resampler still holds.

        Afterwards the converter starts a fresh stream. ``convert`` of a whole signal plus
        ``flush`` is as long as ``resample`` makes it.
        """
        if self._resampler is None:
            return b""
        return encode(self._resampler.flush(), self.dst)

    def reset(self) -> None:
        """Start over: drop what the resampler holds and its filter history."""
        if self._resampler is not None:
            self._resampler.reset()


#: Containers ``read_wav`` accepts (libsndfile's names): RIFF WAVE, WAVE_FORMAT_EXTENSIBLE, RF64.
_WAV_CONTAINERS = frozenset({"WAV", "WAVEX", "RF64"})


def read_wav(path: str | Path) -> tuple[FloatArray, int]:
    """Read a WAV file as float32 ``(frames, channels)`` in [-1, 1] and its sample rate.

    Any WAV that libsndfile decodes: 8/16/24/32-bit integer PCM, 32/64-bit IEEE float,
    WAVE_FORMAT_EXTENSIBLE headers, any channel count. Raises ``AudioFileError`` with a
    one-line reason for a missing, unreadable, non-WAV, malformed or empty file.
    """
    try:
        with open(path, "rb") as f, sf.SoundFile(f) as snd:
            if snd.format not in _WAV_CONTAINERS:
                raise AudioFileError(f"{path}: not a WAV file ({snd.format_info})")
            x: FloatArray = snd.read(dtype="float32", always_2d=True)
            rate = int(snd.samplerate)
    except sf.LibsndfileError as exc:
        raise AudioFileError(f"{path}: not a readable WAV file ({exc.error_string})") from exc
    except OSError as exc:
        raise AudioFileError(f"{path}: cannot open ({exc.strerror or exc})") from exc
    if len(x) == 0:
        raise AudioFileError(f"{path}: no audio frames")
    if not np.all(np.isfinite(x)):  # a float WAV can hold them; nothing downstream can
        raise AudioFileError(f"{path}: samples contain NaN or infinity")
    np.clip(x, -1.0, 1.0, out=x)  # a float WAV may also go past full scale
    return x, rate


def write_wav(
    path: str | Path, samples: npt.NDArray[np.floating], sample_rate_hz: int, *, g711: Encoding | None = None
) -> None:
    """Write float ``(frames,)`` or ``(frames, channels)`` as 16-bit PCM WAV, or with ``g711``
    (``PCMU`` or ``PCMA``) as a mu-law or A-law WAV (libsndfile's; decoded G.711 samples are
    written back as the same codes).

    Raises ``OSError`` when the file cannot be created.
    """
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 1:
        x = x[:, None]
    # Quantised here as ``encode`` does, not left to libsndfile's own float scaling: the file
    # holds the samples the wire would carry, and read_wav inverts them to one step.
    subtype = "PCM_16" if g711 is None else ("ULAW" if g711 == PCMU else "ALAW")
    with open(path, "wb") as f:
        sf.write(f, _to_int16(x), sample_rate_hz, format="WAV", subtype=subtype)


__all__ = [
    "F32LE",
    "G711_RATE",
    "PCM16K_MONO",
    "PCMA",
    "PCMA_8K",
    "PCMU",
    "PCMU_8K",
    "RESAMPLE_QUALITY",
    "S16LE",
    "SUPPORTED_RATES",
    "AudioFileError",
    "Encoding",
    "PcmFormat",
    "StreamConverter",
    "StreamingResampler",
    "decode",
    "encode",
    "read_wav",
    "resample",
    "resampled_length",
    "to_mono",
    "write_wav",
]
