"""The Node Realtime example (examples/realtime-node/turn.mjs: the official ``openai`` npm package's
``OpenAIRealtimeWS``) against the Realtime edge of a real local stack, over wss (the SDK dials
nothing else; the edge's certificate from a test CA that Node is told to trust): one turn,
answered in ``audio/pcm`` 24 kHz.

Skipped when ``node`` is not on PATH or ``examples/realtime-node/node_modules`` is absent
(``npm ci --prefix examples/realtime-node --ignore-scripts`` installs it from the committed lock
file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import trustme

from duplex.client import load_wav_as
from duplex.stack import LocalStack
from realtime_service.protocol import PCM24K
from tests.procs import REPO
from tests.realtime_helpers import HELLO_SPEECH_S

pytestmark = pytest.mark.process

NODE = shutil.which("node")
EXAMPLE = REPO / "examples" / "realtime-node"


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.skipif(
    not (EXAMPLE / "node_modules").is_dir(),
    reason="examples/realtime-node/node_modules is absent: "
    "run `npm ci --prefix examples/realtime-node --ignore-scripts`",
)
def test_node_sdk_holds_a_turn_with_the_edge(tmp_path):
    assert NODE is not None
    pcm = tmp_path / "hello24k.pcm"
    pcm.write_bytes(load_wav_as(REPO / "examples" / "hello.wav", PCM24K))
    ca = trustme.CA()
    ca_pem, cert, key = tmp_path / "ca.pem", tmp_path / "edge.pem", tmp_path / "edge.key"
    ca.cert_pem.write_to_path(ca_pem)
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(cert)
    leaf.private_key_pem.write_to_path(key)
    env = {
        **os.environ,
        "OPENAI_API_KEY": "sk-test-node",
        "REALTIME_TIMEOUT_MS": "45000",
        "NODE_EXTRA_CA_CERTS": str(ca_pem),
    }
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    with LocalStack(realtime_port=0, realtime_args=tls) as stack:
        assert stack.realtime is not None
        base_url = f"https://{stack.realtime.grpc}/v1"  # the SDK's base URL: it dials wss://
        run = subprocess.run(
            [NODE, "turn.mjs", base_url, "parrot", str(pcm)],
            cwd=EXAMPLE,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    log = f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, log
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, log
    summary = json.loads(lines[0])

    assert summary["status"] == "completed", log
    seen = summary["events"]
    for kind in (
        "session.created",
        "session.updated",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.done",
    ):
        assert seen.get(kind, 0) >= 1, f"no {kind}\n{log}"
    assert seen["response.created"] == seen["response.done"] == 1, log
    assert "error" not in seen, log

    # The parrot's reply: the speech of hello.wav again, as 24 kHz PCM16.
    audio_bytes = summary["audio_bytes"]
    assert audio_bytes % PCM24K.frame_bytes == 0, log
    reply_s = audio_bytes / PCM24K.frame_bytes / PCM24K.sample_rate_hz
    assert HELLO_SPEECH_S - 1.0 < reply_s < HELLO_SPEECH_S + 2.0, log
