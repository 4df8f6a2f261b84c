"""duplex.audio: format validation, PCM framing, seamless streaming resampling, WAV files."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from duplex import audio
from duplex.audio import PCM16K_MONO, AudioFileError, PcmFormat, StreamConverter, StreamingResampler
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2


def _fmt(enc: int = audio.S16LE, rate: int = 16000, ch: int = 1) -> common_pb2.AudioFormat:
    return common_pb2.AudioFormat(encoding=enc, sample_rate_hz=rate, channels=ch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "wire",
    [_fmt(enc=0), _fmt(enc=7), _fmt(rate=0), _fmt(rate=12345), _fmt(ch=0), _fmt(ch=3)],
)
def test_unknown_formats_are_rejected_with_a_stable_code(wire: common_pb2.AudioFormat) -> None:
    with pytest.raises(BadEventError) as exc:
        PcmFormat.from_proto(wire)
    assert exc.value.code == ErrorCode.UNSUPPORTED_AUDIO_FORMAT


def test_format_round_trips_and_sizes() -> None:
    fmt = PcmFormat.from_proto(_fmt(enc=audio.F32LE, rate=48000, ch=2))
    assert fmt.frame_bytes == 8
    assert fmt.bytes_for_ms(10) == 480 * 8
    assert PcmFormat.from_proto(fmt.to_proto()) == fmt


@pytest.mark.parametrize("n", [1, 3, 1023])
def test_partial_frames_are_invalid_pcm_length(n: int) -> None:
    with pytest.raises(BadEventError) as exc:
        audio.decode(bytes(n), PCM16K_MONO)
    assert exc.value.code == ErrorCode.INVALID_PCM_LENGTH
    with pytest.raises(BadEventError):
        StreamConverter(PCM16K_MONO, PCM16K_MONO).convert(bytes(n))


def test_float_pcm_with_nan_is_refused() -> None:
    fmt = PcmFormat(audio.F32LE, 16000, 1)
    with pytest.raises(BadEventError):
        audio.decode(np.array([0.1, np.nan], dtype="<f4").tobytes(), fmt)


def test_encode_decode_round_trip_s16_and_f32() -> None:
    x = np.linspace(-0.9, 0.9, 101, dtype=np.float32)
    for enc, tol in ((audio.S16LE, 1 / 32767), (audio.F32LE, 1e-7)):
        fmt = PcmFormat(enc, 16000, 1)
        y = audio.decode(audio.encode(x, fmt), fmt)[:, 0]
        assert np.max(np.abs(x - y)) <= tol


@settings(max_examples=60, deadline=None)
@example(rates=(48000, 16000), cuts=[3999])  # a chunk ending exactly on an output position
@example(rates=(44100, 16000), cuts=[0])  # an empty chunk
@given(
    rates=st.sampled_from([(8000, 16000), (44100, 16000), (48000, 16000), (16000, 24000), (22050, 16000)]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_streaming_resampler_is_seamless_across_chunks(rates: tuple[int, int], cuts: list[int]) -> None:
    """Any chunking of a signal gives exactly the samples of processing it whole."""
    src, dst = rates
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, 4000).astype(np.float32)
    whole = StreamingResampler(src, dst).process(x)
    r = StreamingResampler(src, dst)
    parts = [r.process(c) for c in np.split(x, sorted(set(cuts)))]
    pieced = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    assert len(pieced) == len(whole)
    np.testing.assert_allclose(pieced, whole, atol=1e-6)


def test_resample_keeps_pitch_and_duration() -> None:
    t = np.arange(44100) / 44100
    x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    y = audio.resample(x, 44100, 16000)
    assert len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) - 440) <= 1  # 1 s of audio: bin index == Hz


def test_stream_converter_mixes_stereo_to_mono_and_resamples() -> None:
    src = PcmFormat(audio.S16LE, 32000, 2)
    left = np.full(3200, 0.5, np.float32)
    stereo = np.stack([left, -left * 0.0], axis=1)
    out = StreamConverter(src, PCM16K_MONO).convert(audio.encode(stereo, src))
    y = audio.decode(out, PCM16K_MONO)[:, 0]
    assert 1590 <= len(y) <= 1600
    assert np.allclose(y[10:-10], 0.25, atol=2e-3)


def test_wav_round_trip(tmp_path: Path) -> None:
    x = np.stack([np.linspace(-0.5, 0.5, 800), np.zeros(800)], axis=1).astype(np.float32)
    path = tmp_path / "a.wav"
    audio.write_wav(path, x, 44100)
    y, rate = audio.read_wav(path)
    assert rate == 44100 and y.shape == (800, 2)
    assert np.max(np.abs(x - y)) <= 1 / 32767


def test_reads_24_bit_wav(tmp_path: Path) -> None:
    v = np.array([0, 1 << 22, -(1 << 22), (1 << 23) - 1], dtype=np.int64)
    raw = b"".join(int(s & 0xFFFFFF).to_bytes(3, "little") for s in v)
    path = tmp_path / "b.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(3)
        w.setframerate(8000)
        w.writeframes(raw)
    y, rate = audio.read_wav(path)
    assert rate == 8000
    np.testing.assert_allclose(y[:, 0], [0.0, 0.5, -0.5, 1.0], atol=1e-6)


@pytest.mark.parametrize("content", [b"", b"not a wav at all", b"RIFF\x00\x00\x00\x00WAVE"])
def test_malformed_wav_is_an_audio_file_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.wav"
    path.write_bytes(content)
    with pytest.raises(AudioFileError):
        audio.read_wav(path)


def test_missing_wav_is_an_audio_file_error(tmp_path: Path) -> None:
    with pytest.raises(AudioFileError):
        audio.read_wav(tmp_path / "missing.wav")
