"""Who a call is from: the principal every session belongs to.

Without authentication configured (local development on loopback) every caller is
``ANONYMOUS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

#: The principal of every call when no authentication is configured (loopback only).
ANONYMOUS = "anonymous"

#: Maps a call to its principal; raises ``UnauthenticatedError`` for a caller it does not know.
PrincipalOf = Callable[[grpc.aio.ServicerContext[Any, Any]], str]


def anonymous(_context: grpc.aio.ServicerContext[Any, Any]) -> str:
    return ANONYMOUS
