"""One client held as one session of the session service: the asyncio shell.

The client is a ``ClientSocket``: a WebSocket (``realtime_service.websocket``) or a WebRTC call's
data channel and audio tracks (``realtime_service.webrtc.call``). Three tasks per connection: the
reader (client frames -> commands -> the session), the pump (the session's events -> Realtime
events -> ``Outbound``) and the writer (``Outbound`` -> the client). The first to end ends the
others: the client went away or idled out (the session is closed), the session ended (what is
queued is written, then the client is closed), or the client stopped reading (cut off as a slow
consumer).

What the Realtime API has no word for is done here: a ``go_away`` is followed by the client
library (the session resumes on the same service), and a stream to the session service that
drops is resumed with the session's token, a few times, before the client is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Final, Protocol

from duplex.client import Session
from duplex.errors import DuplexError
from duplex.v1 import session_pb2
from realtime_service import metrics
from realtime_service.conversation import Conversation, Event, Settings
from realtime_service.outbound import Frame, Outbound
from realtime_service.protocol import (
    DEFAULT_TURN,
    PCM24K,
    AppendAudio,
    CancelResponse,
    ClearAudio,
    Command,
    CommitAudio,
    CreateItem,
    CreateResponse,
    DeleteItem,
    RealtimeError,
    RetrieveItem,
    TruncateItem,
    UpdateSession,
    parse_client_event,
)

log = logging.getLogger("duplex.realtime")

#: Appends a connection may have unacknowledged at the session service before its reader stops
#: reading the WebSocket (so a client that sends faster than the model hears is slowed by TCP).
MAX_UNACKED_APPENDS: Final = 64

#: Resumes tried after the stream to the session service drops, before the client is told.
RESUME_ATTEMPTS: Final = 5

# WebSocket close codes (RFC 6455).
CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_POLICY: Final = 1008
CLOSE_INTERNAL: Final = 1011
CLOSE_TRY_AGAIN: Final = 1013


class ClientGone(Exception):
    """The client's end is closed (it left, or its connection failed)."""


class ClientSocket(Protocol):
    """What a connection reads from and writes to: a WebSocket, or a WebRTC call."""

    async def recv(self) -> str | bytes | Command:
        """The client's next frame (a JSON event), or a command the transport made itself (a
        call's microphone audio); raises ``ClientGone``."""
        ...

    async def send(self, text: str) -> None:
        """Write one JSON event; raises ``ClientGone``."""
        ...

    async def close(self, code: int, reason: str) -> None:
        """End the client's connection (a WebSocket close code and reason)."""
        ...

    def abort(self) -> None:
        """Drop the connection without a goodbye (a client that does not read)."""
        ...


class SessionSource(Protocol):
    """Where a connection's session comes from: a ``ConverseMany`` stream of its credential."""

    async def open(self, model: str, settings: Settings) -> Session: ...

    async def resume(self, session_id: str, resume_token: str) -> Session: ...


@dataclass(frozen=True)
class Limits:
    idle_timeout_s: float = 300.0
    max_queued_bytes: int = 4 * 1024 * 1024


#: What ends a session for good: trying to resume it cannot help.
FINAL_CODES: Final = frozenset(
    {
        "unauthenticated",
        "not_session_owner",
        "session_closed",
        "unknown_session",
        "invalid_resume_token",
        "model_mismatch",
        "invalid_config",
        "identity_not_allowed",
    }
)


def resumable(err: DuplexError) -> bool:
    """Whether the session may be resumed after ``err`` ended its stream. Any failure of the stream
    itself may be resumed (also a CANCELLED that this edge did not cause: a replica that stopped
    while a resume was in flight); the session's own end may not."""
    return err.retryable or str(err.code) not in FINAL_CODES


def close_code_for(err: DuplexError) -> int:
    """The WebSocket close code for a session that could not open or go on: 1013 when trying
    again may help, 1011 for the service's own failure, 1008 for a refusal (credentials, model)."""
    if err.retryable:
        return CLOSE_TRY_AGAIN
    return CLOSE_INTERNAL if err.code == "internal" else CLOSE_POLICY


def _server_error(err: DuplexError) -> RealtimeError:
    kind = "server_error" if err.retryable or err.code == "internal" else "invalid_request_error"
    return RealtimeError(str(err.code), err.message, type=kind)


