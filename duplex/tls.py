"""TLS for both tiers: credentials from mounted files that reload when the files change, the
peer's identity from its certificate, and the rule that plaintext stays on loopback.

Kubernetes rotates a mounted Secret in place (the files change under the same paths), so
nothing here reads a certificate once and keeps it: a server re-reads its files when they
changed, checked at each new TLS handshake (``grpc.dynamic_ssl_server_credentials``); a client
(``ChannelCredentials``) re-reads them when it makes a new channel. Established connections keep
the certificates they were made with, as TLS does.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from duplex.errors import BadRequestError, ErrorCode

__all__ = [
    "ChannelCredentials",
    "ClientTLS",
    "ServerTLS",
    "WatchedFiles",
    "check_plaintext_listen",
    "is_loopback",
    "peer_identity",
    "server_credentials",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's TLS material (PEM files)."""

    cert: Path
    """The server's certificate chain."""
    key: Path
    """Its private key."""
    client_ca: Path | None = None
    """When set, every client must present a certificate signed by this CA (mutual TLS)."""


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """A client's TLS material (PEM files) for calling a TLS server."""

    ca: Path
    """The CA that signed the server's certificate."""
    cert: Path | None = None
    """The client's certificate chain (mutual TLS), with ``key``."""
    key: Path | None = None
    """The client certificate's private key."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, "a client certificate needs both its cert and key"
            )


class WatchedFiles:
    """The contents of a few files, kept current by ``refresh``.

    A change is a change of the bytes a path resolves to, so a Secret's atomic symlink swap and
    an in-place rewrite are both seen: a stat is not enough, as a rewrite that keeps the size
    within the file system's timestamp tick leaves it unchanged. The files are a few KB, read
    before a handshake that costs far more. A file that cannot be read (mid-rotation) keeps the
    last good contents and is retried at the next check."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = tuple(paths)
        try:
            self.contents = self._read()
        except OSError as exc:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, f"cannot read {exc.filename}: {exc.strerror}"
            ) from exc
        self._problem: str | None = None
        """The last problem logged: warned once, not at every handshake (which anyone who can
        connect can cause)."""

    def _read(self) -> tuple[bytes, ...]:
        return tuple(path.read_bytes() for path in self.paths)

    def refresh(self) -> bool:
        """Re-read the files; True when ``contents`` changed."""
        try:
            contents = self._read()
        except OSError as exc:
            if str(exc) != self._problem:
                self._problem = str(exc)
                log.warning("TLS files %s not reloaded: %s", ", ".join(map(str, self.paths)), exc)
            return False
        self._problem = None
        if contents == self.contents:
            return False
        self.contents = contents
        log.info("TLS files reloaded: %s", ", ".join(map(str, self.paths)))
        return True


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Server credentials that pick up new certificate files at the next handshake."""
    paths = [tls.cert, tls.key] + ([tls.client_ca] if tls.client_ca is not None else [])
    files = WatchedFiles(paths)

    def configuration() -> grpc.ServerCertificateConfiguration:
        cert, key, *ca = files.contents
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca[0] if ca else None
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each new handshake; None keeps the current configuration.
        return configuration() if files.refresh() else None

    return grpc.dynamic_ssl_server_credentials(
        configuration(),
        fetch,  # type: ignore[arg-type]  # gRPC takes None as "unchanged"; the stub omits it
        require_client_authentication=tls.client_ca is not None,
    )


class ChannelCredentials:
    """A client's channel credentials, rebuilt from its files when they changed.

    ``current()`` is asked whenever a channel is made (a link's reconnect), so a rotated client
    certificate is used from the next connection on."""

    def __init__(self, tls: ClientTLS) -> None:
        paths = [tls.ca] + ([tls.cert, tls.key] if tls.cert is not None and tls.key is not None else [])
        self._files = WatchedFiles(paths)
        self._credentials = self._build()

    def _build(self) -> grpc.ChannelCredentials:
        ca, *pair = self._files.contents
        cert, key = pair if pair else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def current(self) -> grpc.ChannelCredentials:
        if self._files.refresh():
            self._credentials = self._build()
        return self._credentials


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext[object, object]) -> str | None:
    """The verified peer certificate's identity: its first subject alternative name (DNS or URI,
    as the certificate lists them), else its common name; None without a client certificate."""
    auth = context.auth_context()
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        for value in auth.get(key, ()):
            if isinstance(value, bytes) and value:
                return value.decode("utf-8", "replace")
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext_listen(host: str, *, insecure: bool, what: str) -> None:
    """Refuse to serve ``what`` without TLS/authentication on anything but loopback, unless the
    operator said ``--insecure``: a real deployment must not be open by accident."""
    if not is_loopback(host) and not insecure:
        raise BadRequestError(
            ErrorCode.INVALID_CONFIG,
            f"refusing to serve {what} on {host!r}: it is not a loopback address; "
            "configure TLS (and authentication), or pass --insecure to serve it in the clear",
        )
