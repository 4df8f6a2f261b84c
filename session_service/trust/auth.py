"""Who a call is from: the principal every session belongs to.

A call proves who it is with one of:

- a bearer token (``authorization: Bearer <token>``) listed in a token file: lines
  ``PRINCIPAL:SHA256_HEX``, the hex SHA-256 of the token, so the file holds no secret
  (``TokenFile``);
- a bearer token that is a JWT signed by a key of a local JWKS file, for this service's
  audience; its ``sub`` is the principal (``JwksVerifier``);
- a client certificate signed by the TLS client CA (checked by the TLS handshake); its identity
  (``duplex.tls.peer_identity``) is the principal.

A bearer token, when one is sent and tokens are configured, must be valid and names the
principal, even over mutual TLS; without one, the certificate does. The files are re-read when
they change (checked at most once a second); a file that cannot be read or parsed mid-rotation
keeps the last good contents.

``Authenticator.admit`` is what ``session_service.api.admission.AdmissionInterceptor`` asks before
any handler runs (an unauthenticated call is refused with ``UNAUTHENTICATED`` /
``unauthenticated``; the health service stays open); ``Authenticator.principal_of`` is what the
servicer asks for the principal.

Without authentication configured (local development on loopback) every caller is
``ANONYMOUS``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import grpc
import jwt

from duplex.errors import BadRequestError, ErrorCode, UnauthenticatedError
from duplex.files import WatchedFiles
from duplex.serving import split_host_port
from duplex.tls import check_plaintext_listen, is_loopback, peer_identity

if TYPE_CHECKING:
    from session_service.config import ServiceConfig

log = logging.getLogger(__name__)

#: The principal of every call when no authentication is configured (loopback only).
ANONYMOUS = "anonymous"

#: Maps a call to its principal; raises ``UnauthenticatedError`` for a caller it does not know.
PrincipalOf = Callable[[grpc.aio.ServicerContext[Any, Any]], str]


def anonymous(_context: grpc.aio.ServicerContext[Any, Any]) -> str:
    return ANONYMOUS


#: Methods anyone may call: the standard health service (load balancers and probes carry no
#: credentials).
OPEN_METHOD_PREFIXES: Final = ("/grpc.health.v1.Health/",)

#: How often (seconds) a token or JWKS file is checked for changes, at most.
RELOAD_CHECK_INTERVAL_S: Final = 1.0

#: Clock skew tolerated on a JWT's ``exp``, ``nbf`` and ``iat`` (seconds).
JWT_LEEWAY_S: Final = 30.0

_NO_CREDENTIALS: Final = "no credentials: send 'authorization: Bearer <token>' call metadata"
_BAD_CREDENTIALS: Final = "the credentials are not valid for this service"

_T = TypeVar("_T")


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token: what its line in a token file holds
    (``printf %s "$TOKEN" | sha256sum``)."""
    return hashlib.sha256(token.encode()).hexdigest()


# ---- files that reload ------------------------------------------------------------------------


