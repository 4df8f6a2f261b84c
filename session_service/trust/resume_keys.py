"""The keys of resume tokens (``ResumeKeys``: rotation, the deployment's secrets, sealing and
opening a token's box) and the one error a token that does not open raises. What a token
carries is ``session_service.trust.resume_tokens``."""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import secrets
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from duplex.errors import BadRequestError, ErrorCode, UnauthenticatedError

log = logging.getLogger(__name__)

VERSION = "v2"
"""The token layout this module issues (and the only one it accepts)."""

MIN_SECRET_BYTES = 32
"""Shortest resume secret accepted (a guessable key would let anyone mint tokens)."""

_CONTEXT = b"duplex.resume.v2."
_NONCE_BYTES = 12
_KID = re.compile(r"[A-Za-z0-9_-]{1,32}")


class ResumeKeys:
    """The keys of resume tokens: the first encrypts new tokens, every one decrypts.

    ``shared`` says whether they came from the deployment (replicas that share them resume
    each other's sessions) or were made up by this process (tokens work on this replica only).
    """

    def __init__(self, keys: Mapping[str, bytes], *, shared: bool = True) -> None:
        if not keys:
            raise BadRequestError(ErrorCode.INVALID_CONFIG, "at least one resume key is needed")
        for kid, secret in keys.items():
            if not _KID.fullmatch(kid):
                raise BadRequestError(
                    ErrorCode.INVALID_CONFIG, f"resume key id {kid!r}: use 1-32 of A-Z a-z 0-9 _ -"
                )
            if len(secret) < MIN_SECRET_BYTES:
                raise BadRequestError(
                    ErrorCode.INVALID_CONFIG,
                    f"resume secret {kid!r} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed",
                )
        self.shared = shared
        self.signing_kid = next(iter(keys))
        self._aead = {kid: AESGCM(_derive(kid, secret)) for kid, secret in keys.items()}

    @classmethod
    def parse(cls, value: str) -> ResumeKeys:
        """``KID:SECRET[,KID:SECRET...]`` (``DUPLEX_RESUME_SECRETS``); the first one signs."""
        keys: dict[str, bytes] = {}
        for item in value.replace("\n", ",").split(","):
            item = item.strip()
            if not item:
                continue
            kid, sep, secret = item.partition(":")
            if not sep:
                raise BadRequestError(
                    ErrorCode.INVALID_CONFIG, "resume secrets are KID:SECRET pairs separated by commas"
                )
            if kid in keys:
                raise BadRequestError(ErrorCode.INVALID_CONFIG, f"resume key id {kid!r} is listed twice")
            keys[kid] = secret.encode()
        return cls(keys)

    @classmethod
    def single(cls, secret: bytes, kid: str = "k1") -> ResumeKeys:
        return cls({kid: secret})

    @classmethod
    def ephemeral(cls) -> ResumeKeys:
        """A random key of this process alone: its tokens resume only on this replica."""
        return cls({"local": secrets.token_bytes(32)}, shared=False)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ResumeKeys:
        """``DUPLEX_RESUME_SECRETS`` (rotation), else ``DUPLEX_RESUME_SECRET`` (one key), else
        an ephemeral key with a warning."""
        if environ.get("DUPLEX_RESUME_SECRETS"):
            return cls.parse(environ["DUPLEX_RESUME_SECRETS"])
        if environ.get("DUPLEX_RESUME_SECRET"):
            return cls.single(environ["DUPLEX_RESUME_SECRET"].encode(), kid="default")
        log.warning(
            "no DUPLEX_RESUME_SECRETS: resume tokens work on this replica only "
            "(set the same secrets on every replica to resume sessions across them)"
        )
        return cls.ephemeral()

    def seal(self, plaintext: bytes) -> str:
        kid = self.signing_kid
        nonce = os.urandom(_NONCE_BYTES)
        box = nonce + self._aead[kid].encrypt(nonce, plaintext, _CONTEXT + kid.encode())
        return f"{VERSION}.{kid}.{_b64(box)}"

    def open(self, token: str) -> bytes:
        """The plaintext of ``token``; raises ``InvalidResumeTokenError``."""
        version, _, rest = token.partition(".")
        kid, _, box_text = rest.partition(".")
        aead = self._aead.get(kid)
        if version != VERSION or aead is None or not box_text:
            raise InvalidResumeTokenError()
        try:
            box = _unb64(box_text)
            if len(box) <= _NONCE_BYTES:
                raise ValueError("short token")
            return aead.decrypt(box[:_NONCE_BYTES], box[_NONCE_BYTES:], _CONTEXT + kid.encode())
        except (InvalidTag, ValueError, binascii.Error) as exc:
            raise InvalidResumeTokenError() from exc


def _derive(kid: str, secret: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_CONTEXT + kid.encode()).derive(secret)


class InvalidResumeTokenError(UnauthenticatedError):
    """The token is not one this deployment issued for this session, or no longer valid."""

    def __init__(self, message: str = "invalid resume token") -> None:
        super().__init__(ErrorCode.INVALID_RESUME_TOKEN, message)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    # Strict: only the URL-safe alphabet, canonical (re-encoding gives the same text).
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("non-canonical base64")
    return data
