"""duplex.audio: format validation, PCM framing, streaming resampling (libsoxr), WAV files (libsndfile)."""

from __future__ import annotations

import itertools
import struct
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import example, given, settings
from hypothesis import strategies as st

from duplex import audio
from duplex.audio import PCM16K_MONO, AudioFileError, PcmFormat, StreamConverter, StreamingResampler
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2

FIXTURES = Path(__file__).parent / "fixtures"
F32_48K = FIXTURES / "speech_03_f32_48k.wav"
S24_EXTENSIBLE = FIXTURES / "speech_05_s24_ext_22k_stereo.wav"


def _fmt(enc: int = audio.S16LE, rate: int = 16000, ch: int = 1) -> common_pb2.AudioFormat:
    return common_pb2.AudioFormat(encoding=enc, sample_rate_hz=rate, channels=ch)  # type: ignore[arg-type]


def _tone(freq_hz: float, rate: int, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _gain_db(y: np.ndarray, x: np.ndarray, rate: int) -> float:
    """Output RMS relative to input RMS, skipping 50 ms at each end (the filter's start-up
    and end transients: a tone that starts abruptly rings for the filter's length)."""
    skip = rate // 20
    return float(20 * np.log10(max(_rms(y[skip:-skip]), 1e-12) / _rms(x)))


def _convert_in_chunks(conv: StreamConverter, pcm: bytes, chunk_bytes: list[int]) -> bytes:
    """Feed ``pcm`` in pieces of the given sizes (cycled), then flush."""
    out, pos = [], 0
    for size in itertools.cycle(chunk_bytes):
        if pos >= len(pcm):
            break
        out.append(conv.convert(pcm[pos : pos + size]))
        pos += size
    out.append(conv.flush())
    return b"".join(out)


# --- Formats and PCM --------------------------------------------------------------------------


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
    for src in (PCM16K_MONO, PcmFormat(audio.S16LE, 48000, 1)):  # identity and resampling paths
        with pytest.raises(BadEventError) as exc:
            StreamConverter(src, PCM16K_MONO).convert(bytes(n))
        assert exc.value.code == ErrorCode.INVALID_PCM_LENGTH


def test_float_pcm_with_nan_is_refused() -> None:
    fmt = PcmFormat(audio.F32LE, 16000, 1)
    with pytest.raises(BadEventError) as exc:
        audio.decode(np.array([0.1, np.nan], dtype="<f4").tobytes(), fmt)
    assert exc.value.code == ErrorCode.INVALID_EVENT


def test_encode_decode_round_trip_s16_and_f32() -> None:
    x = np.linspace(-0.9, 0.9, 101, dtype=np.float32)
    for enc, tol in ((audio.S16LE, 1 / 32767), (audio.F32LE, 1e-7)):
        fmt = PcmFormat(enc, 16000, 1)
        y = audio.decode(audio.encode(x, fmt), fmt)[:, 0]
        assert np.max(np.abs(x - y)) <= tol


# --- Resampling: filter quality ---------------------------------------------------------------


@pytest.mark.parametrize("freq_hz", [8500, 9000, 10000, 12000, 14000, 16000, 20000, 23000])
def test_tones_above_the_output_nyquist_are_attenuated_60_db(freq_hz: int) -> None:
    """48 -> 16 kHz: what lies above 8 kHz must not alias back into the band (the old linear
    interpolator let 10/12/14 kHz through at -5.9/-9.5/-15.9 dB)."""
    x = _tone(freq_hz, 48000)
    assert _gain_db(audio.resample(x, 48000, 16000), x, 16000) <= -60.0
    # Streaming, in uneven chunks (float PCM so that 16-bit quantisation does not set the floor).
    src, dst = PcmFormat(audio.F32LE, 48000, 1), PcmFormat(audio.F32LE, 16000, 1)
    out = _convert_in_chunks(StreamConverter(src, dst), audio.encode(x, src), [4 * 480, 4 * 7, 4 * 1031])
    assert _gain_db(audio.decode(out, dst)[:, 0], x, 16000) <= -60.0


@pytest.mark.parametrize(("src", "freq_hz"), [(44100, 10000), (44100, 14000), (32000, 12000), (24000, 9000)])
def test_other_rates_reject_content_above_16k_nyquist(src: int, freq_hz: int) -> None:
    x = _tone(freq_hz, src)
    assert _gain_db(audio.resample(x, src, 16000), x, 16000) <= -60.0


@pytest.mark.parametrize(
    ("src", "dst", "freq_hz"),
    [(48000, 16000, 1000), (48000, 16000, 3000), (48000, 16000, 6000), (16000, 48000, 1000),
     (8000, 16000, 1000), (44100, 16000, 440), (16000, 24000, 5000)],
)  # fmt: skip
def test_in_band_tones_pass_within_half_a_db(src: int, dst: int, freq_hz: int) -> None:
    x = _tone(freq_hz, src)
    assert abs(_gain_db(audio.resample(x, src, dst), x, dst)) <= 0.5


def test_upsampling_adds_no_images() -> None:
    """16 -> 48 kHz: a 3 kHz tone's images (13, 19 kHz, ...) stay at least 60 dB down."""
    y = audio.resample(_tone(3000, 16000), 16000, 48000)[2400:-2400]
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    freqs = np.fft.rfftfreq(len(y), 1 / 48000)
    assert 20 * np.log10(spectrum[freqs > 8000].max() / spectrum.max()) <= -60.0


def test_resample_keeps_pitch_and_duration() -> None:
    y = audio.resample(_tone(440, 44100), 44100, 16000)
    assert len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) - 440) <= 1  # 1 s of audio: bin index == Hz


