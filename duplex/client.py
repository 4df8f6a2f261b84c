"""Async Python client for ``duplex.v1.DuplexSession``: one object per conversation.

The proto (``proto/duplex/v1/session.proto``) is the contract; this module wraps it so a
Python backend does not have to track sequence numbers, epochs, resume tokens or formats::

    import asyncio
    from duplex.client import DuplexClient

    async def main() -> None:
        async with DuplexClient("127.0.0.1:50051") as client:
            async with await client.open_session(model="parrot") as session:
                sender = asyncio.create_task(session.stream_file("hello.wav", trailing_silence_ms=1000))
                reply = bytearray()
                async for ev in session.events():
                    kind = ev.WhichOneof("event")
                    if kind == "audio_delta":
                        reply += ev.audio_delta.pcm  # in session.output_format
                    elif kind == "response_done":
                        break
                await sender

    asyncio.run(main())

Errors: everything raised here is a ``duplex.errors.DuplexError`` carrying a stable string
``code``. A call the server ends with a status becomes the matching typed error
(``from_rpc_error``); an ``error`` *event* (the session goes on) is yielded like any other
event, or raised as ``ServerErrorEvent`` when the session was opened with
``raise_on_error=True``.

Credentials: ``DuplexClient(target, credentials=tls_credentials(ca=...), token=...)`` talks TLS
(trusting ``ca``; with ``cert``/``key`` also presenting a client certificate) and sends
``authorization: Bearer <token>`` with every call, resumes included. A refusal is
``UnauthenticatedError`` with the code ``unauthenticated``.

Reconnects: when the server drains it sends ``go_away`` (with a fresh resume token) and ends
the stream; the session then calls ``Session.reconnect`` -- the one place that re-attaches
with ``resume`` -- on the same target and carries on. Sends issued meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, Self, TypeAlias

import grpc
import numpy as np
from google.protobuf import struct_pb2

from duplex.audio import (
    PCM16K_MONO,
    AudioFileError,
    PcmFormat,
    StreamConverter,
    encode,
    read_wav,
    resample,
    to_mono,
)
from duplex.errors import DuplexError, ErrorCode, UnavailableError, from_rpc_error
from duplex.serving import CHANNEL_OPTIONS
from duplex.v1 import session_pb2, session_pb2_grpc

if TYPE_CHECKING:  # exists only in the generated .pyi: the stub's type on an aio channel
    from duplex.v1.session_pb2_grpc import DuplexSessionAsyncStub

log = logging.getLogger("duplex.client")

ServerEvent = session_pb2.ServerEvent
ClientEvent = session_pb2.ClientEvent

#: One ``Converse`` call on an aio channel: client events in, server events out.
ConverseCall: TypeAlias = grpc.aio.StreamStreamCall[ClientEvent, ServerEvent]


class EventCall(Protocol):
    """What a ``Session`` needs of its call: a ``Converse`` call (``ConverseCall``), or one lane
    of a ``ConverseMany`` stream (``duplex.client_lanes``)."""

    async def read(self) -> object:
        """The next ``ServerEvent``, or ``grpc.aio.EOF`` once the call ended."""
        ...

    async def write(self, request: ClientEvent) -> None: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> bool: ...

    async def code(self) -> grpc.StatusCode: ...

    async def details(self) -> str: ...

    async def trailing_metadata(self) -> Any: ...


#: Client-side error codes (the server's codes are ``duplex.errors.ErrorCode``).
CONNECT_FAILED: Final = "connect_failed"
SESSION_CLOSED: Final = "session_closed"
PROTOCOL_ERROR: Final = "protocol_error"
TIMEOUT: Final = "timeout"


class DuplexClientError(DuplexError):
    """A failure detected on the client side (no server status behind it)."""


class ConnectError(DuplexClientError):
    """The target could not be reached (nothing listening, DNS, TLS handshake)."""

    status = grpc.StatusCode.UNAVAILABLE
    retryable = True


class SessionClosedError(DuplexClientError):
    """The session ended (closed by either side) and cannot carry this call."""


class ProtocolError(DuplexClientError):
    """The server sent something the contract does not allow (e.g. no ``opened`` first)."""


class ServerErrorEvent(DuplexClientError):
    """An ``error`` event, raised because the session was opened with ``raise_on_error=True``."""

    def __init__(self, event: session_pb2.Error) -> None:
        super().__init__(event.code, event.message, retryable=event.retryable)
        self.event_id = event.event_id
        self.event = event


def event_kind(ev: session_pb2.ServerEvent) -> str:
    """The name of the event's oneof field, e.g. ``"audio_delta"`` (``""`` if unset)."""
    return ev.WhichOneof("event") or ""


