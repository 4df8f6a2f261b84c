"""The bearer token of a request (``Authorization: Bearer <token>``): what the SDKs send as the API
key, on every route of the edge."""

from __future__ import annotations


def bearer_token(values: list[str]) -> str | None:
    """The token of the request's one ``Authorization: Bearer`` header (``values``: every
    Authorization header; None without one); raises ValueError for a malformed or repeated one."""
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("more than one Authorization header")
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ValueError("expected 'Authorization: Bearer <token>'")
    return token.strip()
