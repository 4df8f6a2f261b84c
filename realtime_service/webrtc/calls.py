"""The edge's WebRTC calls: each set up from a browser's offer (``create``: the session opened
first, then aiortc's answer), held as a ``CallConnection``, watched, and ended.

A call is bounded like a WebSocket (per principal and in all: ``--max-calls``,
``--max-calls-per-principal``) and watched: ICE and DTLS must complete within
``--webrtc-connect-timeout-s`` (else the call ends, counted by the stage that failed, and its
session is released); a browser from which nothing arrives for ``--webrtc-media-timeout-s`` has
vanished and its call ends. Once a second the peer connection's statistics feed the metrics of
packet loss and jitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

import grpc
from aiortc import RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack
from aiortc.stats import RTCInboundRtpStreamStats, RTCTransportStats

from duplex.errors import DuplexError
from duplex.serving import Slots
from realtime_service import metrics
from realtime_service.connection import Limits
from realtime_service.conversation import Settings
from realtime_service.responses import HttpError
from realtime_service.upstream import CredentialSource
from realtime_service.webrtc import ice
from realtime_service.webrtc.call import CHANNEL_LABEL, CallConnection, CallSocket
from realtime_service.webrtc.media import low_latency, read_microphone
from realtime_service.webrtc.offer import Offer

log = logging.getLogger("duplex.realtime.webrtc")

#: How often a call's statistics are read (packet loss, jitter, whether anything arrives).
STATS_INTERVAL_S: Final = 1.0

#: Opus's RTP clock (jitter is reported in its units).
OPUS_CLOCK_HZ: Final = 48_000


@dataclass(frozen=True)
class CallSettings:
    max_calls: int = 64
    max_calls_per_principal: int = 8
    ice: ice.IcePolicy = field(default_factory=lambda: ice.IcePolicy(("127.0.0.1",)))
    connect_timeout_s: float = 10.0
    """ICE and DTLS must complete within this long after the answer."""
    media_timeout_s: float = 10.0
    """A call from whose browser nothing arrives for this long ends (the grace of a vanished one)."""


@dataclass
class Call:
    call_id: str
    principal: str
    pc: RTCPeerConnection
    socket: CallSocket
    conn: CallConnection
    source: CredentialSource
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: object, name: str) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _http_error(err: DuplexError) -> HttpError:
    """A session the session service would not open, as the answer to the call's request."""
    code = str(err.code)
    status = {
        grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
        grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
        grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
        grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
        grpc.StatusCode.NOT_FOUND: HTTPStatus.BAD_REQUEST,
        grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
        grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    }.get(err.status, HTTPStatus.INTERNAL_SERVER_ERROR)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status == HTTPStatus.UNAUTHORIZED:
        code = "invalid_api_key"
    return HttpError(status, code, err.message, type=kind, reason=f"session_{err.code}")


