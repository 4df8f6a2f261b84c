"""G.711 (mu-law ``PCMU`` and A-law ``PCMA``, 8 kHz mono) on the wire: the codec against sox as
the reference encoder, the formats a session accepts, and a telephone-audio conversation through
``duplex talk`` both ways."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from duplex import talk
from duplex.audio import PCMA, PCMA_8K, PCMU, PCMU_8K, Encoding, PcmFormat, decode, encode, read_wav
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2
from tests.session_helpers import InProcessStack
from tests.test_talk import FAST, HELLO, TIMELINE, talk_file

SOX = shutil.which("sox")
needs_sox = pytest.mark.skipif(SOX is None, reason="sox (the reference encoder) is not installed")
LAWS = [(PCMU, PCMU_8K, "mu-law"), (PCMA, PCMA_8K, "a-law")]
ALL_S16 = np.arange(-32768, 32768, dtype=np.int16)


def sox_encode(pcm16: np.ndarray, law: str, tmp: Path) -> np.ndarray:
    """sox's codes for 16-bit samples (no dither: sox dithers when it reduces bits)."""
    src, dst = tmp / "in.raw", tmp / "out.raw"
    src.write_bytes(pcm16.astype("<i2").tobytes())
    raw = ["-t", "raw", "-r", "8000", "-c", "1"]
    subprocess.run(
        [SOX, "-D", *raw, "-e", "signed", "-b", "16", src, *raw, "-e", law, "-b", "8", dst], check=True
    )
    return np.frombuffer(dst.read_bytes(), np.uint8)


def sox_decode(codes: bytes, law: str, tmp: Path) -> np.ndarray:
    src, dst = tmp / "in.g711", tmp / "out.raw"
    src.write_bytes(codes)
    raw = ["-t", "raw", "-r", "8000", "-c", "1"]
    subprocess.run([SOX, *raw, "-e", law, "-b", "8", src, *raw, "-e", "signed", "-b", "16", dst], check=True)
    return np.frombuffer(dst.read_bytes(), "<i2")


def levels(fmt: PcmFormat) -> np.ndarray:
    """Every code's decoded sample, by code."""
    return np.round(decode(bytes(range(256)), fmt)[:, 0] * 32768).astype(np.int64)


@needs_sox
@pytest.mark.parametrize(("encoding", "fmt", "law"), LAWS)
def test_decoding_is_the_reference_decoding_for_every_code(
    encoding: Encoding, fmt: PcmFormat, law: str, tmp_path: Path
) -> None:
    assert np.array_equal(levels(fmt), sox_decode(bytes(range(256)), law, tmp_path))


@needs_sox
@pytest.mark.parametrize(("encoding", "fmt", "law"), LAWS)
def test_encoding_every_sample_agrees_with_the_reference_within_one_level(
    encoding: Encoding, fmt: PcmFormat, law: str, tmp_path: Path
) -> None:
    ours = np.frombuffer(encode(ALL_S16.astype(np.float32) / 32768.0, fmt), np.uint8)
    ref = sox_encode(ALL_S16, law, tmp_path)
    assert len(ours) == len(ref) == 65536
    assert (ours == ref).mean() > 0.98  # sox rounds to 14 bits first; G.711's code truncates
    # Where they differ, the two codes are neighbouring levels around the sample.
    lv = levels(fmt)
    differ = np.flatnonzero(ours != ref)
    step = np.abs(lv[ours[differ]] - lv[ref[differ]])
    ordered = np.sort(lv)
    gap = np.diff(ordered)
    widest_around = gap[np.clip(np.searchsorted(ordered, ALL_S16[differ]) - 1, 0, len(gap) - 1)]
    assert np.all(step <= widest_around * 2), "codes more than a level apart"


@pytest.mark.parametrize(("encoding", "fmt", "law"), LAWS)
def test_a_round_trip_stays_within_g711s_quantisation(encoding: Encoding, fmt: PcmFormat, law: str) -> None:
    t = np.arange(8000) / 8000
    x = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t)).astype(np.float32)
    y = decode(encode(x, fmt), fmt)[:, 0]
    assert len(encode(x, fmt)) == len(x)  # one byte a sample
    err = y - x
    snr_db = 10 * np.log10(np.sum(x**2) / np.sum(err**2))
    assert snr_db > 33, snr_db  # G.711 holds about 38 dB on a loud signal
    # Every sample lands on the level nearest below or above it: never past the next one.
    lv = np.sort(levels(fmt)) / 32768.0
    below = lv[np.clip(np.searchsorted(lv, x) - 1, 0, 255)]
    above = lv[np.clip(np.searchsorted(lv, x), 0, 255)]
    assert np.all((y >= below - 1e-6) & (y <= above + 1e-6))


@pytest.mark.parametrize(
    ("encoding", "rate", "channels"), [(PCMU, 16000, 1), (PCMA, 8000, 2), (PCMU, 48000, 2)]
)
def test_g711_is_8_khz_mono_only(encoding: Encoding, rate: int, channels: int) -> None:
    wire = common_pb2.AudioFormat(encoding=encoding, sample_rate_hz=rate, channels=channels)
    with pytest.raises(BadEventError) as err:
        PcmFormat.from_proto(wire)
    assert err.value.code == ErrorCode.UNSUPPORTED_AUDIO_FORMAT
    assert PcmFormat.from_proto(
        common_pb2.AudioFormat(encoding=encoding, sample_rate_hz=8000, channels=1)
    ).g711


@FAST
@pytest.mark.parametrize("codec", ["pcmu", "pcma"])
async def test_a_telephone_call_in_g711_both_ways(stack: InProcessStack, tmp_path: Path, codec: str) -> None:
    """``duplex talk --codec pcmu|pcma``: the input goes as G.711 at 8 kHz, the reply comes back so
    and is saved as a G.711 WAV."""
    fmt = talk.CODECS[codec]
    out_path = tmp_path / "reply.wav"
    audio = talk.InputAudio.load(HELLO, fmt)
    assert len(audio.pcm) == round(audio.duration_ms * 8)  # one byte per 8 kHz sample
    result, out = await talk_file(stack, HELLO, out_path, fmt=fmt, timeout_s=30)
    assert result.ok and result.errors == [], result
    for line in TIMELINE:
        assert line in out, out
    assert result.reply_format == fmt
    info = sf.info(str(out_path))
    assert (info.samplerate, info.channels, info.subtype) == (8000, 1, "ULAW" if codec == "pcmu" else "ALAW")
    reply, _ = read_wav(out_path)
    assert len(reply) / 8000 > 2.0  # "Hello! This is a full duplex speech demo." comes back
    assert float(np.sqrt(np.mean(reply**2))) > 0.01  # audio, not silence