# --- Resampling: streaming --------------------------------------------------------------------

_RATE_PAIRS = [(a, b) for a, b in itertools.permutations(audio.SUPPORTED_RATES, 2)]


@settings(max_examples=60, deadline=None)
@example(rates=(48000, 16000), cuts=[3999])  # a chunk ending exactly on an output position
@example(rates=(44100, 16000), cuts=[0])  # an empty first chunk
@example(rates=(8000, 16000), cuts=[100, 100, 100, 4000])  # empty chunks mid-stream and at the end
@given(
    rates=st.sampled_from(_RATE_PAIRS),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_streaming_resampler_is_seamless_across_chunks(rates: tuple[int, int], cuts: list[int]) -> None:
    """Any chunking of a signal, empty chunks included, gives exactly the samples of feeding it
    whole, and the stream plus its flush is ``resample`` of the whole signal.

    Exact, not merely close: libsoxr queues input in a FIFO and filters it in blocks of a size
    it fixes at creation, so the same arithmetic runs whatever the chunk boundaries.
    """
    src, dst = rates
    x = np.random.default_rng(1).uniform(-1, 1, 4000).astype(np.float32)
    r = StreamingResampler(src, dst)
    whole = np.concatenate([r.process(x), r.flush()])
    r = StreamingResampler(src, dst)
    parts = [r.process(c) for c in np.split(x, sorted(cuts))]
    pieced = np.concatenate([*parts, r.flush()])
    np.testing.assert_array_equal(pieced, whole)
    np.testing.assert_array_equal(whole, audio.resample(x, src, dst))
    assert len(whole) == audio.resampled_length(len(x), src, dst)


@settings(max_examples=40, deadline=None)
@given(
    rates=st.sampled_from(_RATE_PAIRS),
    src_channels=st.sampled_from([1, 2]),
    encodings=st.sampled_from(list(itertools.product([audio.S16LE, audio.F32LE], repeat=2))),
    cuts=st.lists(st.integers(min_value=0, max_value=1500), max_size=8),
)
def test_stream_converter_output_does_not_depend_on_chunking(
    rates: tuple[int, int],
    src_channels: int,
    encodings: tuple[audio.Encoding, audio.Encoding],
    cuts: list[int],
) -> None:
    src = PcmFormat(encodings[0], rates[0], src_channels)
    dst = PcmFormat(encodings[1], rates[1], 1)
    x = np.random.default_rng(2).uniform(-0.9, 0.9, (1500, src_channels)).astype(np.float32)
    pcm = audio.encode(x, src)
    conv = StreamConverter(src, dst)
    whole = conv.convert(pcm) + conv.flush()
    edges = [0, *(c * src.frame_bytes for c in sorted(cuts)), len(pcm)]
    conv = StreamConverter(src, dst)
    pieced = b"".join(conv.convert(pcm[a:b]) for a, b in itertools.pairwise(edges)) + conv.flush()
    assert pieced == whole
    n_out = audio.resampled_length(1500, src.sample_rate_hz, dst.sample_rate_hz)
    assert len(whole) == n_out * dst.frame_bytes


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 101, 4001])
def test_resample_length_contract_for_every_supported_pair(n: int) -> None:
    """round(n * dst / src) samples, ties included (libsoxr itself sometimes rounds a tie up)."""
    x = np.random.default_rng(n).uniform(-1, 1, n).astype(np.float32)
    for src, dst in _RATE_PAIRS:
        assert len(audio.resample(x, src, dst)) == round(n * dst / src), (src, dst)


def test_flush_returns_the_held_tail_and_starts_a_fresh_stream() -> None:
    src, dst = PcmFormat(audio.S16LE, 48000, 1), PCM16K_MONO
    x = _tone(1000, 48000, seconds=0.5)
    pcm = audio.encode(x, src)
    conv = StreamConverter(src, dst)
    head = b"".join(conv.convert(pcm[i : i + 1920]) for i in range(0, len(pcm), 1920))  # 20 ms chunks
    expected = audio.encode(audio.resample(audio.decode(pcm, src)[:, 0], 48000, 16000), dst)
    assert len(head) < len(expected)  # the resampler holds some output back...
    tail = conv.flush()
    assert tail and head + tail == expected  # ...which flush hands over, to the exact length
    assert conv.flush() == b""  # nothing held after a flush
    assert conv.convert(pcm) + conv.flush() == expected  # a fresh stream, as from a new converter