class ReloadingFile(Generic[_T]):
    """A file's parsed contents, kept current: the file is read again at most every
    ``check_interval_s`` (``duplex.files.WatchedFiles``: its bytes, through symlinks) and parsed
    again when they changed.

    At construction a file that cannot be read or parsed raises ``BadRequestError``
    (``invalid_config``: the service refuses to start). Later, such a file keeps the last good
    contents and logs a warning (once per distinct problem); it is retried at the next check."""

    def __init__(
        self,
        path: Path,
        parse: Callable[[bytes], _T],
        *,
        what: str,
        check_interval_s: float = RELOAD_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._file = WatchedFiles([path], what=what)
        self._parse = parse
        self._interval = check_interval_s
        self._clock = clock
        self._value = parse(self._file.contents[0])
        self._checked = clock()

    def get(self) -> _T:
        now = self._clock()
        if now - self._checked >= self._interval:
            self._checked = now
            self._refresh()
        return self._value

    def _refresh(self) -> None:
        if not self._file.refresh():
            return
        try:
            self._value = self._parse(self._file.contents[0])
        except BadRequestError as exc:
            self._file.warn(exc.message)


#: Longest principal accepted (a JWT ``sub`` is the issuer's to choose): a session's resume
#: token carries it, and every valid session must fit in one.
MAX_PRINCIPAL_BYTES = 1024


def bounded_principal(principal: str) -> str:
    """``principal``, or ``UnauthenticatedError`` when it is too long to carry."""
    if len(principal.encode()) > MAX_PRINCIPAL_BYTES:
        raise UnauthenticatedError(
            ErrorCode.UNAUTHENTICATED, f"the caller's identity is longer than {MAX_PRINCIPAL_BYTES} bytes"
        )
    return principal


# ---- bearer tokens from a file ----------------------------------------------------------------

_HEX_DIGEST: Final = re.compile(r"[0-9a-fA-F]{64}")


def parse_token_file(data: bytes, source: str = "token file") -> tuple[tuple[str, bytes], ...]:
    """``(principal, sha256 digest)`` per ``PRINCIPAL:SHA256_HEX`` line; blank lines and ``#``
    comments are skipped. A malformed line raises ``BadRequestError`` naming its number only
    (never its content: it may hold a pasted token)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{source}: not UTF-8 text") from None
    entries: list[tuple[str, bytes]] = []
    seen: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        principal, sep, digest = line.rpartition(":")
        principal, digest = principal.strip(), digest.strip()
        if not sep or not principal or not _HEX_DIGEST.fullmatch(digest):
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG,
                f"{source}: line {number} is not PRINCIPAL:SHA256_HEX "
                "(the 64 hex digits of the token's SHA-256)",
            )
        value = bytes.fromhex(digest)
        if value in seen:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG,
                f"{source}: line {number} lists the same token as line {seen[value]}",
            )
        seen[value] = number
        entries.append((principal, value))
    return tuple(entries)


class TokenFile:
    """Bearer tokens by their SHA-256, from a file that is re-read when it changes."""

    def __init__(self, path: Path, *, check_interval_s: float = RELOAD_CHECK_INTERVAL_S) -> None:
        self._file = ReloadingFile(
            path,
            lambda data: parse_token_file(data, f"token file {path}"),
            what="token file",
            check_interval_s=check_interval_s,
        )
        if not self._file.get():
            log.warning("token file %s lists no tokens: no bearer token is accepted", path)

    def principal(self, token: str) -> str | None:
        """The principal whose token this is, or None.

        The token's digest is compared with every entry, in constant time each, whether or
        not one matched already: the time taken does not say which entry matched, or how
        much of a digest did."""
        digest = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        for principal, expected in self._file.get():
            if hmac.compare_digest(digest, expected):
                found = principal
        return found


# ---- JWT bearer tokens --------------------------------------------------------------------------

_RSA_ALGORITHMS: Final = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
_EC_ALGORITHMS: Final = {"P-256": "ES256", "P-384": "ES384", "P-521": "ES512"}
#: Every algorithm a JWT may be signed with: asymmetric only (never ``none`` or HS*).
ASYMMETRIC_ALGORITHMS: Final = _RSA_ALGORITHMS | frozenset(_EC_ALGORITHMS.values()) | {"EdDSA"}


@dataclass(frozen=True, slots=True)
class VerificationKey:
    """One public key of a JWKS and the algorithms a token signed by it may name."""

    kid: str
    key: Any  # a cryptography public key object (PyJWT's AllowedPublicKeys)
    algorithms: frozenset[str]


def _key_algorithms(jwk: Mapping[str, Any], where: str) -> frozenset[str]:
    kty, crv = jwk.get("kty"), jwk.get("crv")
    if kty == "RSA":
        algorithms = _RSA_ALGORITHMS
    elif kty == "EC" and crv in _EC_ALGORITHMS:
        algorithms = frozenset({_EC_ALGORITHMS[crv]})
    elif kty == "OKP" and crv == "Ed25519":
        algorithms = frozenset({"EdDSA"})
    else:
        raise BadRequestError(
            ErrorCode.INVALID_CONFIG,
            f"{where}: kty {kty!r}{f' crv {crv!r}' if crv else ''} is not a public signing key "
            "type this service accepts (RSA, EC P-256/384/521, OKP Ed25519)",
        )
    alg = jwk.get("alg")
    if alg is not None:
        if alg not in algorithms:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, f"{where}: alg {alg!r} is not an asymmetric algorithm of its key"
            )
        algorithms = frozenset({alg})
    return algorithms


def parse_jwks(data: bytes, source: str = "JWKS file") -> dict[str, VerificationKey]:
    """The signing keys of a JWKS document by ``kid``. Keys for encryption (``use: enc``) are
    skipped; a symmetric key, a private key, a key without a ``kid`` or a repeated ``kid``
    make the file invalid (``BadRequestError``)."""
    try:
        doc = json.loads(data)
    except ValueError:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{source}: not JSON") from None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list):
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{source}: a JWKS is an object with a 'keys' list")
    out: dict[str, VerificationKey] = {}
    for number, jwk in enumerate(keys, 1):
        where = f"{source}: key {number}"
        if not isinstance(jwk, dict):
            raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{where} is not an object")
        kid = jwk.get("kid")
        if not isinstance(kid, str) or not kid:
            raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{where} has no 'kid'")
        where = f"{where} ({kid!r})"
        if jwk.get("use", "sig") != "sig":
            continue
        if "d" in jwk or "k" in jwk:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, f"{where} holds secret key material; publish public keys only"
            )
        algorithms = _key_algorithms(jwk, where)
        if kid in out:
            raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{where}: the kid is used twice")
        try:
            key = jwt.PyJWK(jwk, algorithm=min(algorithms)).key
        except jwt.PyJWTError:
            # PyJWT's message quotes the whole JWK; the position and kid say enough.
            raise BadRequestError(ErrorCode.INVALID_CONFIG, f"{where} is not a valid public key") from None
        out[kid] = VerificationKey(kid, key, algorithms)
    if not out:
        log.warning("%s holds no signing keys: no JWT is accepted", source)
    return out


class JwksVerifier:
    """Verifies JWT bearer tokens against the keys of a local JWKS file (re-read when it
    changes): signed by the key the header's ``kid`` names, with an asymmetric algorithm that
    key supports, ``aud`` this service's audience, ``exp`` present and not past (``leeway_s``
    of skew), ``sub`` the principal."""

    def __init__(
        self,
        path: Path,
        audience: str,
        *,
        leeway_s: float = JWT_LEEWAY_S,
        check_interval_s: float = RELOAD_CHECK_INTERVAL_S,
    ) -> None:
        if not audience:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, "JWT verification needs an audience (--auth-audience)"
            )
        self.audience = audience
        self._leeway_s = leeway_s
        self._keys = ReloadingFile(
            path,
            lambda data: parse_jwks(data, f"JWKS file {path}"),
            what="JWKS file",
            check_interval_s=check_interval_s,
        )

    def principal(self, token: str) -> str | None:
        """The token's ``sub`` when it verifies, else None (the reason is logged at debug level)."""
        keys = self._keys.get()
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            log.debug("bearer token refused: not a JWT")
            return None
        kid, alg = header.get("kid"), header.get("alg")
        entry = keys.get(kid) if isinstance(kid, str) else None
        if entry is None:
            log.debug("JWT refused: unknown kid")
            return None
        if not isinstance(alg, str) or alg not in entry.algorithms:
            log.debug("JWT refused: alg %r is not one of key %r's", alg, kid)
            return None
        try:
            claims = jwt.decode(
                token,
                entry.key,
                algorithms=[alg],
                audience=self.audience,
                leeway=self._leeway_s,
                options={"require": ["exp", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            log.debug("JWT refused: %s", exc)
            return None
        sub = claims.get("sub")
        return sub if isinstance(sub, str) and sub else None


# ---- the authenticator ------------------------------------------------------------------------

_Metadata = Iterable[tuple[str, str | bytes]]


def _bearer_token(metadata: _Metadata | None) -> str | None:
    """The token of the call's one ``authorization: Bearer`` header; None without the header."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, "more than one authorization header")
    value = values[0]
    scheme, _, token = value.strip().partition(" ") if isinstance(value, str) else ("", "", "")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, "expected 'authorization: Bearer <token>'")
    return token


class Authenticator:
    """Decides who a call is from, with every method of authentication configured.

    ``enabled`` is False without any: then every caller is ``ANONYMOUS`` (see
    ``authenticator_for`` for where that is allowed)."""

    def __init__(
        self,
        *,
        tokens: TokenFile | None = None,
        jwks: JwksVerifier | None = None,
        client_certificates: bool = False,
    ) -> None:
        self.tokens = tokens
        self.jwks = jwks
        self.client_certificates = client_certificates

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.jwks is not None or self.client_certificates

    @property
    def bearer_tokens(self) -> bool:
        return self.tokens is not None or self.jwks is not None

    def describe(self) -> str:
        """How callers authenticate, in words (for the start-up log line)."""
        ways = [
            *(["bearer tokens"] if self.tokens is not None else []),
            *(["JWTs"] if self.jwks is not None else []),
            *(["client certificates"] if self.client_certificates else []),
        ]
        return "authenticated by " + ", ".join(ways) if ways else "unauthenticated"

    def token_principal(self, metadata: _Metadata | None) -> str | None:
        """The principal of the call's bearer token; None when it sends none (or bearer tokens
        are not configured: then the header means nothing here). Raises
        ``UnauthenticatedError`` for a token that is neither listed nor a valid JWT."""
        if not self.bearer_tokens:
            return None
        token = _bearer_token(metadata)
        if token is None:
            return None
        principal = self.tokens.principal(token) if self.tokens is not None else None
        if principal is None and self.jwks is not None:
            principal = self.jwks.principal(token)
        if principal is None:
            raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, _BAD_CREDENTIALS)
        return principal

    def admit(self, metadata: _Metadata | None) -> None:
        """Whether a call may reach its handler, from its metadata alone (an interceptor sees no
        TLS peer): a valid bearer token, or none where client certificates are required (the
        handshake has verified one). Raises ``UnauthenticatedError``."""
        if not self.enabled:
            return
        if self.token_principal(metadata) is None and not self.client_certificates:
            raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, _NO_CREDENTIALS)

    def principal_of(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The principal of a call (a ``PrincipalOf``): its bearer token's, else its client
        certificate's identity; ``ANONYMOUS`` without authentication configured."""
        if not self.enabled:
            return ANONYMOUS
        principal = self.token_principal(context.invocation_metadata())
        if principal is not None:
            return bounded_principal(principal)
        if self.client_certificates:
            identity = peer_identity(context)
            if identity:
                return bounded_principal(identity)
            raise UnauthenticatedError(
                ErrorCode.UNAUTHENTICATED, "the client certificate names no identity (no SAN or CN)"
            )
        raise UnauthenticatedError(ErrorCode.UNAUTHENTICATED, _NO_CREDENTIALS)


def authenticator_for(config: ServiceConfig, *, warn: bool = True) -> Authenticator:
    """The authenticator ``config`` asks for, its files loaded; raises ``BadRequestError``
    (``invalid_config``) for a file that cannot be used, and for an unauthenticated API on
    anything but loopback without ``insecure`` (TLS alone authenticates nobody). ``warn``: log
    what is allowed but exposed (``--insecure`` in use, bearer tokens without TLS)."""
    if config.auth_audience and config.auth_jwks is None:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, "--auth-audience needs --auth-jwks")
    auth = Authenticator(
        tokens=TokenFile(config.auth_tokens) if config.auth_tokens is not None else None,
        jwks=JwksVerifier(config.auth_jwks, config.auth_audience) if config.auth_jwks is not None else None,
        client_certificates=config.tls is not None and config.tls.client_ca is not None,
    )
    host, _ = split_host_port(config.listen)
    if not auth.enabled:
        check_plaintext_listen(host, insecure=config.insecure, what="an unauthenticated session API")
    if not warn or is_loopback(host):
        return auth
    if not auth.enabled:
        log.warning("serving an unauthenticated session API on %s (--insecure)", config.listen)
    elif config.tls is None and auth.bearer_tokens:
        log.warning(
            "bearer tokens are accepted without TLS on %s: they travel in the clear unless something "
            "in front of this service terminates TLS",
            config.listen,
        )
    return auth
