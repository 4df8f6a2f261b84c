"""A real headless Chromium talks to the parrot over WebRTC through ``duplex up --realtime-port``
(the edge checking bearer tokens): a page written to OpenAI's WebRTC flow, served from an origin
of its own (CORS), with a client secret a backend minted; and the edge's own page at ``/``.

The fake microphone plays examples/hello.wav then 2.5 s of silence, looped: the first reply (as
long as the utterance, 3.3 s) is talked over by the loop's next pass (barge-in; the reply has 2 s
to begin before it, time a loaded machine may need), the page mutes its microphone once the second
turn is spoken, so the second reply plays to its end.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from duplex.stack import LocalStack
from tests.browser import Browser, BrowserError, chromium_path
from tests.fault_load import features, spectral_similarity, speech_span
from tests.session_helpers import metric_value, metrics_text
from tests.test_session_auth import write_tokens
from tests.webrtc_helpers import (
    OPENAI_PAGE,
    PAGE_RATE,
    Recording,
    hello_16k,
    loud_spans,
    microphone_wav,
    page_server,
    pitch_hz,
    post_json,
    rms,
)
from worker_service.models.parrot import parrot_reply

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(chromium_path() is None, reason="no chromium (apt-get install chromium)"),
]

TOKEN = "page-backend-token-0123456789abcdef"
PITCH_SEMITONES = 4.0  # the parrot's default


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokens(tmp_path_factory.mktemp("auth") / "tokens", {TOKEN: "page-backend"})


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    # The test page's origin, known before the edge starts (its --cors-origin): a port picked now.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def edge(tokens: Path, page_origin: str) -> Iterator[LocalStack]:
    args = ["--auth-tokens", str(tokens), "--cors-origin", page_origin]
    with LocalStack(realtime_port=0, realtime_args=args) as stack:
        yield stack


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    wav = microphone_wav(tmp_path_factory.mktemp("mic") / "mic.wav", silence_s=2.5)
    with Browser(wav) as b:
        yield b


def mint(base: str, seconds: int) -> str:
    status, body = post_json(
        f"{base}/v1/realtime/client_secrets",
        {
            "expires_after": {"anchor": "created_at", "seconds": seconds},
            "session": {
                "type": "realtime",
                "model": "parrot",
                "instructions": "repeat after me",
                # A turn ends after 1 s of silence: a gap in the fake microphone's packets on a
                # loaded machine must not end it mid-utterance (the loop's silence is 2.5 s).
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1000}}},
            },
        },
        token=TOKEN,
    )
    assert status == 200, body
    assert body["value"].startswith("ek_") and body["session"]["instructions"] == "repeat after me"
    return str(body["value"])


def base_of(edge: LocalStack) -> str:
    return edge.realtime_url.replace("ws://", "http://").removesuffix("/v1")


async def wait_metric(edge: LocalStack, name: str, value: float, timeout_s: float = 10.0) -> None:
    assert edge.realtime is not None
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (metric_value(metrics_text(edge.realtime.metrics), name) or 0.0) != value:
        assert asyncio.get_running_loop().time() < deadline, f"{name} is not {value}"
        await asyncio.sleep(0.1)


def edge_metric(edge: LocalStack, name: str, labels: str = "") -> float:
    assert edge.realtime is not None
    return metric_value(metrics_text(edge.realtime.metrics), name, labels) or 0.0


async def test_a_page_written_to_openais_webrtc_flow_talks_with_the_parrot(
    edge: LocalStack, browser: Browser, page_origin: str
) -> None:
    base = base_of(edge)
    # The page's backend mints a secret with its real credential; the page never sees that one.
    secret = await asyncio.to_thread(mint, base, 120)
    expired = await asyncio.to_thread(mint, base, 1)
    port = int(page_origin.rsplit(":", 1)[1])
    async with page_server(OPENAI_PAGE, port=port) as origin, browser.page(origin + "/") as page:
        opts = {"turns": 2, "timeout_ms": 40_000, "retry_with": [secret, expired]}
        call = f"talk({json.dumps(base + '/v1')}, {json.dumps(secret)}, {json.dumps(opts)})"
        rec = Recording.of(await page.evaluate(call, 60))

    # /calls: 201 with the call's id; the same secret again, and an expired one: 401.
    first, again, late = rec.calls
    assert first["status"] == 201 and re.fullmatch(r"/v1/realtime/calls/rtc_[0-9a-f]{32}", first["location"])
    for refused, why in ((again, "used already"), (late, "expired")):
        error = json.loads(refused["body"])["error"]
        assert refused["status"] == 401 and error["code"] == "invalid_api_key" and why in error["message"]
        assert set(error) == {"type", "code", "message", "param"}

    # The GA events on the data channel, audio on the track only.
    kinds = rec.types()
    assert kinds[0] == "session.created" and "response.output_audio.delta" not in kinds, kinds
    created = rec.events[0][1]["session"]
    assert created["instructions"] == "repeat after me" and created["model"] == "parrot"
    assert created["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 1000
    started1, cleared, truncated = (
        rec.at("output_audio_buffer.started", 0),
        rec.at("output_audio_buffer.cleared"),
        rec.at("conversation.item.truncated"),
    )
    barged = rec.at("input_audio_buffer.speech_started", 1)
    done1 = rec.at("response.done", 0)
    started2, done2 = rec.at("output_audio_buffer.started", 1), rec.at("response.done", 1)
    stopped = rec.at("output_audio_buffer.stopped")
    order = [started1, barged, cleared, truncated, done1, started2, done2, stopped]
    assert [t for t, _ in order] == sorted(t for t, _ in order), kinds
    response1 = done1[1]["response"]
    assert started1[1]["response_id"] == cleared[1]["response_id"] == response1["id"]
    assert response1["status"] == "cancelled" and response1["status_details"]["reason"] == "turn_detected"
    assert truncated[1]["item_id"] == response1["output"][0]["id"]
    assert done2[1]["response"]["status"] == "completed"
    assert started2[1]["response_id"] == stopped[1]["response_id"] == done2[1]["response"]["id"]

    # Barge-in: the first reply is cut where it was heard, and nothing of it plays after.
    heard_ms = (cleared[0] - started1[0]) * 1000 / PAGE_RATE
    assert abs(truncated[1]["audio_end_ms"] - heard_ms) < 400, (truncated[1], heard_ms)
    reply2 = rec.reply[started2[0] : stopped[0] + PAGE_RATE // 2]
    after_cut = rec.reply[cleared[0] + PAGE_RATE * 3 // 10 : started2[0]]
    assert len(after_cut) > PAGE_RATE and rms(after_cut) < 0.05 * rms(reply2), (rms(after_cut), rms(reply2))

    # The second reply is the parrot's: the utterance, 4 semitones up.
    hello = hello_16k()
    a, b = speech_span(hello)
    ratio = pitch_hz(reply2) / pitch_hz(hello[a:b])
    assert 2 ** (3 / 12) < ratio < 2 ** (5 / 12), ratio
    utterance = np.pad(hello, (0, 1024))[a : b + 1024]
    shifted, unshifted = spectral_similarity(
        features(reply2), [features(parrot_reply(utterance, PITCH_SEMITONES)), features(utterance)]
    )
    assert shifted > 0.7 and shifted > unshifted + 0.15, (shifted, unshifted)
    spans = loud_spans(reply2, 0.02)
    assert spans and 0.7 < (spans[-1][1] - spans[0][0]) / (b - a) < 1.3, spans

    # The call ended with the page's hang-up, its session released; what was counted.
    await wait_metric(edge, "duplex_realtime_calls", 0)
    await wait_metric(edge, "duplex_realtime_upstream_streams", 0)
    assert edge_metric(edge, "duplex_realtime_calls_accepted_total") >= 1
    assert edge_metric(edge, "duplex_realtime_client_secrets_total", 'outcome="used"') >= 1
    assert (
        edge_metric(edge, "duplex_realtime_client_secrets_total", 'outcome="refused_used_client_secret"') >= 1
    )
    assert (
        edge_metric(edge, "duplex_realtime_client_secrets_total", 'outcome="refused_expired_client_secret"')
        >= 1
    )
    assert edge_metric(edge, "duplex_realtime_webrtc_packets_received_total") > 200
    assert edge_metric(edge, "duplex_realtime_webrtc_jitter_seconds_count") > 5
    assert edge_metric(edge, "duplex_realtime_calls_ended_total", 'reason="data_channel_closed"') >= 1


async def test_a_page_of_an_origin_not_allowed_cannot_call(edge: LocalStack, browser: Browser) -> None:
    base = base_of(edge)
    secret = await asyncio.to_thread(mint, base, 60)
    refused = edge_metric(edge, "duplex_realtime_refused_total", 'reason="origin_not_allowed"')
    async with (
        page_server(OPENAI_PAGE) as origin,
        browser.page(origin + "/") as page,
    ):
        opts = {"turns": 1, "timeout_ms": 1000, "retry_with": []}
        with pytest.raises(BrowserError, match="Failed to fetch"):
            await page.evaluate(
                f"talk({json.dumps(base + '/v1')}, {json.dumps(secret)}, {json.dumps(opts)})", 30
            )
    # The preflight was refused (403): no call was set up, and the secret is still unused.
    assert edge_metric(edge, "duplex_realtime_refused_total", 'reason="origin_not_allowed"') > refused
    assert edge_metric(edge, "duplex_realtime_calls") == 0


async def test_the_edges_own_page_talks_with_the_parrot(edge: LocalStack, browser: Browser) -> None:
    async with browser.page(base_of(edge) + "/") as page:
        await page.evaluate(f"document.getElementById('key').value = {json.dumps(TOKEN)}")
        await page.evaluate("document.getElementById('start').click()")
        await page.wait_for("duplexTalk.error || duplexTalk.callId", 15)
        assert await page.evaluate("duplexTalk.error") is None
        assert str(await page.evaluate("duplexTalk.callId")).startswith("rtc_")
        # A reply plays, loud enough to hear (the looped microphone talks over it: it is cut or
        # ends, as the loop falls).
        await page.wait_for("duplexTalk.events.some(e => e.type === 'response.done')", 30)
        await page.wait_for("duplexTalk.peak > 0.05", 5)
        kinds = await page.evaluate("duplexTalk.events.map(e => e.type)")
        assert "output_audio_buffer.started" in kinds, kinds
        kinds = await page.evaluate("duplexTalk.events.map(e => e.type)")
        assert kinds[0] == "session.created" and "response.done" in kinds
        lines = await page.evaluate("[...document.querySelectorAll('#transcript p')].map(p => p.textContent)")
        assert "user: (spoke)" in lines, lines
        await page.evaluate("document.getElementById('stop').click()")
        assert await page.evaluate("document.getElementById('status').textContent") == "hung up"
    await wait_metric(edge, "duplex_realtime_calls", 0)
