"""Client secrets (``POST /v1/realtime/client_secrets``): short-lived credentials a backend mints
for one page, so that no real credential reaches a browser. No I/O.

A secret is sealed, not stored: ``ek_`` + the key id + an AES-GCM box of what it grants (the
principal it acts for, the real credential the edge passes on to the session service, the model,
an optional session config, its expiry and a random id). Any edge replica holding the same keys
(``--client-secret-keys``) accepts it; without that file each process makes up its own key and
accepts only its own secrets. A secret is accepted on ``/v1/realtime/calls`` only, until it
expires or is used: each replica remembers the secrets it has accepted until they expire (with
several replicas, keep expiries short: a secret could be used once per replica).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PREFIX: Final = "ek_"

#: ``expires_after.seconds``: bounds and default (OpenAI's default is 600 s).
MIN_TTL_S: Final = 1
MAX_TTL_S: Final = 7200
DEFAULT_TTL_S: Final = 600

#: Shortest key accepted (a guessable key would let anyone mint secrets).
MIN_KEY_BYTES: Final = 32

#: Secrets remembered as used, at most (the oldest to expire go first past it).
MAX_REMEMBERED: Final = 200_000

_CONTEXT: Final = b"duplex.realtime.client_secret.v1."
_NONCE_BYTES: Final = 12
_KID = re.compile(r"[A-Za-z0-9]{1,16}")


class SecretRefused(Exception):
    """A client secret the edge does not take: unreadable, expired or already used."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SecretKeys:
    """The keys of client secrets: the first seals new ones, every one opens."""

    def __init__(self, keys: dict[str, bytes]) -> None:
        if not keys:
            raise ValueError("at least one client secret key is needed")
        for kid, secret in keys.items():
            if not _KID.fullmatch(kid):
                raise ValueError(f"client secret key id {kid!r}: use 1-16 of A-Z a-z 0-9")
            if len(secret) < MIN_KEY_BYTES:
                raise ValueError(
                    f"client secret key {kid!r} is {len(secret)} bytes; at least {MIN_KEY_BYTES}"
                )
        self.sealing = next(iter(keys))
        self._aead = {kid: AESGCM(_derive(kid, secret)) for kid, secret in keys.items()}

    @classmethod
    def ephemeral(cls) -> SecretKeys:
        return cls({"local": secrets.token_bytes(32)})

    @classmethod
    def from_file(cls, path: Path) -> SecretKeys:
        """``KID:SECRET`` lines (the first seals; rotate by adding a new first line), ``#``
        comments; raises ValueError (OSError when unreadable)."""
        keys: dict[str, bytes] = {}
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            kid, sep, secret = line.partition(":")
            if not sep:
                raise ValueError(f"{path}: client secret keys are KID:SECRET lines")
            if kid in keys:
                raise ValueError(f"{path}: key id {kid!r} is listed twice")
            keys[kid] = secret.strip().encode()
        return cls(keys)

    def seal(self, plaintext: bytes) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        box = nonce + self._aead[self.sealing].encrypt(nonce, plaintext, _CONTEXT + self.sealing.encode())
        return f"{PREFIX}{self.sealing}_{_b64(box)}"

    def open(self, value: str) -> bytes:
        """The plaintext of a secret; raises ValueError for one these keys did not seal."""
        kid, _, text = value.removeprefix(PREFIX).partition("_")
        aead = self._aead.get(kid)
        if not value.startswith(PREFIX) or aead is None or not text:
            raise ValueError("not a client secret of this edge")
        try:
            box = _unb64(text)
            if len(box) <= _NONCE_BYTES:
                raise ValueError("short")
            return aead.decrypt(box[:_NONCE_BYTES], box[_NONCE_BYTES:], _CONTEXT + kid.encode())
        except (InvalidTag, ValueError, binascii.Error) as exc:
            raise ValueError("not a client secret of this edge") from exc


@dataclass(frozen=True)
class Grant:
    """What a client secret lets a page do."""

    secret_id: str
    principal: str
    token: str
    """The real credential, passed on to the session service."""
    model: str
    session: dict[str, Any] | None
    """The session config it fixes (None: the page's own, or the defaults)."""
    expires_at: int


class ClientSecrets:
    def __init__(self, keys: SecretKeys, clock: Callable[[], float] = time.time) -> None:
        self.keys = keys
        self.clock = clock
        self._used: dict[str, int] = {}
        """Secret id -> its expiry, of the secrets accepted here."""

    @staticmethod
    def looks_like(token: str) -> bool:
        return token.startswith(PREFIX)

    def mint(
        self, principal: str, token: str, model: str, session: dict[str, Any] | None, ttl_s: int
    ) -> tuple[str, int]:
        """A new secret and its expiry (Unix seconds)."""
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"expires_after.seconds must be within {MIN_TTL_S}..{MAX_TTL_S}")
        expires_at = int(self.clock()) + ttl_s
        body = {
            "i": secrets.token_urlsafe(12),
            "p": principal,
            "t": token,
            "m": model,
            "s": session,
            "e": expires_at,
        }
        return self.keys.seal(json.dumps(body, separators=(",", ":")).encode()), expires_at

    def check(self, value: str) -> Grant:
        """What ``value`` grants, if it is a secret of this edge, not expired and not used here;
        raises ``SecretRefused``."""
        try:
            body = json.loads(self.keys.open(value))
            grant = Grant(
                secret_id=str(body["i"]),
                principal=str(body["p"]),
                token=str(body["t"]),
                model=str(body["m"]),
                session=body["s"] if isinstance(body["s"], dict) else None,
                expires_at=int(body["e"]),
            )
        except (ValueError, KeyError, TypeError):
            raise SecretRefused("invalid_api_key", "not a client secret of this edge") from None
        if self.clock() >= grant.expires_at:
            raise SecretRefused("expired_client_secret", "the client secret has expired")
        if grant.secret_id in self._used:
            raise SecretRefused("used_client_secret", "the client secret was used already")
        return grant

    def use(self, grant: Grant) -> None:
        """Take ``grant`` (``check`` it first, with no await between): it is refused from now on."""
        self._forget_expired()
        self._used[grant.secret_id] = grant.expires_at

    def give_back(self, grant: Grant) -> None:
        """A call that did not start: its secret may be used again (until it expires)."""
        self._used.pop(grant.secret_id, None)

    def _forget_expired(self) -> None:
        if len(self._used) < MAX_REMEMBERED // 2:
            return
        now = self.clock()
        self._used = {k: e for k, e in self._used.items() if e > now}
        while len(self._used) >= MAX_REMEMBERED:  # only unexpired ones: the soonest to expire go
            del self._used[min(self._used, key=self._used.__getitem__)]


def _derive(kid: str, secret: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_CONTEXT + kid.encode()).derive(secret)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("non-canonical base64")
    return data
