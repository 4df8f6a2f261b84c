"""go_away -> automatic resume against real services: two session-service replicas (same
resume secret) share one worker; the client's channel lists both addresses (pick_first),
the way a load-balanced Service looks to a client. Draining the first replica must move the
session to the second without the caller doing anything."""

from __future__ import annotations

import asyncio
import signal

import pytest

from duplex.audio import PCM16K_MONO
from duplex.client import DuplexClient, event_kind, load_wav_as
from duplex.stack import DEFAULT_PLUGIN, LocalStack, example_path
from duplex.v1 import session_pb2
from tests.procs import start_service

pytestmark = pytest.mark.process

SECRET = "test-resume-secret"


@pytest.fixture(scope="module")
def replicas():
    with LocalStack(workers=1, session_args=["--resume-secret", SECRET], startup_timeout_s=60) as stack:
        second = start_service(
            [
                "session",
                "--plugin",
                DEFAULT_PLUGIN,
                "--workers",
                stack.worker_children[0].grpc,
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "0",
                "--resume-secret",
                SECRET,
            ]
        )
        try:
            yield stack, second
        finally:
            second.terminate()


async def test_go_away_resumes_on_another_replica(replicas):
    stack, second = replicas
    assert stack.session is not None
    target = f"ipv4:{stack.target},{second.grpc}"  # pick_first: the first replica while it lives
    async with DuplexClient(target) as client:
        session = await client.open_session()
        first_epoch = session.epoch
        assert event_kind(await session.wait_for("opened", timeout_s=5)) == "opened"  # the first one
        stack.session.proc.send_signal(signal.SIGTERM)  # drain replica 1
        go_away = await session.wait_for("go_away", timeout_s=20)
        assert go_away.go_away.resume_token
        resumed = await session.wait_for("opened", timeout_s=20)
        assert resumed.opened.session_id == session.session_id
        assert session.epoch > first_epoch and session.seq.last == 0
        # The conversation carries on over the second replica.
        pcm = load_wav_as(example_path("hello.wav"), PCM16K_MONO) + b"\0\0" * 16000
        sender = asyncio.create_task(session.stream_audio([pcm]))
        done = await session.wait_for("response_done", timeout_s=30)
        assert done.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        await sender
        await session.close()
