"""``duplex talk``: any input format, barge-in, bad files, no server.

The conversations run through the library (``InputAudio``, ``talk``, ``write_reply``,
``print_summary``: what the CLI is made of) against the in-process stack of tests/conftest.py;
the CLI itself -- its header line, exit codes and the reply file -- once end to end as a real
``python -m duplex talk`` process, and for what needs no server (bad files, help, no server).
"""

from __future__ import annotations

import asyncio
import io
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duplex import talk
from duplex.audio import PCM16K_MONO, PcmFormat, read_wav, resample, to_mono, write_wav
from duplex.client import DuplexClient
from duplex.stack import example_path
from tests.procs import REPO
from tests.session_helpers import InProcessStack

HELLO = example_path("hello.wav")
FIXTURES = Path(__file__).parent / "fixtures"
#: The session tier's clock 4x real time: the parrot is lockstep, so a reply plays out at the pace
#: of the silence the session feeds it (tests.session_helpers.FastClock). For the tests that check
#: a reply's events and content (the CLI process too: it is the client, the clock is the session
#: tier's); the barge-in (cut 300 ms after the first audio, a client-side time) runs in real time.
FAST = pytest.mark.stack(clock_speed=4.0)
TIMELINE = ("speech started", "speech stopped", "committed", "response started", "first audio")


def make_variant(tmp_path: Path, rate: int, channels: int) -> Path:
    x, src_rate = read_wav(HELLO)
    y = resample(to_mono(x), src_rate, rate)
    path = tmp_path / f"hello-{rate}-{channels}ch.wav"
    write_wav(path, np.repeat(y[:, None], channels, axis=1), rate)
    return path


async def talk_file(
    stack: InProcessStack, src: Path, out_path: Path, *, fmt: PcmFormat = PCM16K_MONO, **options: Any
) -> tuple[talk.TalkResult, str]:
    """What ``duplex talk SRC -o OUT --fast`` does after reading its arguments: talk, save the
    reply, print the summary; returns the result and the printed timeline. ``fmt``: the input
    format (``--codec``)."""
    audio = talk.InputAudio.load(src, fmt)
    out = io.StringIO()
    async with DuplexClient(stack.target) as client:
        result = await talk.talk(client, audio, realtime=False, out=out, err=io.StringIO(), **options)
    talk.write_reply(result, out_path)
    talk.print_summary(result, out_path, out)
    return result, out.getvalue()


@FAST
@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2)])
async def test_talk_any_format(stack: InProcessStack, tmp_path: Path, rate: int, channels: int) -> None:
    src = make_variant(tmp_path, rate, channels)
    out_path = tmp_path / "reply.wav"
    result, out = await talk_file(stack, src, out_path, timeout_s=30)
    assert result.ok and result.errors == [], result
    for line in TIMELINE:
        assert line in out, out
    assert "response done" in out and "completed" in out
    assert "first audio" in out and "-> first audio" in out  # latency summary
    reply, reply_rate = read_wav(out_path)
    assert reply_rate == 16000 and reply.shape[1] == 1
    assert len(reply) / reply_rate > 2.0  # "Hello! This is a full duplex speech demo." comes back


@FAST
async def test_talk_reads_extensible_wavs(stack: InProcessStack, tmp_path: Path) -> None:
    """A file the stdlib ``wave`` refused (made with sox, see tests/fixtures/make_format_fixtures.sh;
    the 32-bit float one goes through the CLI in test_talk_cli_end_to_end)."""
    audio = talk.InputAudio.load(FIXTURES / "speech_05_s24_ext_22k_stereo.wav")  # 24-bit EXTENSIBLE
    # Read as what it is (the CLI prints this header).
    header = f"{audio.source_rate} Hz, {audio.source_channels} ch, {audio.duration_ms / 1000:.2f} s"
    assert header == "22050 Hz, 2 ch, 0.92 s"
    out_path = tmp_path / "reply.wav"
    result, out = await talk_file(stack, audio.path, out_path, timeout_s=30)
    assert result.ok, result
    for line in ("speech started", "speech stopped", "committed", "response done", "completed"):
        assert line in out, out
    reply, reply_rate = read_wav(out_path)
    assert reply_rate == 16000 and reply.shape[1] == 1
    # The parrot plays the utterance back (pitch-shifted): about as long as the speech in it.
    assert 0.6 < len(reply) / reply_rate < 1.2


async def test_talk_barge_in_truncates_reply(stack: InProcessStack, tmp_path: Path) -> None:
    out_path = tmp_path / "cut.wav"
    result, out = await talk_file(stack, HELLO, out_path, barge_in_after_ms=300)
    assert result.ok, result
    assert "barge-in sent" in out and "audio cancelled" in out
    reply, rate = read_wav(out_path)
    # Playback stopped 300 ms after the first audio: the file keeps what had arrived by then
    # (the reply streams at about real time, so up to ~0.3 s; less when the machine is loaded),
    # never the rest of it (full: ~3.4 s).
    assert 0 < len(reply) / rate < 0.35


@FAST
@pytest.mark.process
async def test_talk_cli_end_to_end(stack: InProcessStack, tmp_path: Path) -> None:
    """The real ``duplex talk`` process against the in-process stack: a 32-bit float WAV (which
    the stdlib ``wave`` refused) is read as what it is, the reply written, exit code 0."""
    name = "speech_03_f32_48k.wav"
    out_path = tmp_path / "reply.wav"
    args = [str(FIXTURES / name), "-o", str(out_path), "--target", stack.target, "--fast", "--timeout", "30"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "duplex",
        "talk",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout_b, stderr_b = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stdout, stderr = stdout_b.decode(), stderr_b.decode()
    assert proc.returncode == 0, stderr
    assert f"{name}: 48000 Hz, 1 ch, 0.85 s -> {stack.target}" in stderr  # read as what it is
    for line in (*TIMELINE, "response done", "completed", "-> first audio", f"reply: {out_path}"):
        assert line in stdout, stdout
    reply, reply_rate = read_wav(out_path)
    assert reply_rate == 16000 and reply.shape[1] == 1
    # The parrot plays the utterance back (pitch-shifted): about as long as the speech in it.
    assert 0.6 < len(reply) / reply_rate < 1.2


@pytest.mark.process
def test_talk_malformed_file(tmp_path: Path) -> None:
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


def test_talk_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert talk.main([str(tmp_path / "nope.wav")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_talk_unreachable_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = talk.main(
        [
            str(HELLO),
            "-o",
            str(tmp_path / "r.wav"),
            "--target",
            f"127.0.0.1:{port}",
            "--connect-timeout",
            "0.2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"cannot reach 127.0.0.1:{port}" in err
    assert not (tmp_path / "r.wav").exists()


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        talk.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "3  cannot reach" in out
