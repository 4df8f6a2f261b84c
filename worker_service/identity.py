"""Who a caller is and what it may do: owner keys, who may own sessions, who may take them over.

With mutual TLS an owner is ``IDENTITY/owner`` (``owner_key``): the verified certificate's
identity with the caller's own owner id scoped under it, for Attach, Run and every command, so
no identity can hold, replace or fence another's owner. A CA signs many services, so only the
listed identities may own sessions (``WorkerConfig.owner_identities``) or take them over
(``WorkerConfig.takeover_allowed``). Without mutual TLS there are no identities: the owner key is
the owner string and anyone may take over (local development).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from duplex.errors import (
    BadRequestError,
    ErrorCode,
    PermissionDeniedError,
    UnauthenticatedError,
)
from worker_service.config import WorkerConfig
from worker_service.metrics import FENCED

logger = logging.getLogger(__name__)

#: Separates a certificate identity from the owner id scoped under it (``IDENTITY/owner``).
OWNER_SEPARATOR = "/"

#: Most refused identities logged by name (each once); the rest are only counted.
MAX_REFUSED_IDENTITIES_LOGGED = 64


def owner_key(identity: str | None, owner: str) -> str:
    """The key an owner is known by: ``IDENTITY/owner`` with a certificate identity, else the
    owner id itself (plaintext). The owner id may not contain the separator, so a key names
    exactly one (identity, owner) pair even when identities contain it (URIs)."""
    if identity is None:
        return owner
    if OWNER_SEPARATOR in owner:
        raise BadRequestError(ErrorCode.INVALID_EVENT, f"an owner id may not contain {OWNER_SEPARATOR!r}")
    return f"{identity}{OWNER_SEPARATOR}{owner}"


class IdentityPolicy:
    """The allowed-identity rules of one worker (see docs/worker-protocol.md, Identity and fencing)."""

    def __init__(self, config: WorkerConfig, *, authorize: bool) -> None:
        """``authorize``: callers are certificate identities (mutual TLS; the fence table's mode)."""
        self._config = config
        self._authorize = authorize
        self._refused: set[str] = set()

    @property
    def authorizes(self) -> bool:
        return self._authorize

    def owner(self, owner: str, identify: Callable[[], str | None]) -> tuple[str, str | None]:
        """The caller's owner key and certificate identity (None without mutual TLS).

        ``identify`` reads the caller's certificate identity; asked only with mutual TLS."""
        if not self._authorize:
            return owner, None
        identity = identify()
        if identity is None:  # mutual TLS verified a certificate that names nobody
            raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, "the client certificate names no identity")
        allowed = self._config.owner_identities
        if allowed is not None and identity not in allowed:
            # A CA signs many services: only the session tier's identities create, own, release
            # or take over sessions. Anyone else could otherwise tombstone, fence at the highest
            # epoch or squat sessions a failover will need.
            FENCED.labels(reason="identity_not_allowed").inc()
            self._log_refused(identity)
            raise PermissionDeniedError(
                ErrorCode.IDENTITY_NOT_ALLOWED, "this identity may not own sessions on this worker"
            )
        return owner_key(identity, owner), identity

    def may_take_over(self, identity: str | None) -> bool:
        """Whether ``identity`` may take a session from another owner (consulted by the fence
        table only when it authorizes)."""
        allowed = self._config.takeover_allowed
        return identity is None or allowed is None or identity in allowed

    def _log_refused(self, identity: str) -> None:
        # Once per identity, and only so many: a refused caller that retries cannot flood the log.
        refused = self._refused
        if identity not in refused and len(refused) < MAX_REFUSED_IDENTITIES_LOGGED:
            refused.add(identity)
            logger.warning("identity %r may not own sessions here: refused (logged once)", identity)
