"""go_away -> automatic resume: two session-service replicas (same resume secret) share one
worker, in this process; the client's channel lists both addresses (pick_first), the way a
load-balanced Service looks to a client. Draining the first replica must move the session to the
second without the caller doing anything."""

from __future__ import annotations

import asyncio

import pytest

from duplex.audio import PCM16K_MONO
from duplex.client import DuplexClient, event_kind, load_wav_as
from duplex.stack import example_path
from duplex.v1 import session_pb2
from tests.session_helpers import InProcessStack, sample
from tests.worker_helpers import wait_until

DRAINING = {"code": "draining"}


# The session tier's clock at 4x real time: the reply after the resume plays out at the pace of
# the silence it feeds the lockstep parrot (tests.session_helpers.FastClock).
@pytest.mark.stack(replicas=2, clock_speed=4.0)
async def test_go_away_resumes_on_another_replica(stack: InProcessStack) -> None:
    first, second = stack.sessions
    target = f"ipv4:{first.address},{second.address}"  # pick_first: the first replica while it lives
    async with DuplexClient(target) as client:
        session = await client.open_session()
        first_epoch = session.epoch
        assert event_kind(await session.wait_for("opened", timeout_s=5)) == "opened"  # the first one
        assert first.registry.get(session.session_id) is not None  # it lives on replica 1
        refused_before = sample("duplex_session_errors_total", DRAINING)
        # Drain replica 1 (what its process does on SIGTERM), then stop it.
        drained = asyncio.create_task(first.drain())
        go_away = await session.wait_for("go_away", timeout_s=20)
        assert go_away.go_away.resume_token
        await asyncio.wait_for(drained, 15)
        # The client retries its resume on replica 1 (its channel's first address) until that is
        # gone; stop it once it has refused one (draining), between the client's attempts: a
        # resume in flight when the server stops ends CANCELLED, which the client does not retry.
        await wait_until(lambda: sample("duplex_session_errors_total", DRAINING) > refused_before)
        await asyncio.wait_for(first.stop(), 15)
        resumed = await session.wait_for("opened", timeout_s=20)
        assert resumed.opened.session_id == session.session_id
        assert session.epoch > first_epoch and session.seq.last == 0
        assert second.registry.get(session.session_id) is not None  # now on replica 2
        # The conversation carries on over the second replica.
        pcm = load_wav_as(example_path("hello.wav"), PCM16K_MONO) + b"\0\0" * 16000
        sender = asyncio.create_task(session.stream_audio([pcm]))
        done = await session.wait_for("response_done", timeout_s=30)
        assert done.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        await sender
        await session.close()
