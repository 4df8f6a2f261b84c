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
from dataclasses import dataclass
from pathlib import Path

import grpc

from duplex.errors import BadRequestError, ErrorCode
from duplex.files import WatchedFiles

__all__ = [
    "ChannelCredentials",
    "ClientTLS",
    "ServerTLS",
    "check_plaintext_listen",
    "is_loopback",
    "peer_identity",
    "server_credentials",
]


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


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Server credentials that pick up new certificate files at the next handshake."""
    paths = [tls.cert, tls.key] + ([tls.client_ca] if tls.client_ca is not None else [])
    files = WatchedFiles(paths, what="server TLS files")

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
        self._files = WatchedFiles(paths, what="client TLS files")
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
