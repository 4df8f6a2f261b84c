"""The secure deployment harness (``tests.secure_stack``) itself: the README's secure stack comes
up as real processes, a caller with a token holds a conversation through both TLS hops, a caller
without one is refused, and every process is gone afterwards, cleanly."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from duplex.audio import PCM16K_MONO
from duplex.v1 import session_pb2
from tests.procs import pid_alive
from tests.secure_stack import secure_stack
from tests.session_helpers import Conversation, open_event, speech, to_16k, utterance_pcm

pytestmark = pytest.mark.process


async def test_secure_stack_serves_a_token_holder_and_refuses_a_caller_without_one(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with secure_stack(tmp_path, workers=2, replicas=1) as stack:
        started = time.monotonic() - t0
        procs = stack.processes
        assert [p.name for p in procs] == ["r0", "w0", "w1"]
        voice = speech(0)
        async with stack.api_channel(0, principal="victim") as ch:
            conv = Conversation(ch).start(open_event())
            sid = (await conv.wait_kind("opened", within=10)).opened.session_id
            assert sid
            await conv.stream(utterance_pcm(voice, PCM16K_MONO), PCM16K_MONO)
            done = (await conv.wait_kind("response_done", within=20)).response_done
            assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, conv.kinds()
            reply = to_16k(
                b"".join(
                    e.audio_delta.pcm
                    for e in conv.of("audio_delta")
                    if e.audio_delta.response_id == done.response_id
                ),
                PCM16K_MONO,
            )
            # The parrot says the utterance back (pitch-shifted): about as long as it.
            assert 0.7 * len(voice) < len(reply) < 1.6 * len(voice), (len(reply), len(voice))
            assert conv.of("error") == []
            conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await conv.wait_done()
            assert conv.status == grpc.StatusCode.OK, conv.error

        # No token: refused before any session state exists.
        async with stack.api_channel(0) as ch:
            anon = Conversation(ch).start(open_event())
            await anon.wait_done()
            assert anon.status == grpc.StatusCode.UNAUTHENTICATED
            assert anon.error is not None and anon.error.code == "unauthenticated"
            assert anon.events == []
    stopped = time.monotonic() - t0
    print(f"secure stack: up in {started:.1f}s, test and stop done at {stopped:.1f}s")

    assert not [p.pid for p in procs if pid_alive(p.pid)]
    assert {p.name: p.returncode for p in procs} == {"r0": 0, "w0": 0, "w1": 0}
    for p in procs:
        assert "Traceback" not in p.log_text(), f"{p.name}: {p.log}"
