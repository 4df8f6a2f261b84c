"""Who may use the session API: TLS, bearer tokens (a file of digests, or JWTs verified against a
local JWKS), client certificates, the open health service, authenticated reflection, and the
rule that an unauthenticated API listens on loopback only.

The attacks run against real in-process servers on loopback (``tests.session_helpers``);
certificates are made per test with trustme, JWT keys with cryptography."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duplex import talk
from duplex.audio import PCM16K_MONO
from duplex.cli import main
from duplex.client import ConnectError, DuplexClient
from duplex.errors import BadRequestError, DuplexError
from duplex.stack import example_path
from duplex.tls import ServerTLS
from duplex.v1 import session_pb2, session_pb2_grpc
from session_service.api.cli import config_from_args
from session_service.api.server import SessionServer
from session_service.config import ServiceConfig
from session_service.plugin import load_plugin
from session_service.trust.auth import JwksVerifier, TokenFile, parse_jwks, parse_token_file, token_digest
from tests.procs import REPO, start_service
from tests.session_helpers import PARROT, InProcessStack, in_process_stack, sample, session_args

HELLO = example_path("hello.wav")
AUDIENCE = "duplex-sessions"
ALICE_TOKEN = "alice-s3cret-token"
CAROL_TOKEN = "carol-other-token"
ALICE_SECOND = "tok-alice-2"  # a second token of the same principal


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_tokens(path: Path, tokens: dict[str, str]) -> Path:
    """A token file: ``PRINCIPAL:SHA256_HEX`` per token (``tokens``: token -> principal)."""
    lines = ["# principal:sha256(token)", ""]
    lines += [f"{principal}:{sha256_hex(token)}" for token, principal in tokens.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- certificates and keys ------------------------------------------------------------------


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    cert: Path
    key: Path
    dir: Path

    def server(self, *, client_ca: bool = False) -> ServerTLS:
        return ServerTLS(cert=self.cert, key=self.key, client_ca=self.ca_file if client_ca else None)

    def client_cert(self, name: str) -> tuple[Path, Path]:
        issued = self.ca.issue_cert(name)
        cert, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return cert, key

    def channel(self, name: str | None = None) -> grpc.ChannelCredentials:
        pair = self.client_cert(name) if name is not None else None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=pair[1].read_bytes() if pair else None,
            certificate_chain=pair[0].read_bytes() if pair else None,
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    (tmp_path / "pki").mkdir()
    d = tmp_path / "pki"
    ca.cert_pem.write_to_path(str(d / "ca.crt"))
    issued.cert_chain_pems[0].write_to_path(str(d / "tls.crt"))
    issued.private_key_pem.write_to_path(str(d / "tls.key"))
    return Pki(ca, d / "ca.crt", d / "tls.crt", d / "tls.key", d)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Jwks:
    """An RSA signing key (and an EC one) published in a JWKS file."""

    path: Path
    rsa_key: rsa.RSAPrivateKey
    ec_key: ec.EllipticCurvePrivateKey

    @property
    def rsa_public_pem(self) -> bytes:
        return self.rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def token(
        self,
        *,
        sub: str = "bob",
        aud: str | None = AUDIENCE,
        exp: float | None = 300,
        kid: str | None = "rsa-1",
        key: Any = None,
        alg: str = "RS256",
        **claims: Any,
    ) -> str:
        payload: dict[str, Any] = {"sub": sub, "iat": int(time.time()), **claims}
        if aud is not None:
            payload["aud"] = aud
        if exp is not None:
            payload["exp"] = int(time.time() + exp)
        headers = {"kid": kid} if kid is not None else {}
        return jwt.encode(payload, key or self.rsa_key, algorithm=alg, headers=headers)

    def write(self, *extra: dict[str, Any], rsa_kid: str = "rsa-1") -> None:
        rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.rsa_key.public_key()))
        ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.ec_key.public_key()))
        keys = [{**rsa_jwk, "kid": rsa_kid, "use": "sig"}, {**ec_jwk, "kid": "ec-1"}, *extra]
        self.path.write_text(json.dumps({"keys": keys}))


@pytest.fixture
def jwks(tmp_path: Path) -> Jwks:
    j = Jwks(
        tmp_path / "jwks.json",
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec.generate_private_key(ec.SECP256R1()),
    )
    j.write()
    return j


def forged(header: dict[str, Any], payload: dict[str, Any], sign: Any = None) -> str:
    """A compact JWT built by hand (``sign``: bytes -> signature; none: an empty signature)."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"
    signature = sign(signing_input.encode()) if sign is not None else b""
    return f"{signing_input}.{_b64(signature)}"