def to_struct(values: Mapping[str, Any] | None) -> struct_pb2.Struct | None:
    """A plain dict as a protobuf Struct (numbers become floats, as JSON)."""
    if values is None:
        return None
    s = struct_pb2.Struct()
    s.update(dict(values))
    return s


def turn_detection(
    *, auto_respond: bool = True, silence_ms: int = 0, barge_in: bool = True
) -> session_pb2.TurnDetection:
    """Server turn detection settings (the defaults are what ``open`` assumes when absent)."""
    return session_pb2.TurnDetection(auto_respond=auto_respond, silence_ms=silence_ms, barge_in=barge_in)


def load_wav_as(path: str | Path, fmt: PcmFormat) -> bytes:
    """Read a WAV file (any rate, integer or float PCM, any channel count) as PCM bytes in ``fmt``.

    Channels are averaged to mono and then resampled, so a 44.1 kHz stereo file becomes
    what a 16 kHz mono session expects. Raises ``duplex.audio.AudioFileError`` (a missing
    or unreadable file included).
    """
    try:
        samples, rate = read_wav(path)
    except OSError as exc:
        raise AudioFileError(f"{path}: {exc.strerror or exc}") from exc
    mono = resample(to_mono(samples), rate, fmt.sample_rate_hz)
    return encode(mono, fmt)


