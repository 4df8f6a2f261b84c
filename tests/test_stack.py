"""``duplex up`` leaves no process behind (SIGTERM, a crashed child, its own SIGKILL), and
``duplex demo`` -- the README's main-job command -- works from start to stop."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

import numpy as np
import pytest

from duplex import demo
from duplex.audio import read_wav
from duplex.stack import LocalStack, StackError
from tests.procs import pid_alive, spawn

pytestmark = pytest.mark.process


def start_up(*extra: str, timeout: float = 60.0) -> tuple[subprocess.Popen[str], dict]:
    """``python -m duplex up --json`` on free ports; returns it and its JSON "up" line."""
    proc = spawn(["up", "--json", "--session-port", "0", *extra])
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"duplex up exited with {proc.wait(10)} before it was up")
                msg = json.loads(line)
                if msg.get("event") == "up":
                    return proc, msg
        raise TimeoutError("duplex up did not come up")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


def child_pids(info: dict) -> list[int]:
    return [info["session"]["pid"], *(w["pid"] for w in info["workers"])]


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def kill_all(pids: list[int]) -> None:
    for pid in pids:  # only the ones this test started, by pid
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_up_sigterm_stops_everything():
    proc, info = start_up("--workers", "2")
    pids = child_pids(info)
    try:
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        assert info["target"].startswith("127.0.0.1:")
        assert info["session"]["metrics"].startswith("http://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert wait_gone(pids) == []
    finally:
        kill_all([proc.pid, *pids])
        proc.wait(10)


def test_up_exits_nonzero_when_a_child_crashes():
    proc, info = start_up()
    pids = child_pids(info)
    try:
        os.kill(info["workers"][0]["pid"], signal.SIGKILL)
        assert proc.wait(30) != 0
        assert wait_gone(pids) == []
    finally:
        kill_all([proc.pid, *pids])
        proc.wait(10)


def test_children_die_with_a_killed_up():
    proc, info = start_up()
    pids = child_pids(info)
    try:
        proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
        proc.wait(10)
        assert wait_gone(pids) == []
    finally:
        kill_all(pids)


def test_local_stack_fails_cleanly_on_a_bad_plugin():
    stack = LocalStack(plugin="no.such.module:Plugin", startup_timeout_s=30)
    with pytest.raises(StackError):
        stack.start()
    assert len(stack.started_pids) == 2 and stack.children == []
    assert wait_gone(stack.started_pids, 5) == []


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "reply.wav"
    code = demo.main(["--out", str(out), "--fast"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "first audio" in captured.out and str(out) in captured.out
    reply, rate = read_wav(out)
    assert rate == 16000 and len(reply) / rate > 2.0


def test_demo_of_the_cascade_says_back_what_it_heard(tmp_path, capsys):
    """``make demo``'s second half: examples/coffee.wav through the cascade, each stage its own
    worker process; the timeline shows the words heard and the reply's text, and all are stopped."""
    out = tmp_path / "reply.wav"
    code = demo.main(["--pipeline", "cascade", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "worker(s) of each cascade stage: asr, responder, tts" in captured.err
    assert "transcribed        turn 1: 'i would like a cup of coffee please'" in captured.out
    assert "'You said: i would like a cup of coffee please.'" in captured.out
    reply, rate = read_wav(out)
    assert rate == 16000 and len(reply) / rate > 3.0
    assert float(np.sqrt(np.mean(np.square(reply)))) > 0.02  # speech


def test_up_refuses_a_non_loopback_host_without_insecure(capsys):
    from duplex import stack as stack_cli

    assert stack_cli.main(["--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--insecure" in err and err.count("\n") == 1