class Calls:
    def __init__(self, settings: CallSettings, limits: Limits) -> None:
        self.settings = settings
        self.limits = limits
        self.slots = Slots(settings.max_calls_per_principal, settings.max_calls)
        self._calls: dict[str, Call] = {}
        self.on_idle: Callable[[], None] = lambda: None
        """Called when the last call has ended (the server's drain waits for it)."""
        ice.install()

    @property
    def active(self) -> int:
        return len(self._calls)

    def check_room(self, principal: str) -> None:
        full = self.slots.full(principal)
        if full is not None:
            status = HTTPStatus.TOO_MANY_REQUESTS if full == "key" else HTTPStatus.SERVICE_UNAVAILABLE
            raise HttpError(status, "too_many_calls", f"call limit reached ({full})", reason="too_many_calls")

    async def create(
        self, principal: str, source: CredentialSource, model: str, settings: Settings, offer: Offer
    ) -> tuple[str, str]:
        """Open the call's session, answer ``offer``; (call id, SDP answer). Raises ``HttpError``
        (the session refused, an offer aiortc cannot answer, no media port free)."""
        self.check_room(principal)
        self.slots.take(principal)
        call_id = "rtc_" + secrets.token_hex(16)
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        socket = CallSocket(
            has_channel=offer.has_data_channel, on_end=lambda reason: self._ending(call_id, reason)
        )
        conn = CallConnection(socket, source, model, self.limits, settings)
        call = Call(call_id, principal, pc, socket, conn, source)
        try:
            try:
                await conn.open_session()
            except DuplexError as err:
                raise _http_error(err) from None
            self._wire(call)
            answer = await self._answer(pc, conn, offer)
        except BaseException:
            with contextlib.suppress(Exception):
                await pc.close()
            if conn.session is not None:
                with contextlib.suppress(DuplexError):
                    await conn.session.close(timeout_s=5.0)
            await source.release()
            self.slots.give(principal)
            raise
        self._calls[call_id] = call
        metrics.CALLS.set(len(self._calls))
        metrics.CALLS_ACCEPTED.inc()
        call.spawn(self._run(call), f"realtime-call-{call_id}")
        return call_id, answer

    async def _answer(self, pc: RTCPeerConnection, conn: CallConnection, offer: Offer) -> str:
        try:
            with ice.using(self.settings.ice):
                await pc.setRemoteDescription(RTCSessionDescription(offer.sdp, "offer"))
                for transceiver in pc.getTransceivers():
                    if transceiver.kind == "audio" and not low_latency(transceiver.receiver):
                        log.warning("this aiortc keeps its jitter buffer elsewhere: 80 ms more per turn")
                pc.addTrack(conn.track)
                await pc.setLocalDescription(await pc.createAnswer())
        except ice.NoMediaPortError as exc:
            log.warning("call refused: %s", exc)
            raise HttpError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "no_media_port",
                "no UDP port free for the call's media; try again later",
                type="server_error",
            ) from None
        except (ValueError, TypeError, AssertionError, KeyError, IndexError) as exc:
            # aiortc's refusal of an offer it cannot parse or match (codecs, transports).
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "invalid_sdp", f"the offer cannot be answered: {exc}"
            ) from None
        return str(pc.localDescription.sdp)

    def _wire(self, call: Call) -> None:
        pc = call.pc

        @pc.on("datachannel")
        def _channel(channel: RTCDataChannel) -> None:
            if channel.label == CHANNEL_LABEL and call.socket.channel is None:
                call.socket.attach(channel)
            else:
                channel.close()  # only the GA API's one channel is served

        @pc.on("track")
        def _track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                call.spawn(read_microphone(track, call.socket.put_audio), f"realtime-mic-{call.call_id}")

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState == "connected":
                call.connected.set()
            elif pc.connectionState in ("failed", "closed"):
                self._failed(call)
                call.socket.end(f"connection_{pc.connectionState}")

    def _failed(self, call: Call) -> None:
        """The call never connected: counted once, by the stage that did not complete."""
        if call.socket.ended or call.connected.is_set():
            return
        stage = "dtls" if call.pc.iceConnectionState == "completed" else "ice"
        metrics.WEBRTC_FAILURES.labels(stage=stage).inc()
        call.socket.end(f"{stage}_failed")

    def _ending(self, call_id: str, reason: str) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            log.info("call %s ends: %s", call_id, reason)
            call.spawn(call.pc.close(), f"realtime-hangup-{call_id}")

    async def _run(self, call: Call) -> None:
        watch = asyncio.create_task(self._watch(call), name=f"realtime-watch-{call.call_id}")
        try:
            await call.conn.serve()
        except Exception:
            log.exception("call %s failed", call.call_id)
        finally:
            watch.cancel()
            call.socket.end(call.socket.ended or "session_ended")
            with contextlib.suppress(Exception):
                await call.pc.close()
            for task in list(call.tasks):
                if task is not asyncio.current_task():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
            await call.source.release()
            self.slots.give(call.principal)
            del self._calls[call.call_id]
            metrics.CALLS.set(len(self._calls))
            metrics.CALLS_ENDED.labels(reason=_reason_label(call.socket.ended)).inc()
            metrics.PLAYOUT_UNDERRUNS.inc(call.conn.playout.underruns)
            if not self._calls:
                self.on_idle()

    async def _watch(self, call: Call) -> None:
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                await call.connected.wait()
        except TimeoutError:
            self._failed(call)
            return
        received, lost, last_rx, rx_at = 0, 0, -1, time.monotonic()
        while not call.socket.ended:
            await asyncio.sleep(STATS_INTERVAL_S)
            try:
                report = await call.pc.getStats()
            except Exception:  # the peer connection closed meanwhile
                return
            now = time.monotonic()
            for stats in report.values():
                if isinstance(stats, RTCTransportStats):
                    if stats.packetsReceived != last_rx:
                        last_rx, rx_at = stats.packetsReceived, now
                elif isinstance(stats, RTCInboundRtpStreamStats) and stats.kind == "audio":
                    metrics.PACKETS_RECEIVED.inc(max(0, stats.packetsReceived - received))
                    metrics.PACKETS_LOST.inc(max(0, stats.packetsLost - lost))
                    received, lost = max(received, stats.packetsReceived), max(lost, stats.packetsLost)
                    metrics.JITTER.observe(stats.jitter / OPUS_CLOCK_HZ)
            if now - rx_at > self.settings.media_timeout_s:
                call.socket.end("media_timeout")
                return

    async def hangup(self, call_id: str, principal: str) -> bool:
        """End a call of ``principal``'s; False when it has no such call."""
        call = self._calls.get(call_id)
        if call is None or call.principal != principal:
            return False
        call.socket.end("hangup")
        return True

    async def close_all(self, reason: str) -> None:
        calls = list(self._calls.values())
        for call in calls:
            call.socket.end(reason)
        for call in calls:
            for task in list(call.tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 10.0)


#: Reasons a call ends, as counted (anything else is "other").
_REASONS: Final = frozenset(
    {
        "hangup",
        "draining",
        "ice_failed",
        "dtls_failed",
        "media_timeout",
        "session_ended",
        "data_channel_closed",
        "connection_closed",
        "connection_failed",
        "flooded",
        "slow_consumer",
        "idle_timeout",
    }
)


def _reason_label(reason: str) -> str:
    return reason if reason in _REASONS else "other"
