"""The Node example (examples/node/client.js) against a real local stack: it gets a reply, decodes
an error's stable code from the ``grpc-status-details-bin`` trailer, and resumes a session.

Skipped when ``node`` is not on PATH or ``examples/node/node_modules`` is absent (``npm ci --prefix
examples/node --ignore-scripts`` installs it from the committed lock file)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess

import pytest

from duplex.audio import read_wav
from tests.procs import REPO
from tests.test_stack import child_pids, kill_all, start_up, wait_gone

pytestmark = pytest.mark.process

NODE = shutil.which("node")
EXAMPLE = REPO / "examples" / "node"


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.skipif(
    not (EXAMPLE / "node_modules").is_dir(),
    reason="examples/node/node_modules is absent: run `npm ci --prefix examples/node --ignore-scripts`",
)
def test_node_client_talks_decodes_an_error_and_resumes(tmp_path):
    assert NODE is not None
    out = tmp_path / "reply.wav"
    proc, info = start_up()
    pids = [proc.pid, *child_pids(info)]
    try:
        run = subprocess.run(
            [NODE, "client.js", info["target"], str(REPO / "examples" / "hello.wav"), str(out)],
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=30,
        )
        log = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
        assert run.returncode == 0, log

        # 1. the reply: the parrot repeats the speech of hello.wav (3.36 s) at 16 kHz.
        reply, rate = read_wav(out)
        assert rate == 16000 and 2.0 < len(reply) / rate < 6.0, log
        assert re.search(r"^response done RESPONSE_STATUS_COMPLETED \d+ ms$", run.stdout, re.M), log

        # 2. the resume: `opened` again, for the same session.
        session_id = re.search(r"^opened (sess_\w+) ", run.stdout, re.M)
        assert session_id, log
        assert re.search(rf"^resumed: opened again {session_id.group(1)} ", run.stdout, re.M), log
        assert "closed: client_close" in run.stdout, log

        # 3. the stable code, decoded from google.rpc.Status -> ErrorInfo.
        refused = re.search(r"^refused: (\w+) reason=(\w+) domain=(\S+) ", run.stdout, re.M)
        assert refused and refused.groups() == ("INVALID_ARGUMENT", "model_mismatch", "duplex.v1"), log
    finally:
        proc.send_signal(signal.SIGTERM)  # `duplex up` stops its children; then anything left, by pid
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        kill_all(pids)
        proc.wait(10)
    assert wait_gone(pids, 10) == []
