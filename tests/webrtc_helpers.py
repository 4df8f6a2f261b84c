"""Helpers of the WebRTC tests: the fake microphone's WAV, the page a test serves from its own
origin, what the page recorded, and the pitch of speech."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fractions
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import soundfile as sf
from aiohttp import web
from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from duplex.audio import read_wav, resample, to_mono
from duplex.stack import example_path
from realtime_service.webrtc.ice import IcePolicy, using

FIXTURES = Path(__file__).resolve().parent / "fixtures"

#: The rate of what the test page hands back (its 48 kHz recording, averaged in threes).
PAGE_RATE = 16_000


def hello_16k() -> np.ndarray:
    x, rate = read_wav(example_path("hello.wav"))
    return resample(to_mono(x), rate, PAGE_RATE)


def microphone_wav(path: Path, silence_s: float) -> Path:
    """examples/hello.wav then ``silence_s`` of silence (the fake microphone loops it), 16-bit."""
    x = hello_16k()
    y = np.concatenate([x, np.zeros(int(silence_s * PAGE_RATE), np.float32)])
    sf.write(path, np.clip(y * 32767, -32768, 32767).astype(np.int16), PAGE_RATE, subtype="PCM_16")
    return path


#: The test page written to OpenAI's WebRTC flow.
OPENAI_PAGE = (FIXTURES / "openai_webrtc_page.html").read_text()


@contextlib.asynccontextmanager
async def page_server(text: str, port: int = 0) -> AsyncIterator[str]:
    """The page ``text`` served at ``/`` of its own origin (``http://127.0.0.1:PORT``)."""
    app = web.Application()

    async def index(_request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/html")

    app.router.add_get("/", index)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def post_json(url: str, body: Any, token: str | None = None, method: str = "POST") -> tuple[int, Any]:
    """(status, JSON body) of a request with a JSON body (blocking: run it in a thread)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read() or b"{}")


@dataclass
class Recording:
    """What the test page heard: the microphone and the reply (16 kHz float), and the data
    channel's events with the sample of the recording at which each came."""

    mic: np.ndarray
    reply: np.ndarray
    events: list[tuple[int, dict[str, Any]]]
    calls: list[dict[str, Any]]

    @classmethod
    def of(cls, out: dict[str, Any]) -> Recording:
        def pcm(text: str) -> np.ndarray:
            return np.frombuffer(base64.b64decode(text), np.int16).astype(np.float32) / 32768.0

        first = int(out["first_frame"] or 0)
        events = [((int(e["frame"]) - first) // 3, e["event"]) for e in out["events"]]
        return cls(pcm(out["mic"]), pcm(out["reply"]), events, out.get("calls", []))

    def types(self) -> list[str]:
        return [e["type"] for _, e in self.events]

    def at(self, kind: str, nth: int = 0, **match: Any) -> tuple[int, dict[str, Any]]:
        found = [
            (t, e)
            for t, e in self.events
            if e["type"] == kind and all(e.get(k) == v for k, v in match.items())
        ]
        assert len(found) > nth, f"no {kind} #{nth} {match} in {self.types()}"
        return found[nth]


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if len(x) else 0.0


def loud_spans(x: np.ndarray, threshold: float, frame: int = 320) -> list[tuple[int, int]]:
    """(start, end) samples of the runs of 20 ms frames louder (RMS) than ``threshold``, runs
    closer than 200 ms joined."""
    n = len(x) // frame
    loud = np.sqrt(np.mean(np.square(x[: n * frame].reshape(n, frame)), axis=1)) > threshold
    spans: list[tuple[int, int]] = []
    for i in np.flatnonzero(loud):
        start, end = int(i) * frame, (int(i) + 1) * frame
        if spans and start - spans[-1][1] <= 10 * frame:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def pitch_hz(x: np.ndarray, rate: int = PAGE_RATE) -> float:
    """Median fundamental frequency of the voiced 40 ms frames of ``x`` (autocorrelation, 70-400
    Hz; a frame is voiced when it is loud and its autocorrelation peak is strong)."""
    win, hop = int(0.04 * rate), int(0.01 * rate)
    lo, hi = rate // 400, rate // 70
    loudest = max((rms(x[i : i + win]) for i in range(0, len(x) - win, hop)), default=0.0)
    found = []
    for i in range(0, len(x) - win, hop):
        f = x[i : i + win] - np.mean(x[i : i + win])
        if rms(f) < 0.2 * loudest:
            continue
        ac = np.correlate(f, f, "full")[win - 1 :]
        lag = lo + int(np.argmax(ac[lo:hi]))
        if ac[lag] > 0.5 * ac[0]:
            found.append(rate / lag)
    return float(np.median(found)) if found else 0.0


# ---- a WebRTC client in this process (aiortc), for the tests that need no browser -----------------


class PcmTrack(MediaStreamTrack):
    """``pcm`` (48 kHz mono float) as a microphone: 20 ms frames in real time, then silence."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray) -> None:
        super().__init__()
        self.pcm = np.clip(pcm * 32767, -32768, 32767).astype(np.int16)
        self.sent = 0
        self._start: float | None = None
        self.muted = False

    async def recv(self) -> AudioFrame:
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        else:
            await asyncio.sleep(max(0.0, self._start + self.sent / 48_000 - loop.time()))
        chunk = self.pcm[self.sent : self.sent + 960]
        if self.muted or len(chunk) < 960:
            chunk = np.zeros(960, np.int16)
        frame = AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 48_000
        frame.pts = self.sent
        frame.time_base = fractions.Fraction(1, 48_000)
        self.sent += 960
        return frame


@dataclass
class Peer:
    """A client's side of a call: its peer connection, the events its data channel got, the
    audio it heard (48 kHz mono float, with the loop time of each 20 ms frame)."""

    pc: RTCPeerConnection
    channel: RTCDataChannel | None
    mic: PcmTrack | None
    events: list[dict[str, Any]] = field(default_factory=list)
    heard: list[np.ndarray] = field(default_factory=list)
    got_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def next_event(self, kind: str, timeout_s: float = 20.0, after: int = 0) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                for event in self.events[after:]:
                    if event["type"] == kind:
                        return event
                self.got_event.clear()
                await self.got_event.wait()

    def send(self, event: dict[str, Any]) -> None:
        assert self.channel is not None
        self.channel.send(json.dumps(event))

    def audio(self) -> np.ndarray:
        return np.concatenate(self.heard) if self.heard else np.zeros(0, np.float32)


LOOPBACK = IcePolicy(("127.0.0.1",))


async def offer(mic: PcmTrack | None, *, channel: bool = True, audio: bool = True) -> Peer:
    """A client peer connection with its offer made (a microphone track, the ``oai-events``
    channel), its candidates on loopback."""
    with using(LOOPBACK):
        return await _offer(mic, channel, audio)


async def _offer(mic: PcmTrack | None, channel: bool, audio: bool) -> Peer:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    peer = Peer(pc, None, mic)
    if audio:
        if mic is not None:
            pc.addTrack(mic)
        else:
            pc.addTransceiver("audio", direction="recvonly")
    if channel:
        peer.channel = pc.createDataChannel("oai-events")

        @peer.channel.on("message")
        def _message(message: str) -> None:
            peer.events.append(json.loads(message))
            peer.got_event.set()

    @pc.on("track")
    def _track(track: MediaStreamTrack) -> None:
        async def read() -> None:
            while True:
                try:
                    frame = await track.recv()
                except MediaStreamError:
                    return
                x = frame.to_ndarray().reshape(-1, 2).mean(axis=1) / 32768.0  # s16 stereo, packed
                peer.heard.append(x.astype(np.float32))

        peer.tasks.append(asyncio.ensure_future(read()))

    await pc.setLocalDescription(await pc.createOffer())
    return peer


async def connect(peer: Peer, answer_sdp: str) -> None:
    with using(LOOPBACK):
        await peer.pc.setRemoteDescription(RTCSessionDescription(answer_sdp, "answer"))


async def post_call(
    base: str, sdp: str, token: str | None = None, *, content_type: str | None = "application/sdp", **kw: Any
) -> tuple[int, str, dict[str, str]]:
    """POST /v1/realtime/calls: (status, body, headers). ``content_type`` None: aiohttp's (a form's)."""
    headers = {**({"Content-Type": content_type} if content_type else {}), **kw.pop("headers", {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/v1/realtime/calls", data=kw.pop("data", sdp), headers=headers, **kw) as response,
    ):
        return response.status, await response.text(), dict(response.headers)