# ---- calls ----------------------------------------------------------------------------------


def _open_event() -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(
        event_id="c1",
        open=session_pb2.SessionOpen(config=session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto())),
    )


@dataclass
class Refusal:
    status: grpc.StatusCode
    reason: str  # the ErrorInfo reason ("" when the status carries none)
    message: str


async def raw_open(
    target: str,
    metadata: Sequence[tuple[str, str]] = (),
    credentials: grpc.ChannelCredentials | None = None,
    first: session_pb2.ClientEvent | None = None,
) -> Refusal | session_pb2.ServerEvent:
    """One ``Converse`` call with ``metadata`` whose first event is an open (or ``first``): the
    first server event, or how the call was refused (its status and ErrorInfo reason)."""
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        call = session_pb2_grpc.DuplexSessionStub(channel).Converse(metadata=tuple(metadata), timeout=10)
        try:
            with contextlib.suppress(asyncio.InvalidStateError):
                await call.write(first or _open_event())
            ev = await call.read()
            if isinstance(ev, session_pb2.ServerEvent):
                call.cancel()
                return ev
            code = await call.code()
            trailing = await call.trailing_metadata()
            details = await call.details()
        except grpc.aio.AioRpcError as exc:
            code, trailing, details = exc.code(), exc.trailing_metadata(), exc.details() or ""
    reason = ""
    for key, value in trailing or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    assert info.domain == "duplex.v1"
                    reason = info.reason
    return Refusal(code, reason, details or "")


def assert_unauthenticated(result: Refusal | session_pb2.ServerEvent) -> None:
    assert isinstance(result, Refusal), f"admitted: {result.WhichOneof('event')}"
    assert result.status == grpc.StatusCode.UNAUTHENTICATED, result
    assert result.reason == "unauthenticated", result


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


class Principals:
    """Records the principal each open/resume reaches the session manager with."""

    def __init__(self, server: SessionServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, str]] = []
        manager = server.manager
        for name in ("open", "resume"):
            original = getattr(manager, name)

            def spy(msg: Any, *, principal: str = "", _name: str = name, _original: Any = original) -> Any:
                self.seen.append((_name, principal))
                return _original(msg, principal=principal)

            monkeypatch.setattr(manager, name, spy)


@contextlib.asynccontextmanager
async def service(**config: Any) -> AsyncIterator[InProcessStack]:
    """A parrot worker and a session service with ``config`` (``ServiceConfig`` fields)."""
    async with in_process_stack(service=config) as s:
        yield s


# ---- bearer tokens from a file ---------------------------------------------------------------


async def test_no_token_and_a_wrong_token_are_refused_before_any_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(auth_tokens=tokens) as stack:
        seen = Principals(stack.session, monkeypatch)
        active = sample("duplex_session_active_sessions")
        resume = session_pb2.ClientEvent(
            event_id="c1", resume=session_pb2.SessionResume(session_id="sess_x", resume_token="t")
        )
        for metadata in (
            [],
            bearer("wrong-token"),
            bearer(ALICE_TOKEN + "x"),
            bearer(sha256_hex(ALICE_TOKEN)),  # the digest in the file is not the token
            [("authorization", f"Basic {ALICE_TOKEN}")],
            [("authorization", "Bearer ")],
            [("authorization", ALICE_TOKEN)],
            [*bearer("wrong-token"), *bearer(ALICE_TOKEN)],  # two headers: refused, not "any"
        ):
            assert_unauthenticated(await raw_open(stack.target, metadata))
            assert_unauthenticated(await raw_open(stack.target, metadata, first=resume))
        assert seen.seen == []  # the session manager never heard of these calls
        assert len(stack.session.manager) == 0
        assert sample("duplex_session_active_sessions") == active
        # The Python client gets the typed error with the stable code.
        async with DuplexClient(stack.target, token="wrong-token") as client:
            with pytest.raises(DuplexError) as err:
                await client.open_session(timeout_s=5)
        assert err.value.status == grpc.StatusCode.UNAUTHENTICATED and err.value.code == "unauthenticated"


