"""Sessions belong to who opened them, and resume tokens behave like tokens: the trust issue's
token attacks, end to end against in-process stacks (a parrot worker, session replicas, the
Python client over real gRPC)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from duplex.client import DuplexClient
from duplex.errors import DuplexError
from tests.session_helpers import in_process_stack, sample

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"


def _tokens(path: Path) -> Path:
    path.write_text(
        "".join(
            f"{p}:{hashlib.sha256(t.encode()).hexdigest()}\n" for t, p in ((ALICE, "alice"), (BOB, "bob"))
        )
    )
    return path


async def test_another_callers_resume_is_refused_on_any_replica(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "tokens")
    async with in_process_stack(replicas=2, service={"auth_tokens": tokens}) as stack:
        first, second = stack.sessions
        async with DuplexClient(first.address, token=ALICE) as alice:
            session = await alice.open_session()
            for replica in (first, second):  # the live replica, and a takeover elsewhere
                async with DuplexClient(replica.address, token=BOB) as bob:
                    with pytest.raises(DuplexError) as err:
                        await bob.resume(session.session_id, session.resume_token)
                    assert err.value.code == "not_session_owner"
            assert second.registry.get(session.session_id) is None  # nothing was taken over
            assert first.registry.get(session.session_id) is not None
            await session.close()


async def test_a_resume_tells_the_stream_it_displaces_instead_of_ending_it_silently() -> None:
    async with in_process_stack() as stack, DuplexClient(stack.target) as client:
        victim = await client.open_session()
        resumed = await client.resume(victim.session_id, victim.resume_token)
        closed = await victim.wait_for("closed", timeout_s=10)
        assert closed.closed.reason == "resumed_elsewhere"
        assert resumed.session_id == victim.session_id
        await resumed.close()


async def test_a_closed_sessions_token_is_dead_on_every_replica() -> None:
    async with in_process_stack(replicas=2) as stack:
        first, second = stack.sessions
        async with DuplexClient(first.address) as client:
            session = await client.open_session()
            sid, token = session.session_id, session.resume_token
            await session.close()
            # On the replica that closed it, and on another one (whose takeover the worker's
            # tombstone refuses).
            for replica in (first, second):
                async with DuplexClient(replica.address) as again:
                    with pytest.raises(DuplexError) as err:
                        await again.resume(sid, token)
                    assert err.value.code == "session_closed", err.value
        assert sample("duplex_worker_fenced_total", {"reason": "session_closed"}) >= 1
