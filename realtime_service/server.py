"""The edge's WebSocket server and its streams to the session service.

A WebSocket upgrade is checked before it is accepted: the path (``/v1/realtime``), the
credentials (``Authorization: Bearer``, checked here as the session service checks them when the
edge is given the same token file or JWKS, and passed through to it in every case), and the
connection bounds (in all, and per principal). A refusal is a plain HTTP answer (401, 404, 429,
503) with an OpenAI-shaped JSON error. ``/healthz`` and ``/readyz`` are the probes.

The sessions of one credential share ONE ``ConverseMany`` stream (``Upstream``): the session
service sees one caller with many lanes, and its per-principal limits hold for the edge's clients
as for anyone's. A stream that failed is replaced by a new one for the next session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import ssl
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from duplex.client import DuplexClient, Session, turn_detection
from duplex.client_lanes import Lanes
from duplex.errors import DuplexError
from duplex.files import WatchedFiles
from duplex.serving import Slots
from duplex.tls import ChannelCredentials, ClientTLS
from realtime_service import metrics
from realtime_service.connection import CLOSE_GOING_AWAY, Connection, Limits
from realtime_service.conversation import Settings
from session_service.trust.auth import Authenticator

log = logging.getLogger("duplex.realtime")

#: How often the TLS files are checked for a rotation.
TLS_RELOAD_CHECK_S = 30.0

#: How long a close handshake waits for the client's answer.
CLOSE_TIMEOUT_S = 5.0

_WS_LOG = logging.getLogger("duplex.realtime.websockets")
_WS_LOG.setLevel(logging.WARNING)

#: The paths the API is served at (``base_url`` + ``/realtime``, as the SDKs build it).
REALTIME_PATHS = ("/v1/realtime", "/realtime")


@dataclass(frozen=True)
class EdgeConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 8765
    session_target: str = "127.0.0.1:50051"
    model: str = ""
    """The model a connection asks for when its URL names none ("" = the service's)."""
    limits: Limits = field(default_factory=Limits)
    max_connections: int = 1024
    max_connections_per_principal: int = 64
    max_message_bytes: int = 1024 * 1024
    tls_cert: Path | None = None
    tls_key: Path | None = None
    session_tls: ClientTLS | None = None
    drain_grace_s: float = 10.0


def _refusal(status: HTTPStatus, code: str, message: str) -> Response:
    body = json.dumps({"error": {"type": "invalid_request_error", "code": code, "message": message}})
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return Response(status.value, status.phrase, headers, body.encode())


def bearer_token(headers: Headers) -> str | None:
    """The token of the request's one ``Authorization: Bearer`` header (None without one);
    raises ValueError for a malformed or repeated header."""
    values = headers.get_all("Authorization")
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("more than one Authorization header")
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ValueError("expected 'Authorization: Bearer <token>'")
    return token.strip()


@dataclass
class _Stream:
    client: DuplexClient
    lanes: Lanes
    refs: int = 0
    """Connections holding it."""


class Upstream:
    """One ``ConverseMany`` stream per credential to the session service, shared by that
    credential's connections; closed when its last connection lets it go. A stream that failed
    is replaced (on the same channel) for the next session."""

    def __init__(self, target: str, tls: ClientTLS | None) -> None:
        self.target = target
        self._credentials = ChannelCredentials(tls) if tls is not None else None
        self._streams: dict[str, _Stream] = {}

    def hold(self, token: str) -> None:
        stream = self._streams.get(token)
        if stream is None:
            credentials = self._credentials.current() if self._credentials is not None else None
            client = DuplexClient(self.target, credentials=credentials, token=token or None)
            stream = self._streams[token] = _Stream(client, Lanes(client))
            metrics.STREAMS.set(len(self._streams))
        stream.refs += 1

    def lanes(self, token: str) -> Lanes:
        """The credential's stream (``hold`` it first), a new one if it failed."""
        stream = self._streams[token]
        if not stream.lanes.usable:
            stream.lanes = Lanes(stream.client)
        return stream.lanes

    async def release(self, token: str) -> None:
        stream = self._streams.get(token)
        if stream is None:
            return
        stream.refs -= 1
        if stream.refs <= 0:
            del self._streams[token]
            metrics.STREAMS.set(len(self._streams))
            await _close(stream)

    def source(self, token: str) -> CredentialSource:
        return CredentialSource(self, token)

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await _close(stream)


async def _close(stream: _Stream) -> None:
    await stream.lanes.close(timeout_s=2.0)
    await stream.client.close()


class CredentialSource:
    """A connection's sessions, on its credential's stream (``connection.SessionSource``)."""

    def __init__(self, upstream: Upstream, token: str) -> None:
        self._upstream = upstream
        self._token = token
        self._held = False

    def _lanes(self) -> Lanes:
        if not self._held:
            self._held = True
            self._upstream.hold(self._token)
        return self._upstream.lanes(self._token)

    async def open(self, model: str, settings: Settings) -> Session:
        lanes = self._lanes()
        return await lanes.open_session(
            model=model,
            input_format=settings.input_format,
            output_format=settings.output_format,
            turn_detection=turn_detection(auto_respond=settings.turn.create_response, barge_in=True),
        )

    async def resume(self, session_id: str, resume_token: str) -> Session:
        lanes = self._lanes()
        return await lanes.resume(session_id, resume_token)

    async def release(self) -> None:
        if self._held:
            self._held = False
            await self._upstream.release(self._token)


class EdgeServer:
    def __init__(self, config: EdgeConfig, auth: Authenticator) -> None:
        self.config = config
        self.auth = auth
        self.upstream = Upstream(config.session_target, config.session_tls)
        self.slots = Slots(config.max_connections_per_principal, config.max_connections)
        self.draining = False
        self._server: Server | None = None
        self._connections: set[ServerConnection] = set()
        self._all_gone = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0

    # ---- admission ---------------------------------------------------------------------------

    def principal(self, headers: Headers) -> tuple[str, str]:
        """(principal, token) of a request; raises PermissionError with what is wrong."""
        try:
            token = bearer_token(headers)
        except ValueError as exc:
            raise PermissionError(str(exc)) from None
        if self.auth.bearer_tokens:
            if token is None:
                raise PermissionError("no credentials: send 'Authorization: Bearer <token>'")
            try:
                principal = self.auth.token_principal([("authorization", f"Bearer {token}")])
            except DuplexError as exc:
                raise PermissionError(exc.message) from None
            assert principal is not None
            return principal, token
        # Not checked here: passed through to the session service, which decides. Connections
        # are still bounded per credential.
        if token is None:
            return "anonymous", ""
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16], token

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, _query = request.path.partition("?")
        if path in ("/healthz", "/livez"):
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            if self.draining:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "draining\n")
            return connection.respond(HTTPStatus.OK, "ready\n")
        if path.rstrip("/") not in REALTIME_PATHS:
            metrics.REFUSED.labels(reason="not_found").inc()
            return _refusal(HTTPStatus.NOT_FOUND, "not_found", f"the Realtime API is at {REALTIME_PATHS[0]}")
        if self.draining:
            metrics.REFUSED.labels(reason="draining").inc()
            return _refusal(
                HTTPStatus.SERVICE_UNAVAILABLE, "draining", "this edge is draining; connect again"
            )
        try:
            principal, _ = self.principal(request.headers)
        except PermissionError as exc:
            metrics.REFUSED.labels(reason="unauthenticated").inc()
            return _refusal(HTTPStatus.UNAUTHORIZED, "invalid_api_key", str(exc))
        full = self.slots.full(principal)
        if full is not None:
            metrics.REFUSED.labels(reason="too_many_connections").inc()
            status = HTTPStatus.TOO_MANY_REQUESTS if full == "key" else HTTPStatus.SERVICE_UNAVAILABLE
            return _refusal(status, "too_many_connections", f"connection limit reached ({full})")
        return None

    # ---- connections -------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None
        query = request.path.partition("?")[2]
        try:
            principal, token = self.principal(request.headers)
        except PermissionError:
            await ws.close(1008, "unauthenticated")
            return
        if self.slots.full(principal) is not None:  # taken meanwhile by another handshake
            await ws.close(1013, "too many connections")
            return
        model = parse_qs(query).get("model", [self.config.model])[0]
        self.slots.take(principal)
        self._connections.add(ws)
        metrics.CONNECTIONS.inc()
        metrics.CONNECTIONS_TOTAL.inc()
        source = self.upstream.source(token)
        try:
            await Connection(ws, source, model, self.config.limits).run()
        except Exception:
            log.exception("realtime connection failed")
        finally:
            await source.release()
            self.slots.give(principal)
            self._connections.discard(ws)
            if not self._connections:
                self._all_gone.set()
            metrics.CONNECTIONS.dec()

    # ---- the server --------------------------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext | None:
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None or key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        files = WatchedFiles([cert, key], what="the edge's TLS files")

        async def reload() -> None:
            # A rotated Secret changes the files in place: new handshakes use the new pair.
            while True:
                await asyncio.sleep(TLS_RELOAD_CHECK_S)
                if files.refresh():
                    try:
                        context.load_cert_chain(cert, key)
                        log.info("reloaded the TLS certificate from %s", cert)
                    except (OSError, ssl.SSLError) as exc:
                        log.warning("the TLS files changed but do not load (kept the old pair): %s", exc)

        self._tasks.append(asyncio.create_task(reload(), name="realtime-tls-reload"))
        return context

    async def start(self) -> int:
        self._server = await serve(
            self._handle,
            self.config.listen_host,
            self.config.listen_port,
            process_request=self._process_request,
            max_size=self.config.max_message_bytes,
            ssl=self._ssl(),
            compression=None,
            server_header="duplex-realtime",
            close_timeout=CLOSE_TIMEOUT_S,
            # websockets logs every request at INFO, probes included: warnings only.
            logger=_WS_LOG,
        )
        self.port = next(iter(self._server.sockets)).getsockname()[1]
        return self.port

    async def drain(self) -> None:
        """Refuse new connections, give the open ones ``drain_grace_s`` to end, then close them
        (1001 going away: a Realtime client connects again and starts a new session)."""
        self.draining = True
        if self._connections:
            self._all_gone.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), self.config.drain_grace_s)
        # All at once: a close handshake waits up to close_timeout for a client that does not answer.
        closing = [ws.close(CLOSE_GOING_AWAY, "server draining") for ws in self._connections]
        await asyncio.gather(*closing, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.upstream.close()


__all__ = ["REALTIME_PATHS", "EdgeConfig", "EdgeServer", "Upstream", "bearer_token"]