def test_reset_drops_held_samples_and_filter_history() -> None:
    src, dst = PcmFormat(audio.F32LE, 44100, 2), PcmFormat(audio.S16LE, 16000, 1)
    rng = np.random.default_rng(3)
    a = audio.encode(rng.uniform(-0.5, 0.5, (4410, 2)), src)
    b = audio.encode(rng.uniform(-0.5, 0.5, (4410, 2)), src)
    fresh = StreamConverter(src, dst)
    expected = fresh.convert(b) + fresh.flush()
    conv = StreamConverter(src, dst)
    conv.convert(a)
    conv.reset()
    assert conv.flush() == b""  # nothing of a is left
    conv.convert(a)
    conv.reset()
    assert conv.convert(b) + conv.flush() == expected  # b alone, as if a had never been


def test_a_refused_chunk_leaves_the_stream_untouched() -> None:
    src, dst = PcmFormat(audio.F32LE, 48000, 1), PCM16K_MONO
    rng = np.random.default_rng(4)
    a, b = (audio.encode(rng.uniform(-0.5, 0.5, 4800), src) for _ in range(2))
    ref = StreamConverter(src, dst)
    expected = ref.convert(a) + ref.convert(b) + ref.flush()
    conv = StreamConverter(src, dst)
    got = conv.convert(a)
    for bad, code in ((b"\0" * 5, ErrorCode.INVALID_PCM_LENGTH), (np.array([np.nan], "<f4").tobytes(), None)):
        with pytest.raises(BadEventError) as exc:
            conv.convert(bad)
        assert code is None or exc.value.code == code
    assert got + conv.convert(b) + conv.flush() == expected


def test_equal_formats_are_the_identity_and_hold_nothing() -> None:
    fmt = PcmFormat(audio.S16LE, 24000, 2)
    pcm = audio.encode(np.random.default_rng(5).uniform(-0.5, 0.5, (480, 2)), fmt)
    conv = StreamConverter(fmt, fmt)
    assert conv.convert(pcm) is pcm  # not even a copy
    assert conv.flush() == b""
    conv.reset()
    assert conv.convert(pcm) is pcm


def test_same_rate_conversion_holds_nothing() -> None:
    src, dst = PcmFormat(audio.F32LE, 16000, 2), PCM16K_MONO
    x = np.stack([np.full(160, 0.5), np.zeros(160)], axis=1)
    conv = StreamConverter(src, dst)
    y = audio.decode(conv.convert(audio.encode(x, src)), dst)[:, 0]
    np.testing.assert_allclose(y, 0.25, atol=1 / 32768)
    assert conv.flush() == b""


def test_stream_converter_mixes_stereo_to_mono_and_resamples() -> None:
    src = PcmFormat(audio.S16LE, 32000, 2)
    left = np.full(3200, 0.5, np.float32)
    stereo = np.stack([left, np.zeros_like(left)], axis=1)
    conv = StreamConverter(src, PCM16K_MONO)
    out = conv.convert(audio.encode(stereo, src)) + conv.flush()
    y = audio.decode(out, PCM16K_MONO)[:, 0]
    assert len(y) == 1600
    # A step from and back to silence rings at its two edges (a band-limited step): the middle is flat.
    np.testing.assert_allclose(y[100:-100], 0.25, atol=2e-3)


# --- WAV files --------------------------------------------------------------------------------


def _format_tag(path: Path) -> int:
    """The WAVE format tag of ``path``'s "fmt " chunk (3: IEEE float, 0xFFFE: extensible)."""
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    pos = 12
    while data[pos : pos + 4] != b"fmt ":
        pos += 8 + struct.unpack_from("<I", data, pos + 4)[0]
    tag: int = struct.unpack_from("<H", data, pos + 8)[0]
    return tag


def _wave_refuses(path: Path) -> bool:
    try:
        wave.open(str(path), "rb").close()
    except wave.Error:
        return True
    return False


def _fixture_speech(name: str, rate: int) -> np.ndarray:
    x, src_rate = audio.read_wav(FIXTURES / name)
    return audio.resample(audio.to_mono(x), src_rate, rate)


