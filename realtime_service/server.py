"""The edge's HTTP listener (aiohttp, one port): the Realtime API over WebSocket and WebRTC, the
page to talk in, the probes.

- ``GET /v1/realtime`` (``/realtime``): a WebSocket upgrade, checked before it is accepted: the
  credentials (``Authorization: Bearer``, checked here as the session service checks them when the
  edge is given the same token file or JWKS, and passed through to it in every case) and the
  connection bounds (in all, and per principal) (``realtime_service.websocket``).
- ``POST /v1/realtime/calls``, ``/calls/{id}/hangup`` and ``/client_secrets``: WebRTC
  (``realtime_service.calls_api``), with CORS for the origins ``--cors-origin`` allows.
- ``GET /``: the page to talk in (``realtime_service/page/``); ``/healthz``, ``/readyz``: probes.

A refusal is a plain HTTP answer (400, 401, 403, 404, 429, 503) with an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from duplex.errors import DuplexError
from duplex.files import WatchedFiles
from duplex.serving import Slots
from duplex.tls import ClientTLS
from realtime_service import calls_api, cors, metrics, page, websocket
from realtime_service.bearer import bearer_token
from realtime_service.client_secrets import ClientSecrets, SecretKeys
from realtime_service.connection import CLOSE_GOING_AWAY, ClientSocket, Limits
from realtime_service.responses import HttpError, error_response
from realtime_service.upstream import CredentialSource, Upstream
from session_service.trust.auth import Authenticator

if TYPE_CHECKING:
    from realtime_service.webrtc.calls import Calls, CallSettings

log = logging.getLogger("duplex.realtime")

#: How often the TLS files are checked for a rotation.
TLS_RELOAD_CHECK_S = 30.0

#: The paths the API is served at (``base_url`` + ``/realtime``, as the SDKs build it).
REALTIME_PATHS = ("/v1/realtime", "/realtime")

#: Longest request header line (a client secret that carries a session config is a few KB).
MAX_HEADER_BYTES = 32 * 1024


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
    cors_origins: tuple[str, ...] = ()
    """Origins (``https://app.example.com``) whose pages may call ``/calls`` and
    ``/client_secrets`` besides the edge's own page."""
    calls: CallSettings | None = None
    """WebRTC (None: the defaults of ``CallSettings``)."""
    client_secret_keys: SecretKeys | None = None
    """Keys that seal client secrets (None: a random key of this process)."""


class EdgeServer:
    def __init__(self, config: EdgeConfig, auth: Authenticator) -> None:
        self.config = config
        self.auth = auth
        self.upstream = Upstream(config.session_target, config.session_tls)
        self.slots = Slots(config.max_connections_per_principal, config.max_connections)
        self.secrets = ClientSecrets(config.client_secret_keys or SecretKeys.ephemeral())
        self.calls: Calls | None = None
        """The WebRTC calls (None where aiortc is not installed)."""
        self.draining = False
        self._runner: web.AppRunner | None = None
        self._clients: set[ClientSocket] = set()
        self._all_gone = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0

    # ---- admission ---------------------------------------------------------------------------

    def principal(self, request: web.Request) -> tuple[str, str]:
        """(principal, token) of a request's real credential; raises PermissionError with what
        is wrong (a client secret is not one: see ``calls_api``)."""
        try:
            token = bearer_token(request.headers.getall("Authorization", []))
        except ValueError as exc:
            raise PermissionError(str(exc)) from None
        if token is not None and self.secrets.looks_like(token):
            raise PermissionError("a client secret is accepted on /v1/realtime/calls only")
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

    def authenticated(self, request: web.Request) -> tuple[str, str]:
        """``principal`` as an ``HttpError`` (401) when refused."""
        try:
            return self.principal(request)
        except PermissionError as exc:
            raise HttpError(
                HTTPStatus.UNAUTHORIZED, "invalid_api_key", str(exc), reason="unauthenticated"
            ) from None

    def check_open(self) -> None:
        if self.draining:
            raise HttpError(
                HTTPStatus.SERVICE_UNAVAILABLE, "draining", "this edge is draining; connect again"
            )

    def admit_connection(self, request: web.Request) -> tuple[str, str]:
        """(principal, token) of a WebSocket upgrade the edge takes; raises ``HttpError``."""
        self.check_open()
        principal, token = self.authenticated(request)
        full = self.slots.full(principal)
        if full is not None:
            status = HTTPStatus.TOO_MANY_REQUESTS if full == "key" else HTTPStatus.SERVICE_UNAVAILABLE
            raise HttpError(
                status,
                "too_many_connections",
                f"connection limit reached ({full})",
                reason="too_many_connections",
            )
        return principal, token

    def source(self, token: str) -> CredentialSource:
        return self.upstream.source(token)

    # ---- connections held --------------------------------------------------------------------

    def hold(self, client: ClientSocket) -> None:
        self._clients.add(client)

    def let_go(self, client: ClientSocket) -> None:
        self._clients.discard(client)
        if not self._clients and not (self.calls and self.calls.active):
            self._all_gone.set()

    def let_go_all_calls(self) -> None:
        """The last call has ended."""
        if not self._clients:
            self._all_gone.set()

    def _anything_held(self) -> bool:
        return bool(self._clients) or bool(self.calls and self.calls.active)

    # ---- the listener ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            # CORS outermost: errors (answered by _errors) carry its headers too.
            middlewares=[cors.middleware(self.config.cors_origins), self._errors],
            client_max_size=calls_api.MAX_BODY_BYTES,
            handler_args={"max_field_size": MAX_HEADER_BYTES, "max_line_size": MAX_HEADER_BYTES},
        )
        app.on_response_prepare.append(_server_header)
        ws = self._bind(websocket.handle)
        for path in REALTIME_PATHS:
            for variant in (path, path + "/"):
                app.router.add_get(variant, ws, allow_head=False)
            calls_api.add_routes(app, self, path)
        app.router.add_get("/", page.index)
        app.router.add_get("/talk.js", page.script)
        for path in ("/healthz", "/livez"):
            app.router.add_get(path, _ok)
        app.router.add_get("/readyz", self._ready)
        return app

    def _bind(
        self, handler: Callable[[EdgeServer, web.Request], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def bound(request: web.Request) -> web.StreamResponse:
            return await handler(self, request)

        return bound

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            metrics.REFUSED.labels(reason="not_found").inc()
            return error_response(
                HTTPStatus.NOT_FOUND, "not_found", f"the Realtime API is at {REALTIME_PATHS[0]}"
            )
        except web.HTTPMethodNotAllowed as exc:
            return error_response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method_not_allowed",
                f"{request.method} is not served at {request.path}",
                headers={"Allow": ", ".join(sorted(exc.allowed_methods))},
            )
        except HttpError as err:
            return err.response()

    async def _ready(self, _request: web.Request) -> web.Response:
        if self.draining:
            return web.Response(status=503, text="draining\n")
        return web.Response(text="ready\n")

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
        self.calls = calls_api.make_calls(self)
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.listen_host, self.config.listen_port, ssl_context=self._ssl()
        )
        await site.start()
        address: Any = self._runner.addresses[0]
        self.port = int(address[1])
        return self.port

    async def drain(self) -> None:
        """Refuse new connections and calls, give the open ones ``drain_grace_s`` to end, then close
        them (a WebSocket with 1001 going away: a Realtime client connects again and starts a new
        session; a call is hung up)."""
        self.draining = True
        if self._anything_held():
            self._all_gone.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), self.config.drain_grace_s)
        # All at once: a close handshake waits for a client that does not answer.
        closing = [c.close(CLOSE_GOING_AWAY, "server draining") for c in self._clients]
        await asyncio.gather(*closing, return_exceptions=True)
        if self.calls is not None:
            await self.calls.close_all("draining")
        for task in self._tasks:
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.upstream.close()


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _server_header(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "duplex-realtime"


__all__ = ["REALTIME_PATHS", "EdgeConfig", "EdgeServer", "Upstream", "bearer_token"]