async def test_a_right_token_opens_a_session_as_its_principal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = write_tokens(
        tmp_path / "tokens", {ALICE_TOKEN: "alice", ALICE_SECOND: "alice", CAROL_TOKEN: "carol"}
    )
    async with service(auth_tokens=tokens) as stack:
        seen = Principals(stack.session, monkeypatch)
        for token in (ALICE_TOKEN, ALICE_SECOND, CAROL_TOKEN):
            async with DuplexClient(stack.target, token=token) as client:
                session = await client.open_session(timeout_s=10)
                await session.close()
        ev = await raw_open(stack.target, [("authorization", f"bearer {CAROL_TOKEN}")])  # any case
        assert isinstance(ev, session_pb2.ServerEvent) and ev.HasField("opened"), ev
        assert seen.seen == [("open", "alice"), ("open", "alice"), ("open", "carol"), ("open", "carol")]


async def test_the_token_file_reloads_without_a_restart(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(auth_tokens=tokens) as stack:
        assert isinstance(await raw_open(stack.target, bearer(ALICE_TOKEN)), session_pb2.ServerEvent)
        assert_unauthenticated(await raw_open(stack.target, bearer(CAROL_TOKEN)))
        # Rotation: carol is added and alice revoked, in place; no restart.
        write_tokens(tokens, {CAROL_TOKEN: "carol"})
        deadline = time.monotonic() + 5
        while isinstance(await raw_open(stack.target, bearer(CAROL_TOKEN)), Refusal):
            assert time.monotonic() < deadline, "carol's token never started to work"
            await asyncio.sleep(0.2)
        assert_unauthenticated(await raw_open(stack.target, bearer(ALICE_TOKEN)))


# ---- JWT bearer tokens ----------------------------------------------------------------------


async def test_a_valid_jwt_opens_a_session_as_its_subject(
    tmp_path: Path, jwks: Jwks, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with service(auth_jwks=jwks.path, auth_audience=AUDIENCE) as stack:
        seen = Principals(stack.session, monkeypatch)
        for token in (jwks.token(sub="bob"), jwks.token(sub="eve", kid="ec-1", key=jwks.ec_key, alg="ES256")):
            ev = await raw_open(stack.target, bearer(token))
            assert isinstance(ev, session_pb2.ServerEvent) and ev.HasField("opened"), ev
        hs256 = forged(
            {"alg": "HS256", "kid": "rsa-1", "typ": "JWT"},
            {"sub": "mallory", "aud": AUDIENCE, "exp": int(time.time()) + 300},
            lambda data: hmac.new(jwks.rsa_public_pem, data, hashlib.sha256).digest(),
        )
        for bad in (
            jwks.token(aud="someone-else"),
            jwks.token(exp=-120),
            jwks.token(kid="nope"),
            forged({"alg": "none", "kid": "rsa-1"}, {"sub": "mallory", "aud": AUDIENCE, "exp": 2**40}),
            hs256,
            "not.a.jwt",
        ):
            assert_unauthenticated(await raw_open(stack.target, bearer(bad)))
        assert seen.seen == [("open", "bob"), ("open", "eve")]


# ---- TLS and client certificates ------------------------------------------------------------


async def test_a_client_certificate_names_the_principal(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with service(tls=pki.server(client_ca=True)) as stack:
        seen = Principals(stack.session, monkeypatch)
        ev = await raw_open(stack.target, credentials=pki.channel("backend-a.example"))
        assert isinstance(ev, session_pb2.ServerEvent) and ev.HasField("opened"), ev
        assert seen.seen == [("open", "backend-a.example")]
        # No certificate, and plaintext: refused at the handshake, before any call.
        for creds in (pki.channel(None), None):
            refused = await raw_open(stack.target, credentials=creds)
            assert isinstance(refused, Refusal) and refused.status == grpc.StatusCode.UNAVAILABLE, refused
        assert len(seen.seen) == 1


async def test_a_bearer_token_over_mutual_tls_names_the_principal(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(tls=pki.server(client_ca=True), auth_tokens=tokens) as stack:
        seen = Principals(stack.session, monkeypatch)
        creds = pki.channel("backend-a.example")
        assert isinstance(await raw_open(stack.target, bearer(ALICE_TOKEN), creds), session_pb2.ServerEvent)
        assert isinstance(await raw_open(stack.target, [], creds), session_pb2.ServerEvent)
        # A wrong token is refused even from a trusted backend.
        assert_unauthenticated(await raw_open(stack.target, bearer("wrong"), creds))
        assert seen.seen == [("open", "alice"), ("open", "backend-a.example")]


# ---- health and reflection ------------------------------------------------------------------


async def _reflect(target: str, metadata: Sequence[tuple[str, str]]) -> list[str] | grpc.StatusCode:
    async with grpc.aio.insecure_channel(target) as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=tuple(metadata),
            timeout=5,
        )
        try:
            return [s.name async for r in call for s in r.list_services_response.service]
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def test_health_is_open_and_reflection_needs_credentials(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(auth_tokens=tokens) as stack:
        async with grpc.aio.insecure_channel(stack.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", "duplex.v1.DuplexSession"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert await _reflect(stack.target, []) == grpc.StatusCode.UNAUTHENTICATED
        assert await _reflect(stack.target, bearer("wrong")) == grpc.StatusCode.UNAUTHENTICATED
        names = await _reflect(stack.target, bearer(ALICE_TOKEN))
        assert isinstance(names, list) and "duplex.v1.DuplexSession" in names
        # Any other method: unauthenticated first (no probing what exists).
        async with grpc.aio.insecure_channel(stack.target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/duplex.v1.Nope/Nothing")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_reflection_can_be_turned_off(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(auth_tokens=tokens, reflection=False) as stack:
        assert await _reflect(stack.target, bearer(ALICE_TOKEN)) == grpc.StatusCode.UNIMPLEMENTED
    async with service(reflection=False) as stack:  # anonymous on loopback: off as well
        assert await _reflect(stack.target, []) == grpc.StatusCode.UNIMPLEMENTED


# ---- the loopback rule ----------------------------------------------------------------------


def _server(**config: Any) -> SessionServer:
    cfg = ServiceConfig(plugin=PARROT, workers=("127.0.0.1:1",), metrics_port=-1, **config)
    return SessionServer(cfg, load_plugin(PARROT))


async def test_an_unauthenticated_api_stays_on_loopback(pki: Pki, tmp_path: Path) -> None:
    for listen in ("0.0.0.0:0", "[::]:0", "10.1.2.3:50051"):
        for extra in ({}, {"tls": pki.server()}):  # TLS alone authenticates nobody
            with pytest.raises(BadRequestError) as err:
                _server(listen=listen, **extra)
            assert err.value.code == "invalid_config" and "--insecure" in err.value.message
            assert "unauthenticated session API" in err.value.message
    # Authenticated (tokens, a JWKS, client certificates) or explicitly --insecure: allowed.
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    _server(listen="0.0.0.0:0", auth_tokens=tokens)
    _server(listen="0.0.0.0:0", tls=pki.server(client_ca=True))
    _server(listen="0.0.0.0:0", insecure=True)
    _server(listen="127.0.0.1:0")


async def test_insecure_serves_an_open_api_on_all_interfaces() -> None:
    async with service(listen="0.0.0.0:0", insecure=True) as stack:
        ev = await raw_open(stack.target)
        assert isinstance(ev, session_pb2.ServerEvent) and ev.HasField("opened"), ev


# ---- clients ---------------------------------------------------------------------------------


async def test_the_client_reaches_a_tls_and_token_service(pki: Pki, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(tls=pki.server(), auth_tokens=tokens) as stack:
        creds = grpc.ssl_channel_credentials(pki.ca_file.read_bytes())
        async with DuplexClient(stack.target, credentials=creds, token=ALICE_TOKEN) as client:
            session = await client.open_session(timeout_s=10)
            assert session.session_id.startswith("sess_")
            await session.close()
        async with DuplexClient(stack.target, credentials=creds) as client:
            with pytest.raises(DuplexError) as err:
                await client.open_session(timeout_s=10)
            assert err.value.code == "unauthenticated"
        async with DuplexClient(stack.target, token=ALICE_TOKEN, connect_timeout_s=0.5) as client:
            with pytest.raises(ConnectError):  # plaintext to a TLS port never connects
                await client.open_session(timeout_s=2)


def _talk_args(target: str, out: Path, *extra: str) -> list[str]:
    return [str(HELLO), "-o", str(out), "--target", target, "--fast", "--timeout", "30", *extra]


async def run_talk(args: Sequence[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m duplex talk ARGS`` (a process of its own: grpc.aio keeps to one event loop per
    process): its exit code and stderr."""
    environ = {k: v for k, v in os.environ.items() if k != "DUPLEX_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "duplex",
        "talk",
        *args,
        cwd=REPO,
        env={**environ, **(env or {})},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, stderr.decode()


@pytest.mark.process
async def test_duplex_talk_reaches_a_tls_and_token_service(pki: Pki, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    token_file = tmp_path / "token"
    token_file.write_text(ALICE_TOKEN + "\n")
    config = {"tls": pki.server(), "auth_tokens": tokens}
    async with in_process_stack(clock_speed=4.0, service=config) as stack:
        out = tmp_path / "reply.wav"
        tls = ("--tls-ca", str(pki.ca_file))
        code, err = await run_talk(_talk_args(stack.target, out, *tls, "--token-file", str(token_file)))
        assert code == 0, err
        assert out.exists()
        out.unlink()
        code, err = await run_talk(_talk_args(stack.target, out, *tls), env={"DUPLEX_TOKEN": ALICE_TOKEN})
        assert code == 0, err
        assert out.exists()


@pytest.mark.process
async def test_duplex_talk_says_unauthenticated_with_its_own_exit_code(pki: Pki, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(tls=pki.server(), auth_tokens=tokens) as stack:
        out = tmp_path / "reply.wav"
        args = _talk_args(stack.target, out, "--tls-ca", str(pki.ca_file))
        for env in ({"DUPLEX_TOKEN": "not-alice"}, None):
            code, err = await run_talk(args, env=env)
            lines = err.strip().splitlines()
            assert code == 4, err
            # The header line, then one line that says what happened.
            assert len(lines) == 2 and f"{stack.target} refused the credentials" in lines[1], lines
            assert lines[1].endswith("[unauthenticated]") and "not-alice" not in err
            assert ("no token given" in lines[1]) == (env is None)
        assert not out.exists()


def test_talk_help_documents_the_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        talk.main(["--help"])
    out = capsys.readouterr().out
    assert "4  the service refused the credentials" in out
    for flag in ("--tls-ca", "--tls-cert", "--tls-key", "--token-file", "DUPLEX_TOKEN"):
        assert flag in out
    with pytest.raises(SystemExit) as exit_:  # a token is never taken from the command line
        talk.main([str(HELLO), "--token", ALICE_TOKEN])
    assert exit_.value.code == 2


def test_talk_refuses_an_unusable_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for content in (None, "", "two words\n"):
        path = tmp_path / "token"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        assert talk.main([str(HELLO), "--token-file", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "token file" in err[0] and "words" not in err[0], err


# ---- the pieces, directly -------------------------------------------------------------------


def test_token_file_lines(tmp_path: Path) -> None:
    text = f"""# who:sha256
alice:{sha256_hex(ALICE_TOKEN)}

   carol : {sha256_hex(CAROL_TOKEN).upper()}
spiffe://duplex/backend:{sha256_hex("backend")}
"""
    assert parse_token_file(text.encode()) == (
        ("alice", hashlib.sha256(ALICE_TOKEN.encode()).digest()),
        ("carol", hashlib.sha256(CAROL_TOKEN.encode()).digest()),
        ("spiffe://duplex/backend", hashlib.sha256(b"backend").digest()),
    )
    assert token_digest(ALICE_TOKEN) == sha256_hex(ALICE_TOKEN)
    for bad, line in (
        (f"alice:{sha256_hex(ALICE_TOKEN)}\nbob:{ALICE_TOKEN}\n", 2),  # a pasted token, not its digest
        (f"# c\n\n{sha256_hex(ALICE_TOKEN)}\n", 3),
        (f":{sha256_hex(ALICE_TOKEN)}\n", 1),
        (f"alice:{sha256_hex(ALICE_TOKEN)[:-1]}\n", 1),
        (f"alice:{sha256_hex(ALICE_TOKEN)}\ncarol:{sha256_hex(ALICE_TOKEN)}\n", 2),  # one token, two names
    ):
        with pytest.raises(BadRequestError) as err:
            parse_token_file(bad.encode(), "token file t")
        assert err.value.code == "invalid_config"
        assert f"line {line}" in err.value.message, err.value.message
        assert ALICE_TOKEN not in err.value.message and sha256_hex(ALICE_TOKEN)[:10] not in err.value.message


def test_a_token_is_compared_with_every_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"p{i}" for i in range(20)]
    tokens = TokenFile(write_tokens(tmp_path / "tokens", {f"token-{n}": n for n in names}))
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr("session_service.trust.auth.hmac.compare_digest", counting)
    for token, principal in (("token-p0", "p0"), ("token-p19", "p19"), ("nobody", None)):
        calls.clear()
        assert tokens.principal(token) == principal
        assert len(calls) == 20  # no early exit on a match, none on a miss


def test_a_rotation_that_cannot_be_used_keeps_the_last_good_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    tokens = TokenFile(path, check_interval_s=0)
    caplog.set_level(logging.INFO, "session_service.trust.auth")
    path.unlink()  # mid-rotation: gone for a moment
    assert tokens.principal(ALICE_TOKEN) == "alice"
    path.write_text(f"alice:{ALICE_TOKEN}\n")  # malformed
    assert tokens.principal(ALICE_TOKEN) == "alice"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "cannot read" in warnings[0] and "line 1" in warnings[1], warnings
    assert all(ALICE_TOKEN not in w for w in warnings)
    write_tokens(path, {CAROL_TOKEN: "carol"})
    assert tokens.principal(CAROL_TOKEN) == "carol" and tokens.principal(ALICE_TOKEN) is None
    # Checked at most once per interval: a change within it is seen at the next check.
    slow = TokenFile(path, check_interval_s=3600)
    write_tokens(path, {ALICE_TOKEN: "alice"})
    assert slow.principal(CAROL_TOKEN) == "carol"


def test_a_revocation_in_place_is_seen_when_the_stat_is_unchanged(tmp_path: Path) -> None:
    # Same size, same inode, and (as within one timestamp tick of an older kernel) the same
    # times: only the bytes tell that carol replaced alice.
    path = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    before = os.stat(path)
    tokens = TokenFile(path, check_interval_s=0)
    assert tokens.principal(ALICE_TOKEN) == "alice"
    write_tokens(path, {CAROL_TOKEN: "carol"})
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert tokens.principal(ALICE_TOKEN) is None and tokens.principal(CAROL_TOKEN) == "carol"


def test_a_file_gone_again_after_it_came_back_unchanged_is_warned_of_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    good = path.read_bytes()
    tokens = TokenFile(path, check_interval_s=0)
    caplog.set_level(logging.INFO, "duplex.files")
    for _ in range(2):  # a rotation undone, twice: each time it goes, it is warned of
        path.unlink()
        assert tokens.principal(ALICE_TOKEN) == "alice" and tokens.principal(ALICE_TOKEN) == "alice"
        path.write_bytes(good)
        assert tokens.principal(ALICE_TOKEN) == "alice"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("cannot read" in w for w in warnings), warnings
    assert sum("readable again" in r.getMessage() for r in caplog.records) == 2


def test_jwt_rules(jwks: Jwks) -> None:
    verifier = JwksVerifier(jwks.path, AUDIENCE, check_interval_s=0)
    assert verifier.principal(jwks.token(sub="bob")) == "bob"
    assert verifier.principal(jwks.token(sub="bob", alg="PS256")) == "bob"
    assert verifier.principal(jwks.token(sub="eve", kid="ec-1", key=jwks.ec_key, alg="ES256")) == "eve"
    assert verifier.principal(jwks.token(aud=[AUDIENCE, "other"])) == "bob"  # RFC 7519: one of them
    assert verifier.principal(jwks.token(exp=-5)) == "bob"  # within the leeway
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    refused = {
        "wrong audience": jwks.token(aud="someone-else"),
        "no audience": jwks.token(aud=None),
        "expired": jwks.token(exp=-120),
        "no exp": jwks.token(exp=None),
        "not yet valid": jwks.token(nbf=now + 600),
        "no sub": forged({"alg": "none"}, {}),
        "unknown kid": jwks.token(kid="rsa-9"),
        "no kid": jwks.token(kid=None),
        "another key, same kid": jwks.token(key=stranger),
        "EC alg on the RSA key": forged({"alg": "ES256", "kid": "rsa-1"}, {"sub": "x"}),
        "RSA alg on the EC key": jwks.token(kid="ec-1", key=stranger),
        "alg none": forged({"alg": "none", "kid": "rsa-1"}, {"sub": "m", "aud": AUDIENCE, "exp": now + 300}),
        "alg None": forged({"alg": "None", "kid": "rsa-1"}, {"sub": "m", "aud": AUDIENCE, "exp": now + 300}),
        "HS256 keyed with the public key": forged(
            {"alg": "HS256", "kid": "rsa-1"},
            {"sub": "m", "aud": AUDIENCE, "exp": now + 300},
            lambda data: hmac.new(jwks.rsa_public_pem, data, hashlib.sha256).digest(),
        ),
        "tampered claims": ".".join(
            (
                jwks.token().split(".")[0],
                _b64(json.dumps({"sub": "admin", "aud": AUDIENCE, "exp": now + 300}).encode()),
                jwks.token().split(".")[2],
            )
        ),
        "garbage": "a.b.c",
        "opaque": ALICE_TOKEN,
    }
    for why, token in refused.items():
        assert verifier.principal(token) is None, why


def test_the_jwks_reloads_and_refuses_unsafe_keys(jwks: Jwks, caplog: pytest.LogCaptureFixture) -> None:
    verifier = JwksVerifier(jwks.path, AUDIENCE, check_interval_s=0)
    assert verifier.principal(jwks.token(kid="rsa-2")) is None
    jwks.write(rsa_kid="rsa-2")  # the key rotates to a new kid
    assert verifier.principal(jwks.token(kid="rsa-2")) == "bob"
    assert verifier.principal(jwks.token(kid="rsa-1")) is None
    jwks.path.write_text("{")  # mid-rotation garbage: the last good set stays
    assert verifier.principal(jwks.token(kid="rsa-2")) == "bob"
    assert any("not reloaded" in r.getMessage() for r in caplog.records)

    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(jwks.rsa_key.public_key()))
    private = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(jwks.rsa_key))
    for doc, why in (
        (b"[]", "'keys' list"),
        (b"{", "not JSON"),
        (json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "h"}]}).encode(), "secret key"),
        (json.dumps({"keys": [{**private, "kid": "p"}]}).encode(), "secret key"),
        (json.dumps({"keys": [rsa_jwk]}).encode(), "no 'kid'"),
        (json.dumps({"keys": [{**rsa_jwk, "kid": "a"}, {**rsa_jwk, "kid": "a"}]}).encode(), "twice"),
        (json.dumps({"keys": [{**rsa_jwk, "kid": "a", "alg": "HS256"}]}).encode(), "alg 'HS256'"),
        (json.dumps({"keys": [{**rsa_jwk, "kid": "a", "n": "!!"}]}).encode(), "not a valid public key"),
    ):
        with pytest.raises(BadRequestError) as err:
            parse_jwks(doc)
        assert why in err.value.message, (why, err.value.message)
    # An encryption key is no signing key: skipped.
    assert parse_jwks(json.dumps({"keys": [{**rsa_jwk, "kid": "e", "use": "enc"}]}).encode()) == {}
    with pytest.raises(BadRequestError):
        JwksVerifier(jwks.path, "")  # no audience


# ---- the command line -------------------------------------------------------------------------


def _session_argv(*extra: str) -> list[str]:
    return ["session", "--workers", "127.0.0.1:1", "--metrics-port", "0", *extra]


def test_the_cli_refuses_an_unauthenticated_api_off_loopback(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = ("--tls-cert", str(pki.cert), "--tls-key", str(pki.key))
    for extra in ((), tls):
        assert main(_session_argv("--listen", "0.0.0.0:0", *extra)) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert out == "" and len(lines) == 1, err
        assert "unauthenticated session API" in lines[0] and "--insecure" in lines[0]


def test_the_cli_refuses_unusable_trust_files(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_tokens = tmp_path / "tokens"
    bad_tokens.write_text(f"# ok\nalice:{sha256_hex(ALICE_TOKEN)}\nbob:{CAROL_TOKEN}\n")
    other = pki.ca.issue_cert("other")
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    for extra, expect in (
        (("--auth-tokens", str(bad_tokens)), "line 3"),
        (("--auth-tokens", str(tmp_path / "missing")), "cannot read"),
        (("--auth-jwks", str(bad_tokens), "--auth-audience", AUDIENCE), "not JSON"),
        (("--tls-cert", str(pki.key), "--tls-key", str(pki.key), "--insecure"), "--tls-cert"),
        (
            ("--tls-cert", str(pki.cert), "--tls-key", str(tmp_path / "other.key"), "--insecure"),
            "not the key",
        ),
    ):
        assert main(_session_argv(*extra)) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], (extra, err)
        assert CAROL_TOKEN not in err[0]


def test_the_cli_trust_flags(pki: Pki, tmp_path: Path) -> None:
    cfg = config_from_args(
        _session_argv(
            *("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-client-ca", str(pki.ca_file)),
            *("--auth-tokens", "t", "--auth-jwks", "j", "--auth-audience", AUDIENCE),
            *("--insecure", "--no-reflection"),
        )[1:]
    )
    assert cfg.tls == ServerTLS(pki.cert, pki.key, pki.ca_file)
    assert (cfg.auth_tokens, cfg.auth_jwks, cfg.auth_audience) == (Path("t"), Path("j"), AUDIENCE)
    assert cfg.insecure and not cfg.reflection
    plain = config_from_args(_session_argv()[1:])
    assert plain.tls is None and plain.auth_tokens is None and not plain.insecure and plain.reflection
    for extra in (
        ("--tls-cert", "c"),
        ("--tls-key", "k"),
        ("--tls-client-ca", "ca"),
        ("--auth-jwks", "j"),
        ("--auth-audience", AUDIENCE),
    ):
        with pytest.raises(SystemExit) as exit_:
            config_from_args(_session_argv(*extra)[1:])
        assert exit_.value.code == 2, extra


@pytest.mark.process
def test_the_cli_serves_all_interfaces_with_insecure_or_credentials(pki: Pki, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    tls = ("--tls-cert", str(pki.cert), "--tls-key", str(pki.key))
    for extra in (("--insecure",), ("--auth-tokens", str(tokens), *tls)):
        proc = start_service(session_args(["127.0.0.1:1"], "--listen", "0.0.0.0:0", *extra))
        try:
            assert proc.grpc.startswith("127.0.0.1:")  # listening on every interface, announced so
        finally:
            proc.terminate(timeout=15)


_REFUSALS = """
import asyncio, collections, sys
from duplex.client import DuplexClient
from duplex.errors import DuplexError

async def main() -> None:
    codes: collections.Counter[str] = collections.Counter()
    for _ in range(int(sys.argv[2])):
        async with DuplexClient(sys.argv[1], token="wrong") as client:
            try:
                await client.open_session(timeout_s=5)
            except DuplexError as err:
                codes[err.code] += 1
    print(dict(codes))

asyncio.run(main())
"""


@pytest.mark.process
async def test_every_refusal_reaches_a_client_in_another_process_as_unauthenticated(tmp_path: Path) -> None:
    """The refusal waits for the open the client writes first: refused at once, the client's
    write could fail as the call ends, which grpc.aio reports as INTERNAL (grpc/grpc#36066)."""
    tokens = write_tokens(tmp_path / "tokens", {ALICE_TOKEN: "alice"})
    async with service(auth_tokens=tokens) as stack:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _REFUSALS, stack.target, "100", cwd=REPO, stdout=asyncio.subprocess.PIPE
        )
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    assert json.loads(stdout.decode().replace("'", '"')) == {"unauthenticated": 100}


def test_a_principal_longer_than_a_resume_token_can_carry_is_refused() -> None:
    from session_service.trust.auth import MAX_PRINCIPAL_BYTES, bounded_principal

    assert bounded_principal("p" * MAX_PRINCIPAL_BYTES) == "p" * MAX_PRINCIPAL_BYTES
    with pytest.raises(DuplexError) as err:
        bounded_principal("p" * (MAX_PRINCIPAL_BYTES + 1))
    assert err.value.code == "unauthenticated"
