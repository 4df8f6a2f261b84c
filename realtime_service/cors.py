"""CORS for the routes a page calls from its own origin (``/v1/realtime/calls``, ``/calls/{id}/
hangup``, ``/client_secrets``): the edge's own page, and the origins ``--cors-origin`` names.

A request without ``Origin`` is not a page's (a backend, curl): CORS does not apply. A page's
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is answered
204 with what it may send; from any other, 403. A page's request from an origin not allowed is
refused (403) before anything is done for it: a browser would hide the answer, but a call would
still have been set up.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from realtime_service import metrics
from realtime_service.responses import error_response

#: How long a browser may cache a preflight's answer.
MAX_AGE_S: Final = 600

_ROUTES: Final = ("/calls", "/client_secrets")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def applies(path: str) -> bool:
    for base in ("/v1/realtime", "/realtime"):
        if any(path == base + r or path.startswith(base + "/calls/") for r in _ROUTES):
            return True
    return False


def normalize(origin: str) -> str:
    """``scheme://host[:port]`` of an origin (lower case), as browsers send it; raises ValueError."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(f"{origin!r} is not an origin (scheme://host[:port])")
    return f"{parts.scheme}://{parts.netloc}".lower()


def _own(request: web.Request, origin: str) -> bool:
    """An origin on the edge's own host and port (its page): whatever the scheme a proxy in
    front of it terminates."""
    return bool(request.host) and urlsplit(origin).netloc.lower() == request.host.lower()


def middleware(origins: tuple[str, ...]) -> Middleware:
    allowed = frozenset(normalize(o) for o in origins)

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None or not applies(request.path):
            return await handler(request)
        if origin.lower() not in allowed and not _own(request, origin):
            metrics.REFUSED.labels(reason="origin_not_allowed").inc()
            return error_response(
                HTTPStatus.FORBIDDEN, "origin_not_allowed", "this origin may not call the Realtime API here"
            )
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            headers |= {
                "Access-Control-Allow-Methods": "POST, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Max-Age": str(MAX_AGE_S),
            }
            return web.Response(status=HTTPStatus.NO_CONTENT, headers=headers)
        response = await handler(request)
        response.headers.update(headers)
        response.headers["Access-Control-Expose-Headers"] = "Location"
        return response

    return cors
