"""``duplex talk`` against a real local stack: any input format, barge-in, bad files, no server."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duplex import talk
from duplex.audio import read_wav, resample, to_mono, write_wav
from duplex.stack import LocalStack, example_path

pytestmark = pytest.mark.process

HELLO = example_path("hello.wav")
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def stack():
    with LocalStack(workers=1, startup_timeout_s=60) as s:
        yield s


def make_variant(tmp_path, rate: int, channels: int):
    x, src_rate = read_wav(HELLO)
    y = resample(to_mono(x), src_rate, rate)
    path = tmp_path / f"hello-{rate}-{channels}ch.wav"
    write_wav(path, np.repeat(y[:, None], channels, axis=1), rate)
    return path


@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2)])
def test_talk_any_format(stack, tmp_path, capsys, rate, channels):
    src = make_variant(tmp_path, rate, channels)
    out = tmp_path / "reply.wav"
    code = talk.main([str(src), "-o", str(out), "--target", stack.target, "--fast", "--timeout", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for line in ("speech started", "speech stopped", "committed", "response started", "first audio"):
        assert line in captured.out, captured.out
    assert "response done" in captured.out and "completed" in captured.out
    assert "first audio" in captured.out and "-> first audio" in captured.out  # latency summary
    reply, reply_rate = read_wav(out)
    assert reply_rate == 16000 and reply.shape[1] == 1
    assert len(reply) / reply_rate > 2.0  # "Hello! This is a full duplex speech demo." comes back


@pytest.mark.parametrize(
    ("name", "header"),
    [
        ("speech_03_f32_48k.wav", "48000 Hz, 1 ch, 0.85 s"),  # 32-bit IEEE float
        ("speech_05_s24_ext_22k_stereo.wav", "22050 Hz, 2 ch, 0.92 s"),  # 24-bit WAVE_FORMAT_EXTENSIBLE
    ],
)
def test_talk_reads_float_and_extensible_wavs(stack, tmp_path, capsys, name, header):
    """Files the stdlib ``wave`` refused (made with sox, see tests/fixtures/make_format_fixtures.sh)."""
    out = tmp_path / "reply.wav"
    code = talk.main(
        [str(FIXTURES / name), "-o", str(out), "--target", stack.target, "--fast", "--timeout", "30"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"{name}: {header} -> {stack.target}" in captured.err  # read as what it is
    for line in ("speech started", "speech stopped", "committed", "response done", "completed"):
        assert line in captured.out, captured.out
    reply, reply_rate = read_wav(out)
    assert reply_rate == 16000 and reply.shape[1] == 1
    # The parrot plays the utterance back (pitch-shifted): about as long as the speech in it.
    assert 0.6 < len(reply) / reply_rate < 1.2


def test_talk_barge_in_truncates_reply(stack, tmp_path, capsys):
    out = tmp_path / "cut.wav"
    args = [str(HELLO), "-o", str(out), "--target", stack.target, "--fast", "--barge-in-after", "300"]
    code = talk.main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "barge-in sent" in captured.out and "audio cancelled" in captured.out
    reply, rate = read_wav(out)
    # Playback stopped 300 ms after the first audio: that is all the file keeps (full: ~3.4 s).
    assert abs(len(reply) / rate - 0.3) < 0.05


def test_talk_malformed_file(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not a wav file at all")
    # A subprocess: the exit code and the stderr a user sees, no server needed.
    proc = subprocess.run(
        [sys.executable, "-m", "duplex", "talk", str(bad), "--target", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.wav" in lines[0] and "WAV" in lines[0], proc.stderr


def test_talk_missing_file(tmp_path, capsys):
    assert talk.main([str(tmp_path / "nope.wav")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_talk_unreachable_target(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = talk.main(
        [str(HELLO), "-o", str(tmp_path / "r.wav"), "--target", f"127.0.0.1:{port}", "--connect-timeout", "1"]
    )
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"cannot reach 127.0.0.1:{port}" in err
    assert not (tmp_path / "r.wav").exists()


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit):
        talk.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "3  cannot reach" in out