class Connection:
    def __init__(self, ws: ClientSocket, source: SessionSource, model: str, limits: Limits) -> None:
        self.ws = ws
        self.source = source
        self.model = model
        self.limits = limits
        self.settings = Settings(input_format=PCM24K, output_format=PCM24K, turn=DEFAULT_TURN)
        self.conversation = Conversation(model, self.settings)
        self.outbound = Outbound(limits.max_queued_bytes)
        self.session: Session | None = None
        self._opened = False
        self._client_gone = False
        self._pump_over = False
        self._swapped = asyncio.Event()
        """Set when the pump put a resumed session in place, or ended."""
        self.close_code = CLOSE_NORMAL
        self.close_reason = ""

    # ---- the whole connection ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self.open_session()
        except DuplexError as err:
            await self._send_now(self.conversation.error(_server_error(err)))
            await self.ws.close(close_code_for(err), str(err.code))
            return
        await self.serve()

    async def open_session(self) -> None:
        """Open the connection's session; raises ``DuplexError`` (counted) when refused."""
        try:
            self.session = await self.source.open(self.model, self.settings)
        except DuplexError as err:
            metrics.SESSIONS_REFUSED.labels(code=str(err.code)).inc()
            raise

    async def serve(self) -> None:
        """Hold the open session until the client or the session ends; then close both."""
        reader = asyncio.create_task(self._read(), name="realtime-reader")
        pump = asyncio.create_task(self._pump(), name="realtime-pump")
        writer = asyncio.create_task(self._write(), name="realtime-writer")
        overflow = asyncio.create_task(self.outbound.overflow.wait(), name="realtime-overflow")
        tasks = {reader, pump, writer, overflow}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if self.outbound.overflowed:
                metrics.SLOW_CONSUMERS.inc()
                self.close_code, self.close_reason = CLOSE_POLICY, "slow consumer: output not read"
            elif pump in done:
                # The session ended: write what is queued, then close.
                self.outbound.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(writer), 5.0)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.session is not None:
                with contextlib.suppress(DuplexError):
                    await self.session.close(timeout_s=5.0)
            # A client that does not read will not read the close frame either: do not wait.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(self.close_code, self.close_reason[:120]), 2.0)
            if self.outbound.overflowed:
                self.ws.abort()

    async def _send_now(self, event: Event) -> None:
        with contextlib.suppress(ClientGone):
            await self.ws.send(json.dumps(event))
        metrics.server_event(event["type"]).inc()

    def _emit(self, events: list[Event]) -> None:
        for event in events:
            audio_of = event["response_id"] if event["type"] == "response.output_audio.delta" else ""
            self.outbound.put(Frame(json.dumps(event), audio_of))
            metrics.server_event(event["type"]).inc()

    # ---- the client's frames ----------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.limits.idle_timeout_s):
                    message = await self.ws.recv()
            except TimeoutError:
                self.close_code, self.close_reason = CLOSE_NORMAL, "idle timeout"
                metrics.IDLE_CLOSES.inc()
                return
            except ClientGone:
                self._client_gone = True
                return
            if isinstance(message, str | bytes):
                try:
                    command = parse_client_event(message, self.settings.input_format)
                except RealtimeError as err:
                    metrics.CLIENT_EVENTS.labels(type="invalid").inc()
                    self._emit([self.conversation.error(err)])
                    continue
            else:
                command = message
            metrics.CLIENT_EVENTS.labels(type=type(command).__name__).inc()
            for attempt in range(2):
                session = self.session
                try:
                    await self._apply(command)
                    break
                except RealtimeError as err:
                    err.event_id = command.event_id
                    self._emit([self.conversation.error(err)])
                    break
                except DuplexError:
                    # The stream failed under the session: the pump resumes it (the command goes
                    # again on the resumed session) or reports why it cannot.
                    if attempt or not await self._resumed_since(session):
                        return

    async def _resumed_since(self, session: Session | None) -> bool:
        """Wait until the pump has resumed ``session`` on a new stream (True) or given up."""
        while self.session is session and not self._pump_over:
            self._swapped.clear()
            await self._swapped.wait()
        return self.session is not session

    async def _apply(self, command: Command) -> None:
        session = self.session
        assert session is not None
        conversation = self.conversation
        sent = ""
        match command:
            case AppendAudio(audio=audio):
                sent = await session.send_audio(audio)
                # Backpressure: stop reading the socket while the model is behind.
                if session.seq.last - session.acked_seq > MAX_UNACKED_APPENDS:
                    while not await session.wait_acked(MAX_UNACKED_APPENDS, timeout_s=5.0):
                        if session.closed:
                            break
            case UpdateSession():
                sent = await self._update(session, command)
            case CommitAudio():
                sent = await session.commit()
            case ClearAudio():
                sent = await session.clear()
            case CreateResponse():
                sent = await session.create_response()
            case CancelResponse(response_id=response_id):
                sent = await session.cancel_response(response_id)
            case TruncateItem(item_id=item_id, audio_end_ms=end_ms):
                response_id, answer = conversation.truncation(item_id, end_ms)
                if response_id:
                    sent = await session.playback_ack(end_ms, response_id)
                self._emit([answer])
            case DeleteItem(item_id=item_id):
                self._emit(conversation.delete_item(item_id))
            case RetrieveItem(item_id=item_id):
                self._emit(conversation.retrieve_item(item_id))
            case CreateItem(kind="function_call_output"):
                added = conversation.create_item(command)
                sent = await session.function_call_output(command.call_id, command.output)
                self._emit(added)
            case CreateItem(kind="audio", audio=audio):
                conversation.create_item(command)  # added once its turn is committed
                await session.send_audio(audio)
                sent = await session.commit()
            case CreateItem():
                self._emit(conversation.create_item(command))  # kept: the model does not take it
        conversation.remember_client_event(sent, command)

    async def _update(self, session: Session, command: UpdateSession) -> str:
        # What cannot be applied is refused alone; the rest applies (and session.updated says
        # what did not).
        self._emit([self.conversation.error(err) for err in command.problems])
        self.conversation.apply_update(command)
        return await session.update(
            input_format=command.input_format,
            output_format=command.output_format,
            turn_detection=command.turn.to_proto() if command.turn is not None else None,
            instructions=command.instructions,
            modalities=command.output_modalities,
            extra_body=self._tools(command) or None,
        )

    def _tools(self, command: UpdateSession) -> dict[str, object]:
        """The update's ``tools`` and ``tool_choice`` for a model that calls tools (its session
        takes them as ``extra_body``; one that does not keeps them here, not applied)."""
        if not self.conversation.capabilities.function_calling:
            return {}
        defaults = {"tools": [], "tool_choice": "auto"}
        return {k: defaults[k] if v is None else v for k, v in command.stored if k in defaults}

    # ---- the session's events ---------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            await self._pump_events()
        finally:
            self._pump_over = True
            self._swapped.set()

    async def _pump_events(self) -> None:
        attempts = 0
        while True:
            session = self.session
            assert session is not None
            try:
                async for ev in session.events():
                    self._on_event(ev)
                    attempts = 0
                self._closed_by_session(session)
                return
            except DuplexError as err:
                if (
                    resumable(err)
                    and session.session_id
                    and not self._client_gone
                    and attempts < RESUME_ATTEMPTS
                ):
                    attempts += 1
                    resumed = await self._resume(session, attempts)
                    if resumed:
                        continue
                metrics.SESSIONS_LOST.labels(code=str(err.code)).inc()
                self._emit([self.conversation.error(_server_error(err))])
                self.close_code, self.close_reason = close_code_for(err), str(err.code)
                return

    async def _resume(self, session: Session, attempt: int) -> bool:
        await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
        try:
            self.session = await self.source.resume(session.session_id, session.resume_token)
        except DuplexError as err:
            log.info("resume of %s failed (attempt %d): %s", session.session_id, attempt, err)
            metrics.RESUMES.labels(outcome="failed").inc()
            return attempt < RESUME_ATTEMPTS and resumable(err)
        metrics.RESUMES.labels(outcome="resumed").inc()
        self._swapped.set()
        return True

    def _on_event(self, ev: session_pb2.ServerEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "opened":
            self._emit(self.conversation.on_opened(ev.opened, first=not self._opened))
            self._opened = True
        elif kind == "audio_cancelled":
            dropped = self.outbound.drop_audio(ev.audio_cancelled.response_id)
            if dropped:
                metrics.AUDIO_DROPPED.inc(dropped)
        else:
            self._emit(self.conversation.on_event(ev))

    def _closed_by_session(self, session: Session) -> None:
        reason = session.closed_reason or ""
        if reason and reason != "client_close":
            self.close_reason = reason
            if reason == "idle_timeout":
                self.close_code = CLOSE_NORMAL
            else:
                self.close_code = CLOSE_GOING_AWAY if reason == "draining" else CLOSE_POLICY
                err = RealtimeError(reason, f"the session ended: {reason}", type="server_error")
                self._emit([self.conversation.error(err)])

    # ---- the client ------------------------------------------------------------------------

    async def _write(self) -> None:
        while (frame := await self.outbound.get()) is not None:
            try:
                await self.ws.send(frame.text)
            except ClientGone:
                self._client_gone = True
                return