def test_reads_ieee_float_48k_fixture() -> None:
    assert _format_tag(F32_48K) == 3  # WAVE_FORMAT_IEEE_FLOAT
    if sys.version_info < (3, 15):  # 3.15's wave reads IEEE float
        assert _wave_refuses(F32_48K)
    x, rate = audio.read_wav(F32_48K)
    assert rate == 48000 and x.shape == (40632, 1) and x.dtype == np.float32
    # The same speech as the 16 kHz original it was made from (sox's resampler, not ours).
    original = _fixture_speech("speech_03.wav", 48000)
    assert np.corrcoef(x[: len(original), 0], original[: len(x)])[0, 1] > 0.99


def test_reads_24_bit_wave_format_extensible_fixture() -> None:
    assert _format_tag(S24_EXTENSIBLE) == 0xFFFE  # WAVE_FORMAT_EXTENSIBLE
    assert sf.info(str(S24_EXTENSIBLE)).subtype == "PCM_24"
    if sys.version_info < (3, 12):  # 3.12's wave reads extensible PCM
        assert _wave_refuses(S24_EXTENSIBLE)
    x, rate = audio.read_wav(S24_EXTENSIBLE)
    assert rate == 22050 and x.shape == (20296, 2)
    np.testing.assert_array_equal(x[:, 0], x[:, 1])  # sox copied the mono original to both channels
    original = _fixture_speech("speech_05.wav", 22050)
    assert np.corrcoef(x[: len(original), 0], original[: len(x)])[0, 1] > 0.99


def test_wav_round_trip(tmp_path: Path) -> None:
    x = np.stack([np.linspace(-0.5, 0.5, 800), np.zeros(800)], axis=1).astype(np.float32)
    path = tmp_path / "a.wav"
    audio.write_wav(path, x, 44100)
    assert _format_tag(path) == 1 and sf.info(str(path)).subtype == "PCM_16"
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


@pytest.mark.parametrize(
    ("subtype", "tol"),
    [("PCM_U8", 1 / 128), ("PCM_16", 1 / 32768), ("PCM_24", 2**-23), ("PCM_32", 1e-7), ("FLOAT", 0.0),
     ("DOUBLE", 0.0)],
)  # fmt: skip
@pytest.mark.parametrize("extensible", [False, True])
def test_reads_every_pcm_and_float_width(tmp_path: Path, subtype: str, tol: float, extensible: bool) -> None:
    x = np.stack([np.linspace(-0.75, 0.75, 300), np.linspace(0.5, -0.5, 300)], axis=1).astype(np.float32)
    path = tmp_path / f"{subtype}.wav"
    sf.write(str(path), x, 11025, format="WAVEX" if extensible else "WAV", subtype=subtype)
    y, rate = audio.read_wav(path)
    assert rate == 11025 and y.shape == (300, 2) and y.dtype == np.float32
    assert np.max(np.abs(x - y)) <= tol


def test_float_wav_with_nan_is_an_audio_file_error(tmp_path: Path) -> None:
    path = tmp_path / "nan.wav"
    sf.write(str(path), np.array([0.1, np.nan, 0.2], np.float32), 16000, subtype="FLOAT")
    with pytest.raises(AudioFileError, match="NaN"):
        audio.read_wav(path)


def _valid_wav_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "ok.wav"
    audio.write_wav(path, np.linspace(-0.5, 0.5, 100), 16000)
    return path.read_bytes()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not a readable WAV"),
        (b"not a wav at all", "not a readable WAV"),
        (b"RIFF\x00\x00\x00\x00WAVE", "not a readable WAV"),
        (lambda ok: ok[:30], "not a readable WAV"),  # cut inside the header
        (lambda ok: ok[:44], "no audio frames"),  # a header and no samples
        (lambda ok: ok[:45], "no audio frames"),  # half a sample
    ],
)
def test_malformed_wav_is_an_audio_file_error(tmp_path: Path, content: object, reason: str) -> None:
    path = tmp_path / "bad.wav"
    path.write_bytes(content(_valid_wav_bytes(tmp_path)) if callable(content) else content)  # type: ignore[arg-type]
    with pytest.raises(AudioFileError, match=reason) as exc:
        audio.read_wav(path)
    assert str(path) in str(exc.value)


def test_truncated_data_keeps_the_whole_frames_present(tmp_path: Path) -> None:
    path = tmp_path / "cut.wav"
    path.write_bytes(_valid_wav_bytes(tmp_path)[: 44 + 2 * 60 + 1])  # 60 samples and one byte
    x, rate = audio.read_wav(path)
    assert rate == 16000 and x.shape == (60, 1)


def test_other_containers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tone.wav"  # the name does not make it a WAV
    sf.write(str(path), np.zeros(100, np.float32), 16000, format="AIFF")
    with pytest.raises(AudioFileError, match="not a WAV file"):
        audio.read_wav(path)


def test_missing_wav_is_an_audio_file_error(tmp_path: Path) -> None:
    with pytest.raises(AudioFileError, match="No such file"):
        audio.read_wav(tmp_path / "missing.wav")
