"""One WebRTC call as a ``Connection``: the same conversation as a WebSocket's, over a data channel
and two audio tracks.

``CallSocket`` is the call's ``ClientSocket``: JSON events in and out on the data channel
``oai-events``, and the microphone's audio in as ``input_audio_buffer.append`` commands of 24 kHz
PCM. ``CallConnection`` is a ``Connection`` whose reply audio goes to the call's track instead of
``response.output_audio.delta`` events, paced in real time (``Playout``), and which adds what only
a call has: ``output_audio_buffer.started`` / ``stopped`` / ``cleared``, and barge-in by the edge
itself (a user who talks over a reply stops it at once and its item is truncated where it was
heard, with no client help).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

from aiortc import RTCDataChannel

from duplex.errors import DuplexError
from duplex.v1 import session_pb2
from realtime_service import metrics
from realtime_service.connection import CLOSE_POLICY, ClientGone, Connection, Limits, SessionSource
from realtime_service.conversation import Event, Settings
from realtime_service.protocol import AppendAudio, Command, RealtimeError, UpdateSession
from realtime_service.webrtc.media import ReplyTrack
from realtime_service.webrtc.playout import Cleared, Notice, Playout, Started

log = logging.getLogger("duplex.realtime.webrtc")

#: The data channel the GA API's events travel on.
CHANNEL_LABEL: Final = "oai-events"

#: Microphone audio waiting for the session, at most (20 ms frames): past it, new frames are
#: dropped (counted) rather than held: the session is this far behind a live speaker.
MAX_QUEUED_AUDIO_FRAMES: Final = 500

#: Client events waiting to be applied, at most: a page that floods the channel is hung up on.
MAX_QUEUED_EVENTS: Final = 1024

#: Bytes the data channel may hold unsent before writing waits (SCTP's buffer, not the edge's).
CHANNEL_HIGH_WATER: Final = 256 * 1024
CHANNEL_LOW_WATER: Final = 64 * 1024

_CLEAR_TYPE: Final = "output_audio_buffer.clear"


class CallSocket:
    """``ClientSocket`` of a call. ``end(reason)`` hangs it up (the call's owner closes the peer
    connection when ``on_end`` hears of it)."""

    def __init__(self, *, has_channel: bool, on_end: Callable[[str], None]) -> None:
        self.has_channel = has_channel
        self.on_end = on_end
        self.on_clear: Callable[[str | None], None] = lambda _event_id: None
        self.channel: RTCDataChannel | None = None
        self.ended = ""
        """Why the call ended ("" while it goes on)."""
        self.last_input = time.monotonic()
        self._inbox: deque[str | Command] = deque()
        self._audio_queued = 0
        self._events_queued = 0
        self._changed = asyncio.Event()

    # ---- the peer connection's side ----------------------------------------------------------

    def attach(self, channel: RTCDataChannel) -> None:
        """The browser's ``oai-events`` data channel."""
        self.channel = channel
        channel.bufferedAmountLowThreshold = CHANNEL_LOW_WATER
        channel.on("open", self._changed.set)
        channel.on("bufferedamountlow", self._changed.set)
        channel.on("message", self._message)
        channel.on("close", lambda: self.end("data_channel_closed"))
        self._changed.set()

    def put_audio(self, pcm: bytes) -> None:
        """Microphone audio (24 kHz mono s16)."""
        self.last_input = time.monotonic()
        if self.ended:
            return
        if self._audio_queued >= MAX_QUEUED_AUDIO_FRAMES:
            metrics.INPUT_DROPPED.inc()
            return
        self._audio_queued += 1
        self._inbox.append(AppendAudio(None, pcm))
        self._changed.set()

    def _message(self, message: str | bytes) -> None:
        self.last_input = time.monotonic()
        if self.ended:
            return
        text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
        if _CLEAR_TYPE in text:
            event = _json_object(text)
            if event is not None and event.get("type") == _CLEAR_TYPE:
                event_id = event.get("event_id")
                self.on_clear(event_id if isinstance(event_id, str) else None)
                return
        if self._events_queued >= MAX_QUEUED_EVENTS:
            self.end("flooded")
            return
        self._events_queued += 1
        self._inbox.append(text)
        self._changed.set()

    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = reason
        self._changed.set()
        self.on_end(reason)

    # ---- ClientSocket ------------------------------------------------------------------------

    async def recv(self) -> str | bytes | Command:
        while not self._inbox:
            if self.ended:
                raise ClientGone()
            self._changed.clear()
            await self._changed.wait()
        item = self._inbox.popleft()
        if isinstance(item, AppendAudio):
            self._audio_queued -= 1
        else:
            self._events_queued -= 1
        return item

    async def send(self, text: str) -> None:
        while True:
            if self.ended:
                raise ClientGone()
            channel = self.channel
            if channel is None and not self.has_channel:
                return  # an audio-only call: its events have nowhere to go
            if channel is not None and channel.readyState == "open":
                if channel.bufferedAmount <= CHANNEL_HIGH_WATER:
                    channel.send(text)
                    return
            elif channel is not None and channel.readyState in ("closing", "closed"):
                raise ClientGone()
            # Not open yet (the connect timeout ends a call that never connects), or full.
            self._changed.clear()
            await self._changed.wait()

    async def close(self, code: int, reason: str) -> None:
        """The connection is over: the session ended (its reason), idled out, or the page did not
        read its events."""
        if code == CLOSE_POLICY and reason.startswith("slow consumer"):
            reason = "slow_consumer"
        self.end(reason.replace(" ", "_") or "session_ended")

    def abort(self) -> None:
        self.end("slow_consumer")


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class CallConnection(Connection):
    """A call's conversation: a ``Connection`` with its reply audio played on ``track``."""

    def __init__(
        self, socket: CallSocket, source: SessionSource, model: str, limits: Limits, settings: Settings
    ) -> None:
        super().__init__(socket, source, model, limits)
        # The call's settings at open (its session config); its audio is the tracks', 24 kHz PCM
        # to and from the session.
        self.settings.turn = settings.turn
        self.settings.instructions = settings.instructions
        self.settings.output_modalities = settings.output_modalities
        self.playout = Playout(self.settings.output_format)
        self.track = ReplyTrack(self.playout, self._on_notices)
        self._acks: set[asyncio.Task[None]] = set()
        self._last_response = ""
        socket.on_clear = self._clear_requested

    # ---- the session's events ----------------------------------------------------------------

    def _on_event(self, ev: session_pb2.ServerEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "audio_delta":
            for event in self.conversation.on_event(ev):
                if event["type"] == "response.output_audio.delta":
                    self.playout.push(event["response_id"], event["item_id"], ev.audio_delta.pcm)
                    metrics.server_event(event["type"]).inc()
                else:
                    self._emit([event])
            return
        if kind == "audio_cancelled":
            self._interrupted(self.playout.clear(ev.audio_cancelled.response_id))
            return
        super()._on_event(ev)
        if kind == "response_started":
            self._last_response = ev.response_started.response_id
        elif kind == "speech_started":
            turn = self.settings.turn
            if turn.vad and turn.interrupt_response and self.playout.playing:
                # The user talks over what is still playing (also a reply the model has finished
                # but the track has not): stop it now.
                self._interrupted(self.playout.clear())
        elif kind == "response_done":
            self._on_notices(self.playout.finish(ev.response_done.response_id))

    def _on_notices(self, notices: list[Notice]) -> None:
        events: list[Event] = []
        for notice in notices:
            kind = "started" if isinstance(notice, Started) else "stopped"
            events.append(
                self.conversation._event(f"output_audio_buffer.{kind}", response_id=notice.response_id)
            )
        if events:
            self._emit(events)

    def _interrupted(self, cleared: list[Cleared]) -> None:
        """Replies dropped from the track: ``output_audio_buffer.cleared``, then each item
        truncated where it was heard (and the session told how much was played)."""
        session = self.session
        for c in cleared:
            events = [self.conversation._event("output_audio_buffer.cleared", response_id=c.response_id)]
            try:
                _, truncated = self.conversation.truncation(c.item_id, c.played_ms)
                events.append(truncated)
            except RealtimeError:
                pass  # an item too old to be remembered: nothing to truncate
            self._emit(events)
            if session is not None:
                self._spawn_ack(session.playback_ack(c.played_ms, c.response_id))

    def _spawn_ack(self, ack: Any) -> None:
        async def send() -> None:
            with contextlib.suppress(DuplexError):
                await ack

        task = asyncio.create_task(send(), name="realtime-call-ack")
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    def _clear_requested(self, event_id: str | None) -> None:
        """``output_audio_buffer.clear`` (WebRTC only): stop what plays now."""
        cleared = self.playout.clear()
        if cleared:
            self._interrupted(cleared)
        else:
            self._emit(
                [self.conversation._event("output_audio_buffer.cleared", response_id=self._last_response)]
            )

    # ---- the client's commands ---------------------------------------------------------------

    async def _apply(self, command: Command) -> None:
        if isinstance(command, UpdateSession) and (command.input_format or command.output_format):
            # A call's audio is the tracks' (Opus): formats are not the page's to change.
            command = replace(command, input_format=None, output_format=None)
        await super()._apply(command)

    async def serve(self) -> None:
        try:
            await super().serve()
        finally:
            for task in list(self._acks):
                task.cancel()
            self.track.stop()
