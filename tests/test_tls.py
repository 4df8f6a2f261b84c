"""TLS material from files (``duplex.tls``): mutual TLS, the peer's identity, reload on rotation,
and plaintext kept to loopback. Certificates are made per test with trustme; servers are real
gRPC servers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.errors import BadRequestError
from duplex.serving import bind
from duplex.tls import (
    ChannelCredentials,
    ClientTLS,
    ServerTLS,
    check_plaintext_listen,
    is_loopback,
    peer_identity,
    server_credentials,
)


class _Echo(health_pb2_grpc.HealthServicer):
    """Health/Check that records the caller's certificate identity."""

    def __init__(self) -> None:
        self.identities: list[str | None] = []

    async def Check(self, request, context):  # type: ignore[no-untyped-def]
        self.identities.append(peer_identity(context))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _write(path: Path, blob: trustme.Blob) -> Path:
    blob.write_to_path(str(path))
    return path


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_files(tmp_path: Path, ca: trustme.CA) -> ServerTLS:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    return ServerTLS(
        cert=_write(tmp_path / "tls.crt", cert.cert_chain_pems[0]),
        key=_write(tmp_path / "tls.key", cert.private_key_pem),
        client_ca=_write(tmp_path / "ca.crt", ca.cert_pem),
    )


def _client(
    tmp_path: Path, ca: trustme.CA, name: str | None, *, trust: trustme.CA | None = None
) -> ClientTLS:
    (trust or ca).cert_pem.write_to_path(str(tmp_path / "client-ca.crt"))
    if name is None:
        return ClientTLS(ca=tmp_path / "client-ca.crt")
    cert = ca.issue_cert(name)
    return ClientTLS(
        ca=tmp_path / "client-ca.crt",
        cert=_write(tmp_path / f"{name}.crt", cert.cert_chain_pems[0]),
        key=_write(tmp_path / f"{name}.key", cert.private_key_pem),
    )


@pytest.fixture
async def server(server_files: ServerTLS) -> AsyncIterator[tuple[str, _Echo]]:
    echo = _Echo()
    srv = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(echo, srv)
    port = bind(srv, "127.0.0.1:0", server_credentials(server_files))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", echo
    finally:
        await srv.stop(None)


async def _check(address: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = grpc.aio.insecure_channel(address) if creds is None else grpc.aio.secure_channel(address, creds)
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_admits_a_ca_signed_client_and_names_it(server, tmp_path, ca) -> None:
    address, echo = server
    creds = ChannelCredentials(_client(tmp_path, ca, "replica-a.duplex.svc"))
    assert await _check(address, creds.current()) == grpc.StatusCode.OK
    assert echo.identities == ["replica-a.duplex.svc"]


async def test_plaintext_no_certificate_and_a_foreign_ca_are_refused(server, tmp_path, ca) -> None:
    address, echo = server
    assert await _check(address, None) == grpc.StatusCode.UNAVAILABLE
    no_cert = ChannelCredentials(_client(tmp_path, ca, None))
    assert await _check(address, no_cert.current()) == grpc.StatusCode.UNAVAILABLE
    stranger = trustme.CA()  # a certificate from another CA, which trusts the server's CA
    (tmp_path / "f").mkdir()
    foreign = _client(tmp_path / "f", stranger, "replica-a.duplex.svc", trust=ca)
    assert await _check(address, ChannelCredentials(foreign).current()) == grpc.StatusCode.UNAVAILABLE
    assert echo.identities == []


async def test_a_rotated_server_certificate_is_served_from_the_next_handshake(
    server, server_files, tmp_path, ca
) -> None:
    address, _ = server
    client = _client(tmp_path, ca, "replica-a")
    assert await _check(address, ChannelCredentials(client).current()) == grpc.StatusCode.OK
    # The Secret rotates to a certificate from a new CA; a client that trusts only the new CA
    # can connect once the files changed, without a restart.
    new_ca = trustme.CA()
    cert = new_ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(server_files.cert))
    cert.private_key_pem.write_to_path(str(server_files.key))
    new_ca.cert_pem.write_to_path(str(server_files.client_ca))
    (tmp_path / "new").mkdir()
    rotated = _client(tmp_path / "new", new_ca, "replica-a")
    assert await _check(address, ChannelCredentials(rotated).current()) == grpc.StatusCode.OK
    # A client still on the old CA is refused now.
    assert await _check(address, ChannelCredentials(client).current()) == grpc.StatusCode.UNAVAILABLE


async def test_client_credentials_follow_their_files(server, tmp_path, ca) -> None:
    address, echo = server
    files = _client(tmp_path, ca, "replica-a")
    creds = ChannelCredentials(files)
    first = creds.current()
    assert creds.current() is first  # unchanged files: the same credentials
    cert = ca.issue_cert("replica-b")
    assert files.cert is not None and files.key is not None
    cert.cert_chain_pems[0].write_to_path(str(files.cert))
    cert.private_key_pem.write_to_path(str(files.key))
    assert await _check(address, creds.current()) == grpc.StatusCode.OK
    assert echo.identities == ["replica-b"]


def test_plaintext_is_for_loopback_unless_insecure() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host)
        check_plaintext_listen(host, insecure=False, what="the worker API")
    for host in ("0.0.0.0", "::", "10.1.2.3", "worker.example"):
        assert not is_loopback(host)
        with pytest.raises(BadRequestError) as err:
            check_plaintext_listen(host, insecure=False, what="the worker API")
        assert err.value.code == "invalid_config" and "--insecure" in err.value.message
        check_plaintext_listen(host, insecure=True, what="the worker API")


def test_a_client_certificate_needs_its_key() -> None:
    with pytest.raises(BadRequestError):
        ClientTLS(ca=Path("ca.crt"), cert=Path("c.crt"))


def test_a_missing_file_is_a_configuration_error_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(BadRequestError) as err:
        ChannelCredentials(ClientTLS(ca=tmp_path / "nowhere.crt"))
    assert err.value.code == "invalid_config" and "nowhere.crt" in err.value.message


def test_the_session_cli_refuses_unreadable_worker_tls_files_in_one_line(tmp_path: Path, capsys) -> None:
    from session_service.api.cli import main

    code = main(["--workers", "127.0.0.1:1", "--worker-tls-ca", str(tmp_path / "nowhere.crt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "nowhere.crt" in err
