"""The edge's plain HTTP answers: errors in OpenAI's shape (``{"error": {"type", "code",
"message", "param"}}``), on every route (a refused WebSocket upgrade, a refused call, a bad client
secret request)."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web


class HttpError(Exception):
    """A request the edge refuses: answered with ``status`` and an OpenAI-shaped JSON error."""

    def __init__(
        self,
        status: HTTPStatus,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type
        self.reason = reason or code
        """The label it is counted under."""

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(
            self.status, self.code, self.message, param=self.param, type=self.type, headers=headers
        )


def error_response(
    status: HTTPStatus,
    code: str,
    message: str,
    *,
    param: str | None = None,
    type: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> web.Response:
    body: dict[str, Any] = {"error": {"type": type, "code": code, "message": message, "param": param}}
    return web.Response(
        status=status.value, text=json.dumps(body), content_type="application/json", headers=headers
    )


def json_response(body: dict[str, Any], status: HTTPStatus = HTTPStatus.OK) -> web.Response:
    return web.Response(status=status.value, text=json.dumps(body), content_type="application/json")
