"""The HTTP side of WebRTC, in OpenAI's GA shape (thin adapters; the calls are
``realtime_service.webrtc.calls``):

- ``POST /v1/realtime/calls``: the browser's SDP offer in (``application/sdp``, or a
  ``multipart/form-data`` form with ``sdp`` and ``session``), ``Authorization: Bearer`` a real
  credential or a client secret; 201 with the SDP answer and ``Location:
  /v1/realtime/calls/{call_id}``.
- ``POST /v1/realtime/calls/{call_id}/hangup``: end a call (its principal's real credential).
- ``POST /v1/realtime/client_secrets``: a short-lived secret for one page (``{"expires_after":
  {"anchor": "created_at", "seconds": N}, "session": {...}}`` -> ``{"value", "expires_at",
  "session"}``).

Refusals are OpenAI-shaped JSON errors: 400 (not SDP, no audio, a bad session config), 401
(credentials, an expired or used secret), 403 (an origin CORS does not allow), 429/503 (bounds),
501 (no WebRTC in this install).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from realtime_service import metrics
from realtime_service.bearer import bearer_token
from realtime_service.client_secrets import DEFAULT_TTL_S, MAX_TTL_S, MIN_TTL_S, Grant, SecretRefused
from realtime_service.conversation import Conversation, Settings
from realtime_service.protocol import DEFAULT_TURN, PCM24K, RealtimeError, UpdateSession, parse_client_event
from realtime_service.responses import HttpError, json_response

if TYPE_CHECKING:
    from realtime_service.server import EdgeServer
    from realtime_service.webrtc.calls import Calls

log = logging.getLogger("duplex.realtime")

#: Largest request body (an SDP offer with a session config; a client secret request).
MAX_BODY_BYTES: Final = 256 * 1024

Handler = Callable[["EdgeServer", web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, server: EdgeServer, base: str) -> None:
    def bound(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def route(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(server, request)
            except HttpError as err:
                if handler is handle_call:
                    metrics.CALLS_REFUSED.labels(reason=err.reason).inc()
                raise

        return route

    app.router.add_post(base + "/calls", bound(handle_call))
    app.router.add_post(base + "/calls/{call_id}/hangup", bound(handle_hangup))
    app.router.add_post(base + "/client_secrets", bound(handle_client_secret))


def make_calls(server: EdgeServer) -> Calls | None:
    """The edge's calls, or None where aiortc (the ``webrtc`` extra) is not installed."""
    try:
        from realtime_service.webrtc.calls import Calls, CallSettings
    except ImportError as exc:
        log.warning("WebRTC is off: %s (pip install 'duplex-serving[webrtc]')", exc)
        return None
    calls = Calls(server.config.calls or CallSettings(), server.config.limits)
    calls.on_idle = lambda: server.let_go_all_calls()
    return calls


# ---- session configs ---------------------------------------------------------------------------


def _bad(code: str, message: str, param: str | None = None) -> HttpError:
    return HttpError(HTTPStatus.BAD_REQUEST, code, message, param=param)


def session_config(session: dict[str, Any]) -> tuple[str, UpdateSession]:
    """A session config as OpenAI takes it (the ``session`` of ``session.update``, with
    ``model``): (model, its settings); raises ``HttpError`` 400."""
    model = session.get("model", "")
    if not isinstance(model, str):
        raise _bad("invalid_type", "'session.model' must be a string", "session.model")
    try:
        command = parse_client_event(json.dumps({"type": "session.update", "session": session}), PCM24K)
    except RealtimeError as err:
        raise HttpError(HTTPStatus.BAD_REQUEST, err.code, err.message, param=err.param) from None
    assert isinstance(command, UpdateSession)
    if command.problems:  # a session.update applies what it can; a config given up front is whole
        first = command.problems[0]
        raise HttpError(HTTPStatus.BAD_REQUEST, first.code, first.message, param=first.param)
    return model, command


def settings_of(update: UpdateSession | None) -> Settings:
    """A call's settings at open: the API's defaults, then what its session config sets."""
    settings = Settings(input_format=PCM24K, output_format=PCM24K, turn=DEFAULT_TURN)
    if update is not None:
        if update.turn is not None:
            settings.turn = update.turn
        if update.instructions is not None:
            settings.instructions = update.instructions
        if update.output_modalities is not None:
            settings.output_modalities = update.output_modalities
    return settings


# ---- /calls ------------------------------------------------------------------------------------


def _credential(server: EdgeServer, request: web.Request) -> tuple[str, str, Grant | None, str]:
    """(principal, the real token, the client secret's grant and the secret, or None and "") of a
    call request; raises ``HttpError``."""
    try:
        token = bearer_token(request.headers.getall("Authorization", [])) or ""
    except ValueError as exc:
        raise HttpError(
            HTTPStatus.UNAUTHORIZED, "invalid_api_key", str(exc), reason="unauthenticated"
        ) from None
    if server.secrets.looks_like(token):
        try:
            grant = server.secrets.check(token)
        except SecretRefused as err:
            metrics.CLIENT_SECRETS.labels(outcome=f"refused_{err.code}").inc()
            raise HttpError(
                HTTPStatus.UNAUTHORIZED, "invalid_api_key", err.message, reason=err.code
            ) from None
        return grant.principal, grant.token, grant, token
    principal, real = server.authenticated(request)
    return principal, real, None, ""


