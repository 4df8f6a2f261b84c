"""The edge's WebSocket route, ``/v1/realtime``: an aiohttp WebSocket held as a ``Connection``.

The upgrade is checked before it is accepted (``EdgeServer.admit``: credentials, bounds); a refusal
is a plain HTTP answer with an OpenAI-shaped JSON error. ``WebSocketClient`` is the
``connection.ClientSocket`` of an aiohttp ``WebSocketResponse``: text and binary frames in, text
out, a frame over ``--max-message-bytes`` closed with 1009 by aiohttp itself.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from realtime_service import metrics
from realtime_service.connection import ClientGone, Connection
from realtime_service.protocol import Command
from realtime_service.responses import HttpError, error_response

if TYPE_CHECKING:
    from realtime_service.server import EdgeServer

log = logging.getLogger("duplex.realtime")

#: How long a close handshake waits for the client's answer.
CLOSE_TIMEOUT_S = 5.0

#: Pings every this many seconds; a client that does not answer within half of it is dropped.
HEARTBEAT_S = 20.0


class WebSocketClient:
    """``ClientSocket`` of an aiohttp WebSocket."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request) -> None:
        self._ws = ws
        self._request = request

    async def recv(self) -> str | bytes | Command:
        msg = await self._ws.receive()
        if msg.type == WSMsgType.TEXT:
            return str(msg.data)
        if msg.type == WSMsgType.BINARY:
            return bytes(msg.data)
        # CLOSE, CLOSING, CLOSED, ERROR (a frame too big: aiohttp has closed with 1009).
        raise ClientGone()

    async def send(self, text: str) -> None:
        if self._ws.closed:
            raise ClientGone()
        try:
            await self._ws.send_str(text)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc

    async def close(self, code: int, reason: str) -> None:
        try:
            await self._ws.close(code=code, message=reason.encode()[:120])
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # aiohttp's writers share one drain future: the writer task, cancelled while a client
            # that does not read held it, cancelled it for this close too. Nothing can be sent.
            self.abort()

    def abort(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()


async def handle(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    """``GET /v1/realtime`` (an upgrade): the Realtime API over this WebSocket."""
    try:
        principal, token = server.admit_connection(request)
    except HttpError as err:
        metrics.REFUSED.labels(reason=err.reason).inc()
        return err.response()
    ws = web.WebSocketResponse(
        timeout=CLOSE_TIMEOUT_S,
        heartbeat=HEARTBEAT_S,
        compress=False,
        max_msg_size=server.config.max_message_bytes,
    )
    if not ws.can_prepare(request).ok:
        return error_response(
            HTTPStatus.UPGRADE_REQUIRED, "upgrade_required", "the Realtime API here is a WebSocket"
        )
    model = request.query.get("model", server.config.model)
    server.slots.take(principal)
    metrics.CONNECTIONS.inc()
    metrics.CONNECTIONS_TOTAL.inc()
    source = server.upstream.source(token)
    client = WebSocketClient(ws, request)
    server.hold(client)
    try:
        await ws.prepare(request)
        await Connection(client, source, model, server.config.limits).run()
    except Exception:
        log.exception("realtime connection failed")
    finally:
        await source.release()
        server.slots.give(principal)
        server.let_go(client)
        metrics.CONNECTIONS.dec()
    return ws
