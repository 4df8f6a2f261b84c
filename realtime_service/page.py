"""``GET /``: the edge's page to talk in (``realtime_service/page/``: ``index.html`` and
``talk.js``), a small WebRTC client written to OpenAI's WebRTC flow."""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

#: The page loads its script from the edge itself and talks to the edge only.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; "
    "media-src 'self' blob: mediastream:; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)


@cache
def _asset(name: str) -> str:
    return (resources.files("realtime_service") / "page" / name).read_text(encoding="utf-8")


def _headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": _CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }


async def index(_request: web.Request) -> web.Response:
    return web.Response(text=_asset("index.html"), content_type="text/html", headers=_headers())


async def script(_request: web.Request) -> web.Response:
    return web.Response(text=_asset("talk.js"), content_type="text/javascript", headers=_headers())