def tls_credentials(
    *, ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: trust ``ca`` (default: the system's roots) and,
    with ``cert`` and ``key``, present that client certificate (mutual TLS). Raises
    ``DuplexClientError`` (``invalid_config``) for a missing half of a pair or a file that
    cannot be read."""
    if (cert is None) != (key is None):
        raise DuplexClientError(ErrorCode.INVALID_CONFIG, "a client certificate needs both its cert and key")
    try:
        return grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes() if ca is not None else None,
            private_key=key.read_bytes() if key is not None else None,
            certificate_chain=cert.read_bytes() if cert is not None else None,
        )
    except OSError as exc:
        raise DuplexClientError(
            ErrorCode.INVALID_CONFIG, f"cannot read {exc.filename}: {exc.strerror or exc}"
        ) from exc


def read_token(path: Path) -> str:
    """A bearer token from a file (surrounding whitespace, such as a final newline, dropped).
    Raises ``DuplexClientError`` (``invalid_config``) for a file that cannot be read, is empty,
    or holds what cannot be a token (whitespace or control characters inside)."""
    try:
        token = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not ASCII"
        raise DuplexClientError(
            ErrorCode.INVALID_CONFIG, f"cannot read the token file {path}: {why}"
        ) from exc
    check_token(token, f"the token file {path}")
    return token


def check_token(token: str, source: str = "the token") -> None:
    """Raise ``DuplexClientError`` unless ``token`` can travel as a bearer token (printable
    ASCII without spaces). The message never quotes the token."""
    if not token or not all(33 <= ord(c) <= 126 for c in token):
        raise DuplexClientError(
            ErrorCode.INVALID_CONFIG, f"{source}: a token is printable ASCII without spaces, and not empty"
        )


class SeqCounter:
    """Append sequence numbers: 1, 2, 3, ... within an epoch, back to 1 on a new epoch.

    The server restarts its expectation at every ``audio_cancelled`` (and on resume into a
    new epoch); ``restart`` is called for both.
    """

    def __init__(self) -> None:
        self.last = 0
        self.epoch = 0

    def next(self) -> int:
        self.last += 1
        return self.last

    def restart(self, epoch: int) -> None:
        self.last = 0
        self.epoch = epoch


class DuplexClient:
    """A channel to a session service; opens and resumes sessions.

    ``target`` is ``HOST:PORT`` (or any gRPC target string). Pass ``credentials``
    (``tls_credentials(ca=...)`` or any ``grpc.ssl_channel_credentials(...)``) for TLS and
    ``token`` to send ``authorization: Bearer <token>`` with every call. ``options`` are extra gRPC
    channel options, appended to ``duplex.serving.CHANNEL_OPTIONS``.
    """

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        options: Iterable[tuple[str, Any]] = (),
        connect_timeout_s: float = 5.0,
    ) -> None:
        if token:
            check_token(token)
        self.target = target
        self.credentials = credentials
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self._options = [*CHANNEL_OPTIONS, *options]
        self._channel: grpc.aio.Channel | None = None
        self._stub: DuplexSessionAsyncStub | None = None
        self._event_ids = itertools.count(1)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _ensure_channel(self) -> DuplexSessionAsyncStub:
        # Lazily, so a client can be built outside a running event loop.
        if self._channel is None or self._stub is None:
            if self.credentials is not None:
                self._channel = grpc.aio.secure_channel(self.target, self.credentials, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            self._stub = session_pb2_grpc.DuplexSessionStub(self._channel)
        return self._stub

    async def connect(self, timeout_s: float | None = None) -> None:
        """Wait until the channel is connected; raises ``ConnectError`` after ``timeout_s``."""
        self._ensure_channel()
        assert self._channel is not None
        timeout = self.connect_timeout_s if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise ConnectError(
                CONNECT_FAILED, f"could not connect to {self.target} within {timeout:g}s"
            ) from None

    async def close(self) -> None:
        """Close the channel (ends any session still open on it)."""
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    def metadata(self) -> list[tuple[str, str]]:
        """Per-call metadata: the bearer token when one is set (the place to add more)."""
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def next_event_id(self) -> str:
        return f"c{next(self._event_ids)}"

    async def open_session(
        self,
        *,
        model: str = "",
        input_format: PcmFormat = PCM16K_MONO,
        output_format: PcmFormat | None = None,
        turn_detection: session_pb2.TurnDetection | None = None,
        instructions: str = "",
        modalities: Iterable[str] = (),
        idle_timeout_s: int = 0,
        extra_body: Mapping[str, Any] | None = None,
        raise_on_error: bool = False,
        auto_resume: bool = True,
        timeout_s: float = 15.0,
    ) -> Session:
        """Open a new session and wait for ``opened`` (the settings: see ``open_event``).

        Raises the typed ``DuplexError`` the server ended the call with (bad open:
        ``BadRequestError``, no capacity: ``CapacityError``...) or ``ConnectError``.
        """
        first = self.open_event(
            model=model,
            input_format=input_format,
            output_format=output_format,
            turn_detection=turn_detection,
            instructions=instructions,
            modalities=modalities,
            idle_timeout_s=idle_timeout_s,
            extra_body=extra_body,
        )
        call, opened = await self._start(first, timeout_s)
        return Session(self, call, opened, raise_on_error=raise_on_error, auto_resume=auto_resume)

    def open_event(
        self,
        *,
        model: str = "",
        input_format: PcmFormat = PCM16K_MONO,
        output_format: PcmFormat | None = None,
        turn_detection: session_pb2.TurnDetection | None = None,
        instructions: str = "",
        modalities: Iterable[str] = (),
        idle_timeout_s: int = 0,
        extra_body: Mapping[str, Any] | None = None,
    ) -> session_pb2.ClientEvent:
        """The ``open`` event of a new session. ``model`` is the plugin id the caller expects
        ("" = whatever the service runs); ``extra_body`` holds model options (parrot:
        ``silence_ms``, ``pitch_semitones``...)."""
        config = session_pb2.SessionConfig(
            input_format=input_format.to_proto(),
            instructions=instructions,
            modalities=list(modalities),
            idle_timeout_s=idle_timeout_s,
        )
        if output_format is not None:
            config.output_format.CopyFrom(output_format.to_proto())
        if turn_detection is not None:
            config.turn_detection.CopyFrom(turn_detection)
        body = to_struct(extra_body)
        # This client reads acks carried on other events: a message per frame fewer.
        open_msg = session_pb2.SessionOpen(model=model, config=config, extra_body=body, acks_on_output=True)
        return session_pb2.ClientEvent(event_id=self.next_event_id(), open=open_msg)

    def resume_event(self, session_id: str, token: str, last_event_id: str = "") -> session_pb2.ClientEvent:
        """The ``resume`` event of a session (``last_event_id``: the last event received)."""
        return session_pb2.ClientEvent(
            event_id=self.next_event_id(),
            resume=session_pb2.SessionResume(
                session_id=session_id, resume_token=token, last_event_id=last_event_id, acks_on_output=True
            ),
        )

    async def resume(
        self,
        session_id: str,
        token: str,
        *,
        raise_on_error: bool = False,
        auto_resume: bool = True,
        timeout_s: float = 15.0,
    ) -> Session:
        """Re-attach to an existing session (after a dropped stream) with its resume token."""
        call, opened = await self._start(self.resume_event(session_id, token), timeout_s)
        return Session(self, call, opened, raise_on_error=raise_on_error, auto_resume=auto_resume)

    async def _start(
        self,
        first: session_pb2.ClientEvent,
        timeout_s: float,
        connect_timeout_s: float | None = None,
        call: EventCall | None = None,
    ) -> tuple[EventCall, session_pb2.ServerEvent]:
        """Start a Converse call (or use ``call``, a lane) with ``first`` (open or resume) and
        read its ``opened``."""
        stub = self._ensure_channel()
        await self.connect(min(timeout_s, connect_timeout_s or self.connect_timeout_s))
        if call is None:
            call = stub.Converse(metadata=self.metadata())
        try:
            async with asyncio.timeout(timeout_s):
                await call.write(first)
                ev = await _read_event(call)
        except TimeoutError:
            call.cancel()
            raise DuplexClientError(TIMEOUT, f"no answer to open/resume within {timeout_s:g}s") from None
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        except asyncio.InvalidStateError:
            # write() after the server already ended the call: the status says why.
            raise await _call_failure(call) from None
        if ev is None:
            raise await _call_failure(call)
        kind = event_kind(ev)
        if kind == "error":
            call.cancel()
            raise ServerErrorEvent(ev.error)
        if kind != "opened":
            call.cancel()
            raise ProtocolError(PROTOCOL_ERROR, f"expected 'opened' as the first event, got {kind!r}")
        return call, ev


async def _read_event(call: EventCall) -> session_pb2.ServerEvent | None:
    """The call's next server event, or None once the server has ended the stream."""
    ev = await call.read()
    if ev is grpc.aio.EOF:
        return None
    # The stubs type read() as ``object | ServerEvent`` (EOF is a plain object); the call's
    # deserializer only ever makes ServerEvents.
    assert isinstance(ev, session_pb2.ServerEvent), type(ev)
    return ev


async def _call_failure(call: EventCall) -> DuplexError:
    """The typed error for a call that has ended (with or without an error status)."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return SessionClosedError(SESSION_CLOSED, "the server ended the call")
    details = await call.details()
    # Rebuild via from_rpc_error so the ErrorInfo code in the trailers is kept.
    trailing = await call.trailing_metadata()
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)
    return from_rpc_error(exc)


_END: Final = object()


class Session:
    """One open conversation. Create with ``DuplexClient.open_session`` or ``resume``.

    Sending is safe from several tasks at once (appends are numbered in the order they are
    written). ``events()`` is the one reader: iterate it from a single task.
    """

    def __init__(
        self,
        client: DuplexClient,
        call: EventCall,
        opened: session_pb2.ServerEvent,
        *,
        raise_on_error: bool = False,
        auto_resume: bool = True,
        resume_attempts: int = 5,
    ) -> None:
        self._client = client
        self._call = call
        self.raise_on_error = raise_on_error
        self.auto_resume = auto_resume
        self.resume_attempts = resume_attempts
        self.session_id = ""
        self.epoch = 0
        self.resume_token = ""
        self.capabilities = session_pb2.Capabilities()
        self.config = session_pb2.SessionConfig()
        self.seq = SeqCounter()
        self.acked_seq = 0
        self.active_response_id = ""
        self.last_event_id = ""
        """The id of the last server event received (sent with a resume, so ids never repeat)."""
        self.last_response: session_pb2.LastResponse | None = None
        """After a resume: what the server says became of the session's last response."""
        self.closed_reason: str | None = None
        self.go_away: session_pb2.GoAway | None = None
        self._apply_opened(opened.opened, first=True)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._queue.put_nowait(opened)
        self._failure: DuplexError | None = None
        self._send_lock = asyncio.Lock()
        self._writable = asyncio.Event()
        self._writable.set()
        self._acks = asyncio.Condition()
        self._closing = False
        self._done = asyncio.Event()
        self._reader = asyncio.create_task(self._read_loop(), name=f"duplex-session-{self.session_id}")

    # ---- state -------------------------------------------------------------------------

    @property
    def input_format(self) -> PcmFormat:
        """The format ``send_audio`` expects (from the effective session config)."""
        return PcmFormat.from_proto(self.config.input_format)

    @property
    def output_format(self) -> PcmFormat:
        """The format of ``audio_delta`` PCM (the session's output format)."""
        fmt = self.config.output_format
        if fmt.sample_rate_hz:
            return PcmFormat.from_proto(fmt)
        native = self.capabilities.output_format
        rate = self.config.input_format.sample_rate_hz or native.sample_rate_hz
        return PcmFormat(native.encoding or PCM16K_MONO.encoding, rate, native.channels or 1)

    @property
    def closed(self) -> bool:
        """True once the stream has ended for good."""
        return self._done.is_set()

    def _apply_opened(self, opened: session_pb2.SessionOpened, *, first: bool = False) -> None:
        if first or opened.epoch != self.epoch:
            self.seq.restart(opened.epoch)
            self.acked_seq = 0
        self.session_id = opened.session_id
        self.epoch = opened.epoch
        self.resume_token = opened.resume_token
        self.last_response = opened.last_response if opened.HasField("last_response") else None
        self.capabilities.CopyFrom(opened.capabilities)
        self.config.CopyFrom(opened.config)

    async def _track(self, ev: session_pb2.ServerEvent) -> None:
        """Keep the session's view of epoch, acks, responses and tokens current."""
        kind = event_kind(ev)
        if ev.event_id.startswith("se_"):
            self.last_event_id = ev.event_id
        ack = ev.input_ack if kind == "input_ack" else ev.carried_ack if ev.HasField("carried_ack") else None
        if ack is not None and ack.epoch == self.epoch:
            async with self._acks:
                self.acked_seq = max(self.acked_seq, ack.seq)
                self._acks.notify_all()
        if kind == "audio_cancelled":
            async with self._acks:
                self.epoch = ev.audio_cancelled.epoch
                self.seq.restart(self.epoch)  # the proto: seq restarts at 1 after audio_cancelled
                self.acked_seq = 0
                self._acks.notify_all()
        elif kind == "response_started":
            self.active_response_id = ev.response_started.response_id
            if ev.response_started.resume_token:
                self.resume_token = ev.response_started.resume_token
        elif kind == "response_done":
            if ev.response_done.response_id == self.active_response_id:
                self.active_response_id = ""
            if ev.response_done.resume_token:
                self.resume_token = ev.response_done.resume_token
        elif kind == "updated":
            self.config.CopyFrom(ev.updated.config)
        elif kind == "go_away":
            self.go_away = ev.go_away
            if ev.go_away.resume_token:
                self.resume_token = ev.go_away.resume_token
            if self.auto_resume:
                # New input belongs on the resumed call: hold sends until reconnect() is done.
                self._writable.clear()
        elif kind == "closed":
            self.closed_reason = ev.closed.reason

    # ---- receiving ---------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    ev = await _read_event(self._call)
                except grpc.RpcError as exc:
                    if self._should_resume():
                        await self.reconnect()
                        continue
                    if not self._closing or exc.code() != grpc.StatusCode.CANCELLED:
                        self._failure = from_rpc_error(exc)
                    break
                if ev is None:
                    if self._should_resume():
                        await self.reconnect()
                        continue
                    code = await self._call.code()
                    if code != grpc.StatusCode.OK and not (
                        self._closing and code == grpc.StatusCode.CANCELLED
                    ):
                        self._failure = await _call_failure(self._call)
                    break
                await self._track(ev)
                self._queue.put_nowait(ev)
        except DuplexError as exc:  # reconnect failed
            self._failure = exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave events() hanging on a bug
            log.exception("session reader failed")
            self._failure = DuplexClientError(ErrorCode.INTERNAL, f"client reader failed: {exc!r}")
        finally:
            self._writable.set()  # wake blocked senders: they will see the session is done
            self._done.set()
            async with self._acks:
                self._acks.notify_all()
            self._queue.put_nowait(_END)

    def _should_resume(self) -> bool:
        draining = self.go_away is not None or self.closed_reason == ErrorCode.DRAINING
        return self.auto_resume and draining and not self._closing

    async def reconnect(self) -> None:
        """Re-attach to this session on a new call with ``resume`` and the latest token.

        This is the single reconnect hook. It runs on its own after ``go_away`` (once the old
        stream has ended, so in-flight output is not cut off); call it yourself after a
        dropped connection, or override it to pick another target. Sends wait meanwhile.
        The ``opened`` answer is delivered through ``events()`` like any other event.
        """
        self._writable.clear()
        delay = 0.2
        last: DuplexError | None = None
        for attempt in range(self.resume_attempts):
            first = self._client.resume_event(self.session_id, self.resume_token, self.last_event_id)
            try:
                call, opened = await self._client._start(first, timeout_s=10.0, connect_timeout_s=2.0)
            except (UnavailableError, ConnectError) as exc:
                last = exc
                log.info("resume attempt %d for %s failed: %s", attempt + 1, self.session_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self._call = call
            self.go_away = None
            self.closed_reason = None
            self._apply_opened(opened.opened)
            self._queue.put_nowait(opened)
            self._writable.set()
            return
        assert last is not None
        raise last

    async def events(self) -> AsyncIterator[session_pb2.ServerEvent]:
        """Server events in order, starting with ``opened``; ends when the session ends.

        Raises the typed error if the call failed, and ``ServerErrorEvent`` for ``error``
        events when ``raise_on_error`` is set.
        """
        while True:
            ev = await self._queue.get()
            if ev is _END:
                self._queue.put_nowait(_END)  # later calls end at once too
                if self._failure is not None:
                    raise self._failure
                return
            assert isinstance(ev, session_pb2.ServerEvent)
            if self.raise_on_error and event_kind(ev) == "error":
                raise ServerErrorEvent(ev.error)
            yield ev

    async def wait_for(
        self,
        *kinds: str,
        timeout_s: float = 30.0,
        on_event: Callable[[session_pb2.ServerEvent], None] | None = None,
    ) -> session_pb2.ServerEvent:
        """Consume events until one of ``kinds`` arrives and return it.

        Every consumed event (the match included) is passed to ``on_event`` first. Raises
        ``DuplexClientError(timeout)`` or ``SessionClosedError`` if it never comes.
        """
        try:
            async with asyncio.timeout(timeout_s):
                async for ev in self.events():
                    if on_event is not None:
                        on_event(ev)
                    if event_kind(ev) in kinds:
                        return ev
        except TimeoutError:
            raise DuplexClientError(TIMEOUT, f"no {'/'.join(kinds)} within {timeout_s:g}s") from None
        raise SessionClosedError(SESSION_CLOSED, f"session ended before {'/'.join(kinds)}")

    # ---- sending -----------------------------------------------------------------------

    async def _send(self, event: session_pb2.ClientEvent, *, append_pcm: bytes | None = None) -> str:
        """Write one client event; numbers appends under the lock so seq follows write order."""
        if not event.event_id:
            event.event_id = self._client.next_event_id()
        while True:
            await self._writable.wait()
            if self._done.is_set():
                raise self._failure or SessionClosedError(SESSION_CLOSED, "the session has ended")
            async with self._send_lock:
                if not self._writable.is_set():
                    continue  # a reconnect started while we waited for the lock
                if append_pcm is not None:
                    event.append.seq = self.seq.next()
                try:
                    await self._call.write(event)
                    return event.event_id
                except (grpc.RpcError, asyncio.InvalidStateError) as exc:
                    if append_pcm is not None:
                        self.seq.last -= 1  # not sent: the number is free again
                    if self._should_resume() or not self._writable.is_set():
                        await asyncio.sleep(0.05)  # the reader is reconnecting; retry on the new call
                        continue
                    if isinstance(exc, grpc.RpcError):
                        raise from_rpc_error(exc) from None
                    raise self._failure or SessionClosedError(
                        SESSION_CLOSED, "the session has ended"
                    ) from None

    async def send_audio(self, pcm: bytes, *, fmt: PcmFormat | None = None) -> str:
        """Append PCM (in the session's input format) as one ``append``; returns its event id.

        ``fmt`` is declared on the wire when given (it must equal the session's input
        format). Larger chunks than the server accepts are split.
        """
        limit = self.capabilities.max_append_bytes
        frame = (fmt or self.input_format).frame_bytes
        if limit and len(pcm) > limit:
            step = max(frame, limit - limit % frame)
            event_id = ""
            for i in range(0, len(pcm), step):
                event_id = await self.send_audio(pcm[i : i + step], fmt=fmt)
            return event_id
        append = session_pb2.InputAudioAppend(pcm=pcm)
        if fmt is not None:
            append.format.CopyFrom(fmt.to_proto())
        return await self._send(session_pb2.ClientEvent(append=append), append_pcm=pcm)

    async def wait_acked(self, max_unacked: int, timeout_s: float = 2.0) -> bool:
        """Wait until at most ``max_unacked`` appends are unacknowledged; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s), self._acks:
                await self._acks.wait_for(
                    lambda: self.seq.last - self.acked_seq <= max_unacked or self._done.is_set()
                )
            return True
        except TimeoutError:
            return False

    async def stream_audio(
        self,
        chunks: AsyncIterable[bytes] | Iterable[bytes],
        *,
        fmt: PcmFormat | None = None,
        chunk_ms: int = 20,
        realtime: bool = False,
        max_unacked_ms: int = 2000,
        progress: Callable[[float], None] | None = None,
    ) -> float:
        """Send PCM chunks from a (sync or async) iterator; returns the milliseconds sent.

        Chunks in ``fmt`` (default: the session's input format) are converted to the input
        format and re-cut into ``chunk_ms`` appends. ``realtime`` paces them at the speed of
        audio (like a microphone); otherwise they go as fast as the server acknowledges them,
        keeping at most ``max_unacked_ms`` unacknowledged. ``progress`` gets the ms sent so far.
        """
        dst = self.input_format
        src = fmt or dst
        converter = StreamConverter(src, dst)
        step = dst.bytes_for_ms(chunk_ms)
        window = max(1, max_unacked_ms // chunk_ms)
        use_window = True
        pending = bytearray()
        sent_ms = 0.0
        start = time.monotonic()

        async def flush(final: bool) -> None:
            nonlocal sent_ms, use_window
            while len(pending) >= step or (final and pending):
                piece = bytes(pending[:step])
                del pending[:step]
                if realtime:
                    delay = start + sent_ms / 1000.0 - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                elif use_window and not await self.wait_acked(window):
                    # No acks coming: do not stall forever, fall back to gRPC flow control.
                    log.warning("no input_ack for 2s; sending without an ack window")
                    use_window = False
                await self.send_audio(piece)
                sent_ms += dst.duration_ms(len(piece))
                if progress is not None:
                    progress(sent_ms)

        if isinstance(chunks, AsyncIterable):
            async for chunk in chunks:
                pending += converter.convert(chunk)
                await flush(False)
        else:
            for chunk in chunks:
                pending += converter.convert(chunk)
                await flush(False)
        pending += converter.flush()  # what the resampler still holds: the input's last few ms
        await flush(True)
        return sent_ms

    async def stream_file(
        self,
        path: str | Path,
        *,
        realtime: bool = True,
        chunk_ms: int = 20,
        trailing_silence_ms: int = 0,
        progress: Callable[[float], None] | None = None,
    ) -> float:
        """Send a WAV file converted to the session's input format; returns the ms sent.

        ``trailing_silence_ms`` of silence is appended so server turn detection can end the
        turn. Raises ``duplex.audio.AudioFileError`` for an unreadable file (before sending).
        """
        fmt = self.input_format
        pcm = load_wav_as(path, fmt)
        if trailing_silence_ms:
            pcm += encode(np.zeros(fmt.sample_rate_hz * trailing_silence_ms // 1000, np.float32), fmt)
        return await self.stream_audio(
            [pcm], fmt=fmt, chunk_ms=chunk_ms, realtime=realtime, progress=progress
        )

    async def commit(self) -> str:
        """End the user's turn: what was appended becomes the next response's input."""
        return await self._send(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))

    async def clear(self) -> str:
        """Discard audio appended since the last commit."""
        return await self._send(session_pb2.ClientEvent(clear=session_pb2.InputAudioClear()))

    async def create_response(self, extra_body: Mapping[str, Any] | None = None) -> str:
        """Ask for a response to the committed input (needed when ``auto_respond`` is off)."""
        msg = session_pb2.ResponseCreate(extra_body=to_struct(extra_body))
        return await self._send(session_pb2.ClientEvent(response_create=msg))

    async def cancel_response(self, response_id: str = "") -> str:
        """Cancel a response ("" = the active one); the server answers ``audio_cancelled``."""
        msg = session_pb2.ResponseCancel(response_id=response_id)
        return await self._send(session_pb2.ClientEvent(response_cancel=msg))

    async def barge_in(self) -> str:
        """The user interrupts: cancel the active response and drop queued output."""
        return await self._send(session_pb2.ClientEvent(barge_in=session_pb2.BargeIn()))

    async def playback_ack(self, played_ms: int, response_id: str = "") -> str:
        """Report how much of a response has been played ("" = the active response)."""
        msg = session_pb2.PlaybackAck(response_id=response_id or self.active_response_id, played_ms=played_ms)
        return await self._send(session_pb2.ClientEvent(playback_ack=msg))

    async def function_call_output(self, call_id: str, output: str) -> str:
        """Return the result of a function call the model asked for."""
        msg = session_pb2.FunctionCallOutput(call_id=call_id, output=output)
        return await self._send(session_pb2.ClientEvent(function_call_output=msg))

    async def update(
        self,
        *,
        input_format: PcmFormat | None = None,
        output_format: PcmFormat | None = None,
        turn_detection: session_pb2.TurnDetection | None = None,
        instructions: str | None = None,
        modalities: Iterable[str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> str:
        """Change settings; the server answers ``updated`` (or an ``error``). Unset = unchanged."""
        config = session_pb2.SessionConfig()
        if input_format is not None:
            config.input_format.CopyFrom(input_format.to_proto())
        if modalities is not None:
            config.modalities.extend(modalities)
        if output_format is not None:
            config.output_format.CopyFrom(output_format.to_proto())
        if turn_detection is not None:
            config.turn_detection.CopyFrom(turn_detection)
        if instructions is not None:
            config.instructions = instructions
        msg = session_pb2.SessionUpdate(config=config, extra_body=to_struct(extra_body))
        return await self._send(session_pb2.ClientEvent(update=msg))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send ``close``, let the server answer ``closed`` and end the stream. Idempotent.

        Events still queued stay readable through ``events()``.
        """
        if self._closing:
            await self._finish(timeout_s)
            return
        self._closing = True
        if not self._done.is_set():
            with contextlib.suppress(DuplexError):
                async with asyncio.timeout(timeout_s):
                    await self._send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
                    await self._call.done_writing()
        await self._finish(timeout_s)

    async def _finish(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        except TimeoutError:
            self._call.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), 1.0)
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


__all__ = [
    "CONNECT_FAILED",
    "PROTOCOL_ERROR",
    "SESSION_CLOSED",
    "TIMEOUT",
    "ConnectError",
    "ConverseCall",
    "DuplexClient",
    "DuplexClientError",
    "EventCall",
    "ProtocolError",
    "SeqCounter",
    "ServerErrorEvent",
    "Session",
    "SessionClosedError",
    "event_kind",
    "load_wav_as",
    "to_struct",
    "turn_detection",
]