async def _read_offer(request: web.Request) -> Any:
    from realtime_service.webrtc.offer import FORM_TYPES, OfferError, parse_offer

    content_type = request.content_type
    try:
        if content_type in FORM_TYPES:
            form = await request.post()
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            return parse_offer(content_type, None, fields)
        return parse_offer(content_type, await request.read(), None)
    except OfferError as err:
        raise HttpError(HTTPStatus.BAD_REQUEST, err.code, err.message, param=err.param) from None
    except web.HTTPRequestEntityTooLarge:
        raise _bad("request_too_large", f"the body is over {MAX_BODY_BYTES} bytes") from None


async def handle_call(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    server.check_open()
    principal, token, grant, secret = _credential(server, request)
    calls = server.calls
    if calls is None:
        raise HttpError(
            HTTPStatus.NOT_IMPLEMENTED,
            "webrtc_unavailable",
            "WebRTC is not installed on this edge (the duplex-serving[webrtc] extra)",
            type="server_error",
        )
    calls.check_room(principal)
    offer = await _read_offer(request)
    config = grant.session if grant is not None else None
    if offer.session is not None:
        if config is not None:
            raise _bad(
                "session_config_fixed", "this client secret fixes the session config: send none", "session"
            )
        config = offer.session
    model, update = session_config(config) if config is not None else ("", None)
    model = (
        model or (grant.model if grant is not None else "") or request.query.get("model", server.config.model)
    )
    if grant is not None:
        # Checked again: another request may have used it while this one read its body.
        try:
            grant = server.secrets.check(secret)
        except SecretRefused as err:
            raise HttpError(
                HTTPStatus.UNAUTHORIZED, "invalid_api_key", err.message, reason=err.code
            ) from None
        server.secrets.use(grant)
    try:
        call_id, answer = await calls.create(
            principal, server.source(token), model, settings_of(update), offer
        )
    except BaseException:
        if grant is not None:
            server.secrets.give_back(grant)
        raise
    if grant is not None:
        metrics.CLIENT_SECRETS.labels(outcome="used").inc()
    return web.Response(
        status=HTTPStatus.CREATED,
        text=answer,
        content_type="application/sdp",
        headers={"Location": f"/v1/realtime/calls/{call_id}"},
    )


async def handle_hangup(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    principal, _ = server.authenticated(request)
    call_id = request.match_info["call_id"]
    if server.calls is None or not await server.calls.hangup(call_id, principal):
        raise HttpError(
            HTTPStatus.NOT_FOUND, "call_not_found", "no call of yours with that id", param="call_id"
        )
    return json_response({})


# ---- /client_secrets ---------------------------------------------------------------------------


async def handle_client_secret(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    principal, token = server.authenticated(request)
    raw = await request.read()
    body: Any = {}
    if raw.strip():
        try:
            body = json.loads(raw)
        except ValueError:
            raise _bad("invalid_json", "the body is not JSON") from None
    if not isinstance(body, dict):
        raise _bad("invalid_type", "the body must be a JSON object")
    for key in body:
        if key not in ("expires_after", "session"):
            raise _bad("unknown_parameter", f"unknown parameter '{key}'", key)
    ttl = _ttl(body.get("expires_after"))
    session = body.get("session")
    model, update = "", None
    if session is not None:
        if not isinstance(session, dict):
            raise _bad("invalid_type", "'session' must be an object", "session")
        model, update = session_config(session)
    model = model or server.config.model
    value, expires_at = server.secrets.mint(principal, token, model, session, ttl)
    metrics.CLIENT_SECRETS.labels(outcome="minted").inc()
    conversation = Conversation(model, settings_of(update))
    return json_response({"value": value, "expires_at": expires_at, "session": conversation.session_object()})


def _ttl(value: object) -> int:
    if value is None:
        return DEFAULT_TTL_S
    if not isinstance(value, dict):
        raise _bad("invalid_type", "'expires_after' must be an object", "expires_after")
    for key in value:
        if key not in ("anchor", "seconds"):
            raise _bad(
                "unknown_parameter", f"unknown parameter 'expires_after.{key}'", f"expires_after.{key}"
            )
    if value.get("anchor", "created_at") != "created_at":
        raise _bad("invalid_value", "'expires_after.anchor' must be created_at", "expires_after.anchor")
    seconds = value.get("seconds", DEFAULT_TTL_S)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise _bad(
            "invalid_value",
            f"'expires_after.seconds' must be an integer within {MIN_TTL_S}..{MAX_TTL_S}",
            "expires_after.seconds",
        )
    return seconds
