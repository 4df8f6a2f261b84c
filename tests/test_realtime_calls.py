"""WebRTC calls on the Realtime edge, in this process, with aiortc as the browser: a turn on the
tracks and the data channel, what ``/calls`` and ``/client_secrets`` refuse and how (OpenAI's
error shape), CORS, the bounds, and how calls end (ICE or DTLS that does not complete, a browser
that vanishes, a hang-up, a drain) with their sessions released and counted. The real browser's
tests are ``test_realtime_webrtc_browser.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client import REGISTRY

from duplex.audio import resample
from realtime_service.server import EdgeConfig, EdgeServer
from realtime_service.webrtc.calls import CallSettings
from realtime_service.webrtc.ice import IcePolicy
from session_service.trust.auth import Authenticator, TokenFile
from tests.session_helpers import InProcessStack
from tests.test_session_auth import write_tokens
from tests.webrtc_helpers import PcmTrack, connect, hello_16k, offer, post_call, post_json

ALICE = "alice-secret-token-0123456789"
BOB = "bob-secret-token-9876543210"

FAST = CallSettings(ice=IcePolicy(("127.0.0.1",)), connect_timeout_s=2.0, media_timeout_s=1.5)


@contextlib.asynccontextmanager
async def edge(
    target: str, auth: Authenticator | None = None, calls: CallSettings = FAST, **config: Any
) -> AsyncIterator[EdgeServer]:
    cfg = EdgeConfig(listen_port=0, session_target=target, drain_grace_s=0.5, calls=calls, **config)
    server = EdgeServer(cfg, auth or Authenticator())
    await server.start()
    try:
        yield server
    finally:
        await server.drain()


def base(server: EdgeServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - polls plain state, nothing to await on
            await asyncio.sleep(0.02)


def speech_48k(silence_s: float = 1.5) -> np.ndarray:
    x = hello_16k()
    return np.concatenate([resample(x, 16_000, 48_000), np.zeros(int(48_000 * silence_s), np.float32)])


def error_of(body: str) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"type", "code", "message", "param"} and error["message"], error
    return dict(error)


async def close(peer: Any) -> None:
    for task in peer.tasks:
        task.cancel()
    await peer.pc.close()


# ---- a turn --------------------------------------------------------------------------------------


async def test_a_call_holds_a_conversation_on_its_tracks_and_data_channel(stack: InProcessStack) -> None:
    async with edge(stack.target) as server:
        peer = await offer(PcmTrack(speech_48k()))
        status, answer, headers = await post_call(base(server), peer.pc.localDescription.sdp)
        assert status == 201 and headers["Content-Type"].startswith("application/sdp"), answer
        call_id = headers["Location"].rsplit("/", 1)[1]
        assert call_id.startswith("rtc_") and "a=candidate:" in answer and " 127.0.0.1 " in answer
        await connect(peer, answer)
        created = await peer.next_event("session.created")
        assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        started = await peer.next_event("output_audio_buffer.started", 30)
        done = await peer.next_event("response.done", 30)
        stopped = await peer.next_event("output_audio_buffer.stopped", 10)
        assert started["response_id"] == done["response"]["id"] == stopped["response_id"]
        assert done["response"]["status"] == "completed"
        kinds = [e["type"] for e in peer.events]
        assert "response.output_audio.delta" not in kinds
        assert kinds.index("response.done") < kinds.index("output_audio_buffer.stopped")
        # The reply was heard on the track, about as long as the utterance (3.3 s).
        audio = peer.audio()
        loud = np.flatnonzero(np.abs(audio) > 0.02)
        assert len(loud) and 2.3 < (loud[-1] - loud[0]) / 48_000 < 4.5
        # A session.update on the data channel: answered there; formats are the tracks'.
        n = len(peer.events)
        peer.send(
            {
                "type": "session.update",
                "session": {
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 700}},
                        "output": {"format": {"type": "audio/pcmu"}},
                    },
                },
            }
        )
        updated = await peer.next_event("session.updated", after=n)
        assert updated["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 700
        assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        # output_audio_buffer.clear with nothing playing: still answered.
        n = len(peer.events)
        peer.send({"type": "output_audio_buffer.clear", "event_id": "c1"})
        await peer.next_event("output_audio_buffer.cleared", after=n)
        await close(peer)
        await until(lambda: server.calls is not None and server.calls.active == 0, 10)


async def test_a_session_config_sent_with_the_offer_is_in_effect_from_the_start(
    stack: InProcessStack,
) -> None:
    async with edge(stack.target) as server:
        peer = await offer(PcmTrack(np.zeros(48_000, np.float32)))
        session = {
            "type": "realtime",
            "model": "parrot",
            "instructions": "hello there",
            "audio": {"input": {"turn_detection": None}},
        }
        # What a browser's FormData sends: multipart/form-data.
        form = aiohttp.MultipartWriter("form-data")
        for name, value in (("sdp", peer.pc.localDescription.sdp), ("session", json.dumps(session))):
            form.append(value).set_content_disposition("form-data", name=name)
        status, answer, _ = await post_call(base(server), "", content_type=None, data=form)
        assert status == 201, answer
        await connect(peer, answer)
        created = await peer.next_event("session.created")
        assert created["session"]["instructions"] == "hello there"
        assert created["session"]["audio"]["input"]["turn_detection"] is None
        await close(peer)


# ---- what /calls refuses -------------------------------------------------------------------------


async def test_a_body_that_is_not_an_offer_with_audio_is_a_400_in_openais_shape(
    stack: InProcessStack,
) -> None:
    async with edge(stack.target) as server:
        with_audio = await offer(PcmTrack(np.zeros(960, np.float32)))
        no_audio = await offer(None, audio=False)
        sdp = with_audio.pc.localDescription.sdp
        inactive = sdp.replace("a=sendrecv", "a=inactive")
        no_opus = "\r\n".join(line for line in sdp.split("\r\n") if "opus" not in line.lower())
        cases = [
            ("application/sdp", "not an offer at all", "invalid_sdp"),
            ("application/sdp", "", "invalid_sdp"),
            ("application/sdp", no_audio.pc.localDescription.sdp, "offer_without_audio"),
            ("application/sdp", inactive, "offer_without_audio"),
            ("application/sdp", no_opus, "unsupported_codec"),
            ("text/plain", sdp, "invalid_content_type"),
            ("application/json", json.dumps({"sdp": sdp}), "invalid_content_type"),
        ]
        refused = sample("duplex_realtime_calls_refused_total", {"reason": "invalid_sdp"})
        for content_type, body, code in cases:
            status, text, _ = await post_call(base(server), body, content_type=content_type)
            error = error_of(text)
            assert (status, error["code"], error["type"]) == (400, code, "invalid_request_error"), text
        assert sample("duplex_realtime_calls_refused_total", {"reason": "invalid_sdp"}) == refused + 2
        # Nothing was set up for any of them.
        assert server.calls is not None and server.calls.active == 0 and not server.calls.slots.held
        for peer in (with_audio, no_audio):
            await close(peer)


async def test_credentials_client_secrets_and_their_refusals(stack: InProcessStack, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE: "alice"})
    async with edge(stack.target, Authenticator(tokens=TokenFile(tokens))) as server:
        url = base(server) + "/v1/realtime/client_secrets"
        peer = await offer(PcmTrack(np.zeros(960, np.float32)))
        sdp = peer.pc.localDescription.sdp
        # No credential, a wrong one: 401 before anything else.
        for token in (None, "wrong"):
            status, text, _ = await post_call(base(server), sdp, token)
            assert (status, error_of(text)["code"]) == (401, "invalid_api_key")
        # Minting needs a real credential; what it takes and what it refuses.
        assert (await asyncio.to_thread(post_json, url, {}))[0] == 401
        status, body = await asyncio.to_thread(post_json, url, {}, ALICE)
        assert status == 200 and body["value"].startswith("ek_") and body["session"]["type"] == "realtime"
        bad_requests = [
            (
                {"expires_after": {"anchor": "created_at", "seconds": 0}},
                "invalid_value",
                "expires_after.seconds",
            ),
            ({"expires_after": {"anchor": "used_at"}}, "invalid_value", "expires_after.anchor"),
            ({"nope": 1}, "unknown_parameter", "nope"),
            ({"session": {"type": "transcription"}}, "unsupported_session_type", "session.type"),
            ({"session": {"voicez": "x"}}, "unknown_parameter", "session.voicez"),
            ({"session": {"model": 3}}, "invalid_type", "session.model"),
        ]
        for request, code, param in bad_requests:
            status, body = await asyncio.to_thread(post_json, url, request, ALICE)
            assert (status, body["error"]["code"], body["error"]["param"]) == (400, code, param), body
        status, body = await asyncio.to_thread(post_json, url, {"session": {"instructions": "fixed"}}, ALICE)
        secret = body["value"]
        # A client secret cannot mint another, nor open a WebSocket.
        assert (await asyncio.to_thread(post_json, url, {}, secret))[0] == 401
        with pytest.raises(Exception, match="401"):
            async with aiohttp.ClientSession() as http:
                await http.ws_connect(
                    f"ws://127.0.0.1:{server.port}/v1/realtime", headers={"Authorization": f"Bearer {secret}"}
                )
        # A forged or altered secret: 401.
        for forged in ("ek_local_" + "A" * 60, secret[:-4] + "AAAA"):
            status, text, _ = await post_call(base(server), sdp, forged)
            assert (status, error_of(text)["code"]) == (401, "invalid_api_key")
        # A secret whose call is refused (a bad offer) is not used up.
        status, _, _ = await post_call(base(server), "v=0", secret)
        assert status == 400
        # Its config is fixed: a form that brings another is refused.
        form = aiohttp.MultipartWriter("form-data")
        for name, value in (("sdp", sdp), ("session", json.dumps({"instructions": "mine"}))):
            form.append(value).set_content_disposition("form-data", name=name)
        status, text, _ = await post_call(base(server), "", secret, content_type=None, data=form)
        assert (status, error_of(text)["code"]) == (400, "session_config_fixed")
        status, answer, _ = await post_call(base(server), sdp, secret)
        assert status == 201
        await connect(peer, answer)
        created = await peer.next_event("session.created")
        assert created["session"]["instructions"] == "fixed"
        # Used: refused from now on.
        other = await offer(PcmTrack(np.zeros(960, np.float32)))
        status, text, _ = await post_call(base(server), other.pc.localDescription.sdp, secret)
        assert status == 401 and "used" in error_of(text)["message"]
        for p in (peer, other):
            await close(p)


async def test_cors_allows_the_configured_origins_and_the_edges_own_page(stack: InProcessStack) -> None:
    allowed = "https://app.example.com"
    async with edge(stack.target, cors_origins=(allowed,)) as server, aiohttp.ClientSession() as http:
        own = f"http://127.0.0.1:{server.port}"
        for path in ("/v1/realtime/calls", "/v1/realtime/client_secrets"):
            for origin, status in ((allowed, 204), (own, 204), ("https://evil.example.com", 403)):
                preflight = {
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type",
                }
                async with http.options(base(server) + path, headers=preflight) as r:
                    assert r.status == status, (path, origin, r.status)
                    if status == 204:
                        assert r.headers["Access-Control-Allow-Origin"] == origin
                        assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
                    else:
                        assert "Access-Control-Allow-Origin" not in r.headers
        # A page's request: answered with the headers that let it read the answer (an error too).
        async with http.post(
            base(server) + "/v1/realtime/calls",
            data="x",
            headers={"Origin": allowed, "Content-Type": "application/sdp"},
        ) as r:
            assert r.status == 400 and r.headers["Access-Control-Allow-Origin"] == allowed
            assert "Location" in r.headers["Access-Control-Expose-Headers"]
        # Another origin's request is refused before anything is done for it.
        async with http.post(
            base(server) + "/v1/realtime/calls", data="x", headers={"Origin": "https://evil.example.com"}
        ) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "origin_not_allowed"
        # Not a page (no Origin): CORS does not apply; nor on the WebSocket path or the probes.
        async with http.get(base(server) + "/healthz", headers={"Origin": "https://evil.example.com"}) as r:
            assert r.status == 200


async def test_the_page_is_served_at_the_root(stack: InProcessStack) -> None:
    async with edge(stack.target) as server, aiohttp.ClientSession() as http:
        async with http.get(base(server) + "/") as r:
            page = await r.text()
            assert r.status == 200 and r.content_type == "text/html"
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            assert '<script src="/talk.js">' in page
        async with http.get(base(server) + "/talk.js") as r:
            script = await r.text()
            assert r.status == 200 and r.content_type == "text/javascript"
            assert 'createDataChannel("oai-events")' in script and "/v1/realtime/calls" in script
        async with http.get(base(server) + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


# ---- bounds ----------------------------------------------------------------------------------------


async def test_calls_are_bounded_per_principal_and_in_all(stack: InProcessStack, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE: "alice", BOB: "bob"})
    bounded = replace(FAST, max_calls=2, max_calls_per_principal=1)
    async with edge(stack.target, Authenticator(tokens=TokenFile(tokens)), calls=bounded) as server:
        peers = [await offer(PcmTrack(np.zeros(48_000, np.float32))) for _ in range(4)]
        sdps = [p.pc.localDescription.sdp for p in peers]
        assert (await post_call(base(server), sdps[0], ALICE))[0] == 201
        status, text, _ = await post_call(base(server), sdps[1], ALICE)
        assert (status, error_of(text)["code"]) == (429, "too_many_calls")
        # A client secret acts for its principal: alice's bound holds for her pages too, and the
        # secret refused for it is not used up.
        url = base(server) + "/v1/realtime/client_secrets"
        secret = (await asyncio.to_thread(post_json, url, {}, ALICE))[1]["value"]
        status, text, _ = await post_call(base(server), sdps[1], secret)
        assert (status, error_of(text)["code"]) == (429, "too_many_calls")
        assert server.secrets.check(secret).principal == "alice"
        assert (await post_call(base(server), sdps[2], BOB))[0] == 201
        status, text, _ = await post_call(base(server), sdps[3], BOB)
        assert status == 429
        assert server.calls is not None and server.calls.active == 2
        # Calls and WebSockets are bounded apart: a WebSocket still opens.
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(
                f"ws://127.0.0.1:{server.port}/v1/realtime", headers={"Authorization": f"Bearer {ALICE}"}
            ) as ws,
        ):
            assert json.loads((await ws.receive()).data)["type"] == "session.created"
        for p in peers:
            await close(p)
        # The answered calls never connected: they end (ICE), their slots come back.
        await until(lambda: server.calls is not None and server.calls.active == 0, 10)
        assert not server.calls.slots.held


# ---- how calls end -----------------------------------------------------------------------------


async def test_ice_that_does_not_complete_ends_the_call_and_releases_its_session(
    stack: InProcessStack,
) -> None:
    failures = sample("duplex_realtime_webrtc_failures_total", {"stage": "ice"})
    async with edge(stack.target) as server:
        peer = await offer(PcmTrack(np.zeros(960, np.float32)))
        status, _, _ = await post_call(base(server), peer.pc.localDescription.sdp)
        assert status == 201
        assert server.calls is not None and server.calls.active == 1 and len(stack.session.registry) == 1
        await close(peer)  # the browser never takes the answer
        await until(lambda: server.calls is not None and server.calls.active == 0, 2.0 + 5)
        await until(lambda: len(stack.session.registry) == 0, 5)
    assert sample("duplex_realtime_webrtc_failures_total", {"stage": "ice"}) == failures + 1
    assert sample("duplex_realtime_calls_ended_total", {"reason": "ice_failed"}) >= 1


async def test_dtls_that_does_not_complete_ends_the_call(stack: InProcessStack) -> None:
    failures = sample("duplex_realtime_webrtc_failures_total", {"stage": "dtls"})
    async with edge(stack.target) as server:
        peer = await offer(PcmTrack(np.zeros(960, np.float32)))
        _status, answer, _ = await post_call(base(server), peer.pc.localDescription.sdp)
        # ICE completes, but this browser's DTLS never answers.
        for transceiver in peer.pc.getTransceivers():
            dtls = transceiver.sender.transport

            async def never(*_args: Any, **_kw: Any) -> None:
                await asyncio.Event().wait()

            dtls.start = never  # type: ignore[method-assign]
        await connect_in_background(peer, answer)
        await until(lambda: server.calls is not None and server.calls.active == 0, 2.0 + 5)
        await close(peer)
    assert sample("duplex_realtime_webrtc_failures_total", {"stage": "dtls"}) == failures + 1


async def connect_in_background(peer: Any, answer: str) -> None:
    task = asyncio.create_task(connect(peer, answer))
    peer.tasks.append(task)
    await asyncio.sleep(0)


async def test_a_browser_that_vanishes_ends_its_call_after_the_grace(stack: InProcessStack) -> None:
    ended = sample("duplex_realtime_calls_ended_total", {"reason": "media_timeout"})
    async with edge(stack.target) as server:
        peer = await offer(PcmTrack(np.zeros(48_000 * 30, np.float32)))
        _status, answer, _ = await post_call(base(server), peer.pc.localDescription.sdp)
        await connect(peer, answer)
        await peer.next_event("session.created")
        assert len(stack.session.registry) == 1
        # Gone without a word: nothing it sends arrives any more (a pulled cable, a closed lid).
        for transceiver in peer.pc.getTransceivers():
            ice = transceiver.sender.transport.transport
            for protocol in ice._connection._protocols:
                protocol.transport.sendto = lambda *_a, **_k: None
        t0 = asyncio.get_running_loop().time()
        await until(lambda: server.calls is not None and server.calls.active == 0, 10)
        waited = asyncio.get_running_loop().time() - t0
        assert FAST.media_timeout_s - 0.5 < waited < FAST.media_timeout_s + 3, waited
        await until(lambda: len(stack.session.registry) == 0, 5)
        await close(peer)
    assert sample("duplex_realtime_calls_ended_total", {"reason": "media_timeout"}) == ended + 1


async def test_a_call_is_hung_up_by_its_principal_and_ends_with_a_drain(stack: InProcessStack) -> None:
    async with edge(stack.target) as server, aiohttp.ClientSession() as http:
        first, second = [await offer(PcmTrack(np.zeros(48_000 * 30, np.float32))) for _ in range(2)]
        _, answer, headers = await post_call(base(server), first.pc.localDescription.sdp, "me")
        await connect(first, answer)
        await first.next_event("session.created")
        hangup = base(server) + headers["Location"] + "/hangup"
        async with http.post(hangup, headers={"Authorization": "Bearer someone-else"}) as r:
            assert r.status == 404
        async with http.post(hangup, headers={"Authorization": "Bearer me"}) as r:
            assert r.status == 200
        await until(lambda: first.pc.connectionState == "closed", 5)
        _, answer, _ = await post_call(base(server), second.pc.localDescription.sdp, "me")
        await connect(second, answer)
        await second.next_event("session.created")
        drained = asyncio.create_task(server.drain())
        await until(lambda: second.pc.connectionState == "closed", 5)
        # A draining edge answers no new call.
        status, text, _ = await post_call(base(server), second.pc.localDescription.sdp)
        assert (status, error_of(text)["code"]) == (503, "draining")
        await drained
        for p in (first, second):
            await close(p)


async def test_the_answer_offers_the_configured_address_and_port_range(stack: InProcessStack) -> None:
    from tests.test_realtime_webrtc_units import free_range

    low, high = free_range(4)
    policy = IcePolicy(("127.0.0.1",), (low, high), public_address="203.0.113.7")
    async with edge(stack.target, calls=replace(FAST, ice=policy)) as server:
        peer = await offer(PcmTrack(np.zeros(960, np.float32)))
        status, answer, _ = await post_call(base(server), peer.pc.localDescription.sdp)
        assert status == 201
        candidates = [line.split() for line in answer.splitlines() if line.startswith("a=candidate:")]
        assert candidates and all(c[4] == "203.0.113.7" and low <= int(c[5]) <= high for c in candidates)
        await close(peer)
