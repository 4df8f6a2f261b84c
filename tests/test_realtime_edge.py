"""The Realtime edge in this process, in front of an in-process stack: what it refuses (bad events,
credentials, bounds), what it serves besides turns (items, probes, metrics), and how it ends
connections (idle, oversize frames, clients that do not read)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import websockets
from prometheus_client import REGISTRY
from websockets.asyncio.client import connect

from realtime_service.connection import Limits
from realtime_service.protocol import PCM24K
from realtime_service.server import EdgeConfig, EdgeServer
from session_service.trust.auth import Authenticator, TokenFile
from tests.realtime_helpers import audio_of, read_until, sdk, send_audio, sending, speech, types
from tests.session_helpers import InProcessStack, in_process_stack
from tests.test_session_auth import write_tokens

ALICE = "alice-secret-token-0123456789"
BOB = "bob-secret-token-9876543210"


@contextlib.asynccontextmanager
async def edge(target: str, auth: Authenticator | None = None, **config: Any) -> AsyncIterator[EdgeServer]:
    cfg = EdgeConfig(listen_port=0, session_target=target, drain_grace_s=0.5, **config)
    server = EdgeServer(cfg, auth or Authenticator())
    await server.start()
    try:
        yield server
    finally:
        await server.drain()


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``condition`` (state of another task in this loop) until it holds."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - polls plain state, nothing to await on
            await asyncio.sleep(0.02)


def url(server: EdgeServer, path: str = "/v1") -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def raw(server: EdgeServer, **kwargs: Any) -> Any:
    """A plain WebSocket (no SDK) to the edge, its ``session.created`` read."""
    ws = await connect(url(server, "/v1/realtime?model=parrot"), **kwargs)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws


async def next_of(ws: Any, kind: str, timeout_s: float = 10.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == kind:
                return dict(event)


# ---- bad events --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        ("not json {", "invalid_json", None),
        ("[1, 2]", "invalid_event", None),
        ('{"event_id": "e1"}', "missing_type", "type"),
        ('{"type": "bogus.event", "event_id": "e1"}', "unknown_event", "type"),
        (
            '{"type": "conversation.item.delete", "event_id": "e1", "item_id": "x"}',
            "item_delete_invalid_item_id",
            "item_id",
        ),
        (
            '{"type": "output_audio_buffer.clear", "event_id": "e1"}',
            "unsupported_event",
            "type",
        ),
        (
            '{"type": "input_audio_buffer.append", "event_id": "e1", "audio": "%%%"}',
            "invalid_base64",
            "audio",
        ),
        (
            '{"type": "input_audio_buffer.append", "event_id": "e1", "audio": "AAAA"}',
            "invalid_audio_length",
            "audio",
        ),
        ('{"type": "input_audio_buffer.append", "event_id": "e1"}', "invalid_type", "audio"),
        (
            '{"type": "session.update", "event_id": "e1", "session": {"voicez": 1}}',
            "unknown_parameter",
            "session.voicez",
        ),
        (
            '{"type": "session.update", "event_id": "e1", "session": '
            '{"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}',
            "invalid_value",
            "session.audio.input.format.rate",
        ),
        (
            '{"type": "session.update", "event_id": "e1", "session": '
            '{"audio": {"input": {"turn_detection": {"type": "speculative_vad"}}}}}',
            "invalid_value",
            "session.audio.input.turn_detection.type",
        ),
        (
            '{"type": "conversation.item.create", "event_id": "e1", "item": {"type": "message", '
            '"role": "user", "content": [{"type": "output_text", "text": "hi"}]}}',
            "invalid_value",
            "item.content[0].type",
        ),
        (
            '{"type": "conversation.item.truncate", "event_id": "e1", "item_id": "nope", "audio_end_ms": 0}',
            "item_truncate_invalid_item_id",
            "item_id",
        ),
    ],
)
async def test_a_bad_event_is_an_error_and_the_connection_goes_on(
    stack: InProcessStack, frame: str, code: str, param: str | None
) -> None:
    async with edge(stack.target) as server:
        ws = await raw(server)
        try:
            await ws.send(frame)
            error = await next_of(ws, "error")
            assert error["error"]["code"] == code and error["error"]["param"] == param
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
            if '"event_id": "e1"' in frame:
                assert error["error"]["event_id"] == "e1"
            # The connection is still up and serving.
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "still here"}}))
            updated = await next_of(ws, "session.updated")
            if '"session.update"' in frame:
                # A bad field is refused alone: the rest of its update applied, and its
                # session.updated says what was not.
                assert {"param": param, "reason": code} in updated["session"]["duplex"]["not_applied"]
                updated = await next_of(ws, "session.updated")
            assert updated["session"]["instructions"] == "still here"
        finally:
            await ws.close()


async def test_an_error_the_session_service_reports_echoes_the_clients_event_id(
    stack: InProcessStack,
) -> None:
    async with edge(stack.target) as server, sdk(url(server)).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        # Nothing to commit: the session service refuses, the error names the client's event (in
        # OpenAI's code for the case).
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await read_until(conn, lambda e: e.type == "session.updated")
        await conn.input_audio_buffer.commit(event_id="my-commit")
        errors = await read_until(conn, lambda e: e.type == "error")
        assert errors[-1].error.event_id == "my-commit"
        assert errors[-1].error.code == "input_audio_buffer_commit_empty"


async def test_an_unknown_model_is_an_error_and_the_socket_closes(stack: InProcessStack) -> None:
    async with edge(stack.target) as server:
        async with connect(url(server, "/v1/realtime?model=no-such-model")) as ws:
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == "model_mismatch"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


# ---- items -------------------------------------------------------------------------------------


async def test_a_user_audio_item_is_a_turn(stack: InProcessStack) -> None:
    async with edge(stack.target) as server, sdk(url(server)).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await read_until(conn, lambda e: e.type == "session.updated")
        audio = base64.b64encode(speech(PCM24K, trailing_silence_ms=300)).decode()
        await conn.conversation.item.create(
            item={
                "id": "my-item",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": audio}],
            }
        )
        added = await read_until(conn, lambda e: e.type == "conversation.item.done")
        assert added[-1].item.id == "my-item" and added[-1].item.role == "user"
        assert "input_audio_buffer.committed" not in types(added)
        await conn.response.create()
        events = await read_until(conn, lambda e: e.type == "response.done", timeout_s=30)
        assert events[-1].response.status == "completed" and audio_of(events)


# ---- credentials and bounds --------------------------------------------------------------------


async def test_credentials_are_checked_before_the_socket_opens(stack: InProcessStack, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE: "alice"})
    refused = sample("duplex_realtime_refused_total", {"reason": "unauthenticated"})
    async with edge(stack.target, Authenticator(tokens=TokenFile(tokens))) as server:
        for key in ("wrong-token", ALICE + "x"):
            with pytest.raises(websockets.InvalidStatus) as err:
                async with sdk(url(server), api_key=key).realtime.connect(model="parrot"):
                    pass
            assert err.value.response.status_code == 401
            assert json.loads(err.value.response.body)["error"]["code"] == "invalid_api_key"
        with pytest.raises(websockets.InvalidStatus) as err:
            await connect(url(server, "/v1/realtime"))  # no Authorization at all
        assert err.value.response.status_code == 401
        async with sdk(url(server), api_key=ALICE).realtime.connect(model="parrot") as conn:
            assert (await conn.recv()).type == "session.created"
    assert sample("duplex_realtime_refused_total", {"reason": "unauthenticated"}) == refused + 3


async def test_a_token_is_passed_through_to_the_session_service(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE: "alice"})
    async with in_process_stack(service={"auth_tokens": tokens}) as stack, edge(stack.target) as server:
        async with connect(
            url(server, "/v1/realtime"), additional_headers={"Authorization": "Bearer nope"}
        ) as ws:
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == "unauthenticated"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        async with sdk(url(server), api_key=ALICE).realtime.connect(model="parrot") as conn:
            assert (await conn.recv()).type == "session.created"


async def test_connections_are_bounded_per_principal(stack: InProcessStack, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE: "alice", BOB: "bob"})
    auth = Authenticator(tokens=TokenFile(tokens))
    async with edge(stack.target, auth, max_connections_per_principal=1) as server:
        headers = {"Authorization": f"Bearer {ALICE}"}
        first = await raw(server, additional_headers=headers)
        try:
            with pytest.raises(websockets.InvalidStatus) as err:
                await connect(url(server, "/v1/realtime"), additional_headers=headers)
            assert err.value.response.status_code == 429
            other = await raw(server, additional_headers={"Authorization": f"Bearer {BOB}"})
            await other.close()
        finally:
            await first.close()
        # The slot is given back when the connection ends.
        await until(lambda: not server.slots.held, 5)
        again = await raw(server, additional_headers=headers)
        await again.close()


async def test_probes_and_unknown_paths(stack: InProcessStack) -> None:
    async with edge(stack.target) as server:
        base = f"http://127.0.0.1:{server.port}"

        def get(path: str) -> int:
            try:
                with urllib.request.urlopen(base + path, timeout=5) as response:
                    return int(response.status)
            except urllib.error.HTTPError as err:
                return int(err.code)

        assert await asyncio.to_thread(get, "/healthz") == 200
        assert await asyncio.to_thread(get, "/readyz") == 200
        with pytest.raises(websockets.InvalidStatus) as err:
            await connect(url(server, "/v2/other"))
        assert err.value.response.status_code == 404
        server.draining = True
        assert await asyncio.to_thread(get, "/readyz") == 503
        with pytest.raises(websockets.InvalidStatus) as err:
            await connect(url(server, "/v1/realtime"))
        assert err.value.response.status_code == 503


async def test_an_oversize_frame_closes_the_connection(stack: InProcessStack) -> None:
    async with edge(stack.target, max_message_bytes=64 * 1024) as server:
        ws = await raw(server)
        audio = base64.b64encode(bytes(60_000)).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            async with asyncio.timeout(5):
                while True:
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_an_idle_connection_is_closed(stack: InProcessStack) -> None:
    async with edge(stack.target, limits=Limits(idle_timeout_s=0.5)) as server:
        ws = await raw(server)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            async with asyncio.timeout(10):
                while True:
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        assert closed.value.rcvd.reason == "idle timeout"


async def test_a_client_that_does_not_read_is_cut_off(stack: InProcessStack) -> None:
    slow = sample("duplex_realtime_slow_consumers_total")
    limits = replace(Limits(), max_queued_bytes=64 * 1024)
    async with edge(stack.target, limits=limits) as server:
        # A small receive window, never read: the kernel's buffers fill (a few MB on loopback),
        # then the edge's queue.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        ws = await connect(url(server, "/v1/realtime"), sock=sock, max_queue=1)
        try:
            # Each update is answered with a session.updated of about 4 KB.
            for i in range(5000):
                instructions = f"{i:05d}" + "x" * 4000
                try:
                    await ws.send(
                        json.dumps({"type": "session.update", "session": {"instructions": instructions}})
                    )
                except websockets.ConnectionClosed:
                    break  # cut off (what is tested) while it still sent
                if i % 100 == 99 and sample("duplex_realtime_slow_consumers_total") > slow:
                    break
            await until(lambda: sample("duplex_realtime_slow_consumers_total") > slow, 20)
        finally:
            ws.transport.abort()
    assert sample("duplex_realtime_slow_consumers_total") == slow + 1


async def test_the_edge_counts_its_connections_and_events(stack: InProcessStack) -> None:
    accepted = sample("duplex_realtime_connections_accepted_total")
    appends = sample("duplex_realtime_client_events_total", {"type": "AppendAudio"})
    async with edge(stack.target) as server, sdk(url(server)).realtime.connect(model="parrot") as conn:
        assert (await conn.recv()).type == "session.created"
        await send_audio(conn, speech(PCM24K, trailing_silence_ms=0)[: PCM24K.bytes_for_ms(200)], PCM24K)
        assert sample("duplex_realtime_connections") >= 1
    assert sample("duplex_realtime_connections_accepted_total") == accepted + 1
    assert sample("duplex_realtime_client_events_total", {"type": "AppendAudio"}) == appends + 10


# ---- what the Realtime API has no word for -----------------------------------------------------


@pytest.mark.stack(replicas=2)
async def test_a_dropped_stream_to_the_session_service_is_resumed_unseen(stack: InProcessStack) -> None:
    first, second = stack.sessions
    target = f"ipv4:{first.address},{second.address}"  # pick_first: the first replica while it lives
    resumed = sample("duplex_realtime_resumes_total", {"outcome": "resumed"})
    async with edge(target) as server, sdk(url(server)).realtime.connect(model="parrot") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        session_id = created.session.id
        assert first.registry.get(session_id) is not None
        # The replica holding the session goes away without a word (its process killed).
        await first._server.stop(None)  # type: ignore[union-attr]
        # The client goes on talking; its turn is answered from the other replica.
        events: list[Any] = []
        async with sending(conn, speech(PCM24K), PCM24K):
            await read_until(conn, lambda e: e.type == "response.done", timeout_s=40, seen=events)
        assert events[-1].response.status == "completed", types(events)
        assert "error" not in types(events)
        assert audio_of(events)
        assert second.registry.get(session_id) is not None
    assert sample("duplex_realtime_resumes_total", {"outcome": "resumed"}) > resumed


@pytest.mark.stack(replicas=2)
async def test_a_draining_replica_hands_the_session_over_unseen(stack: InProcessStack) -> None:
    first, second = stack.sessions
    target = f"ipv4:{first.address},{second.address}"
    async with edge(target) as server, sdk(url(server)).realtime.connect(model="parrot") as conn:
        created = await conn.recv()
        session_id = created.session.id
        # A rolling update: the replica drains (go_away to its clients), then stops.
        drained = asyncio.create_task(first.drain())
        await asyncio.wait_for(drained, 15)
        await asyncio.wait_for(first.stop(), 15)
        events: list[Any] = []
        async with sending(conn, speech(PCM24K), PCM24K):
            await read_until(conn, lambda e: e.type == "response.done", timeout_s=40, seen=events)
        assert events[-1].response.status == "completed", types(events)
        assert "error" not in types(events)
        assert second.registry.get(session_id) is not None
