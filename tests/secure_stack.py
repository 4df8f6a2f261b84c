"""The README's secure deployment ("Running the services") as real processes on loopback, for
attack tests: workers serving mutual TLS to tier-CA clients only, session replicas serving TLS
and bearer tokens to callers and mutual TLS towards the workers, resume secrets shared by every
replica, each process with a plaintext health port.

Everything is made per call under ``root``: two CAs (trustme), the certificates, a token file
of random tokens, the resume secrets, one log file per process (its stderr, then whatever it
printed on stdout after its "listening" line). Every process started is terminated by its own
pid on the way out, on failure too (SIGCONT first, so a stopped one goes as well)::

    with secure_stack(tmp_path, workers=2, replicas=2) as stack:
        async with stack.api_channel(0, principal="victim") as ch:
            conv = Conversation(ch).start(open_event())
        async with stack.worker_channel(0, "other-service") as ch:
            ...  # a second service the same tier CA signed

Module-scoped (a sync fixture; the channels are made in each test's own loop)::

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
        with secure_stack(tmp_path_factory.mktemp("secure")) as s:
            yield s
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import trustme
from grpc_health.v1 import health_pb2

from duplex.serving import health_check
from duplex.tls import ChannelCredentials, ClientTLS
from session_service.trust.auth import token_digest
from session_service.workers.placement import rendezvous_pick
from tests.procs import ServiceProcess, start_all, start_service
from tests.session_helpers import PARROT, wait_metric

SESSION_IDENTITY = "duplex-session"
"""The session tier's certificate identity: the only one the workers let take sessions over."""
PRINCIPALS = ("victim", "attacker", "other")
"""The principals of the token file, each with a random token."""
RESUME_KID = "k1"
START_TIMEOUT_S = 60.0
"""Bound on one process's start (its "listening" line), and on the stack becoming ready."""
STOP_TIMEOUT_S = 20.0
"""Bound on a tier's drain after SIGTERM (replicas, then workers) before SIGKILL."""
DRAIN_GRACE_S = 2.0
"""``--drain-grace-s`` of every process (defaults 10 s / 5 s; ``*_args`` may override it)."""


# ---- certificates -------------------------------------------------------------------------------


def _write_pair(issued: trustme.LeafCert, cert: Path, key: Path) -> None:
    for i, pem in enumerate(issued.cert_chain_pems):
        pem.write_to_path(str(cert), append=i > 0)
    issued.private_key_pem.write_to_path(str(key))


@dataclass
class StackPki:
    """The deployment's certificates (PEM files under ``dir``).

    ``tier_ca`` signs the workers' server certificate (127.0.0.1/localhost), the session tier's
    client certificate (identity ``duplex-session``) and any other client identity on demand
    (``client``); ``api_ca`` signs the session API's server certificate (127.0.0.1/localhost)."""

    dir: Path
    tier_ca: trustme.CA
    api_ca: trustme.CA
    tier_ca_file: Path
    api_ca_file: Path
    worker_cert: Path
    worker_key: Path
    api_cert: Path
    api_key: Path
    session_cert: Path
    """Client certificate of identity ``SESSION_IDENTITY`` (the replicas' ``--worker-tls-cert``)."""
    session_key: Path
    _clients: dict[tuple[str, int], ClientTLS] = field(default_factory=dict, repr=False)

    @classmethod
    def make(cls, root: Path) -> StackPki:
        d = root / "pki"
        d.mkdir(parents=True, exist_ok=True)
        tier_ca, api_ca = trustme.CA(), trustme.CA()
        tier_ca.cert_pem.write_to_path(str(d / "tier-ca.crt"))
        api_ca.cert_pem.write_to_path(str(d / "api-ca.crt"))
        _write_pair(tier_ca.issue_cert("127.0.0.1", "localhost"), d / "worker.crt", d / "worker.key")
        _write_pair(api_ca.issue_cert("127.0.0.1", "localhost"), d / "api.crt", d / "api.key")
        _write_pair(tier_ca.issue_cert(SESSION_IDENTITY), d / "session.crt", d / "session.key")
        return cls(
            dir=d,
            tier_ca=tier_ca,
            api_ca=api_ca,
            tier_ca_file=d / "tier-ca.crt",
            api_ca_file=d / "api-ca.crt",
            worker_cert=d / "worker.crt",
            worker_key=d / "worker.key",
            api_cert=d / "api.crt",
            api_key=d / "api.key",
            session_cert=d / "session.crt",
            session_key=d / "session.key",
        )

    def client(self, identity: str, *, signed_by: trustme.CA | None = None) -> ClientTLS:
        """Client TLS towards the workers (trusting the tier CA) with a certificate naming
        ``identity``, signed by the tier CA (or ``signed_by``: e.g. a foreign ``trustme.CA()``);
        made once per identity and signer. ``SESSION_IDENTITY`` from the tier CA is the replicas'
        own certificate."""
        ca = signed_by or self.tier_ca
        key = (identity, id(ca))
        if key not in self._clients:
            if identity == SESSION_IDENTITY and ca is self.tier_ca:
                cert, private = self.session_cert, self.session_key
            else:
                d = self.dir / "clients" / (identity if ca is self.tier_ca else f"{identity}-{id(ca):x}")
                d.mkdir(parents=True, exist_ok=True)
                cert, private = d / "tls.crt", d / "tls.key"
                _write_pair(ca.issue_cert(identity), cert, private)
            self._clients[key] = ClientTLS(ca=self.tier_ca_file, cert=cert, key=private)
        return self._clients[key]

    def files(self) -> dict[str, Path]:
        """Every certificate and key file by name."""
        return {
            name: getattr(self, name)
            for name in (
                "tier_ca_file",
                "api_ca_file",
                "worker_cert",
                "worker_key",
                "api_cert",
                "api_key",
                "session_cert",
                "session_key",
            )
        }


# ---- processes ----------------------------------------------------------------------------------


@dataclass
class StackProcess(ServiceProcess):
    """A ``duplex worker`` / ``duplex session`` child: ``pid``, ``grpc`` (HOST:PORT, TLS),
    ``metrics`` (HOST:PORT), ``health`` (HOST:PORT, plaintext), its ``log`` file."""

    name: str = ""
    log: Path = Path()
    args: list[str] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics}/metrics"

    @property
    def returncode(self) -> int | None:
        """Its exit status once it ended (None while it runs)."""
        return self.proc.poll()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def health_status(self, timeout: float = 2.0) -> int:
        """``grpc.health.v1`` Check on the plaintext health port (a ``HealthCheckResponse``
        status; raises ``grpc.RpcError`` when it does not answer)."""
        with grpc.insecure_channel(self.health) as ch:
            resp = health_check(ch)(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return int(resp.status)


def _pump(stdout: object, log: Path) -> None:
    """Copy what a child prints after its announcement into its log (a full pipe would block it)."""
    with open(log, "a") as f:
        for line in stdout:  # type: ignore[attr-defined]
            f.write(f"[stdout] {line}")
            f.flush()


def _start(name: str, args: list[str], *, log: Path, env: dict[str, str], timeout: float) -> StackProcess:
    """``procs.start_service`` with its stderr appended to ``log``; what it prints after its
    announcement goes there too (a full pipe would block it). A start that fails says so with
    the log's tail."""
    try:
        with open(log, "ab") as err:
            svc = start_service(args, timeout=timeout, env=env, stderr=err.fileno())
    except Exception as exc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
        raise RuntimeError(f"{name} failed to start: {exc}\n--- {log} (tail) ---\n{tail}") from exc
    threading.Thread(target=_pump, args=(svc.proc.stdout, log), daemon=True).start()
    return StackProcess(svc.proc, svc.grpc, svc.metrics, svc.health, name, log, args)


def _start_all(
    specs: list[tuple[str, list[str]]], started: list[StackProcess], *, root: Path, env: dict[str, str]
) -> list[StackProcess]:
    """``_start`` for each (name, args) in parallel (``procs.start_all``), in that order."""

    def start(spec: tuple[str, list[str]]) -> StackProcess:
        name, args = spec
        return _start(name, args, log=root / "logs" / f"{name}.log", env=env, timeout=START_TIMEOUT_S)

    return start_all(specs, started, start)


def _stop_all(procs: Sequence[StackProcess], timeout: float) -> None:
    """SIGCONT and SIGTERM each one still running (by its own pid), wait for all, SIGKILL the ones
    still there after ``timeout``."""
    for p in procs:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(10)


def _wait_serving(p: StackProcess, deadline: float) -> None:
    last: object = None
    while True:
        try:
            status = p.health_status(timeout=1.0)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            last = exc
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}; see {p.log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{p.name} not SERVING on {p.health} in time (last: {last}); see {p.log}")
        time.sleep(0.1)


# ---- the stack ----------------------------------------------------------------------------------


@dataclass
class SecureStack:
    """A running secure deployment (``secure_stack``)."""

    root: Path
    pki: StackPki
    workers: list[StackProcess]
    replicas: list[StackProcess]
    tokens: dict[str, str]
    """Bearer token by principal (``victim``, ``attacker``, ``other``; more with ``add_token``)."""
    token_file: Path
    resume_secrets: str
    """``DUPLEX_RESUME_SECRETS`` of every replica (``KID:SECRET``)."""
    worker_ids: list[str]
    """``--worker-id`` of each worker (what placement ranks)."""

    @property
    def processes(self) -> list[StackProcess]:
        return [*self.replicas, *self.workers]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """``http://HOST:PORT/metrics`` by process name (``w0``..., ``r0``...)."""
        return {p.name: p.metrics_url for p in self.processes}

    def bearer(self, principal: str) -> list[tuple[str, str]]:
        """Call metadata authenticating as ``principal``."""
        return [("authorization", f"Bearer {self.tokens[principal]}")]

    def add_token(self, principal: str, token: str | None = None) -> str:
        """Give ``principal`` a (new, random unless given) token, rewriting the token file (the
        replicas re-read it at a call at most a second later); returns the token."""
        self.tokens[principal] = token or secrets.token_urlsafe(24)
        _write_tokens(self.token_file, self.tokens)
        return self.tokens[principal]

    def api_channel(
        self,
        replica: int = 0,
        *,
        principal: str | None = None,
        token: str | None = None,
        own_connection: bool = False,
    ) -> grpc.aio.Channel:
        """A ``grpc.aio`` TLS channel to replica ``replica`` trusting the API CA. Without
        ``principal``/``token`` it carries no credentials (add ``bearer(...)`` metadata per
        call); with one, every call on it sends ``authorization: Bearer`` with that principal's
        token (or ``token`` as is). ``own_connection``: not shared with other channels of the
        process (gRPC shares one connection among alike channels; an attacker opens many).
        Close it (``async with``)."""
        creds = grpc.ssl_channel_credentials(root_certificates=self.pki.api_ca_file.read_bytes())
        bearer = token if token is not None else self.tokens[principal] if principal is not None else None
        if bearer is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(bearer))
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else None
        return grpc.aio.secure_channel(self.replicas[replica].grpc, creds, options=options)

    def worker_channel(
        self, worker: int, identity: str = SESSION_IDENTITY, *, signed_by: trustme.CA | None = None
    ) -> grpc.aio.Channel:
        """A ``grpc.aio`` mutual-TLS channel to worker ``worker`` presenting a certificate of
        ``identity`` (tier CA, or ``signed_by``); made on demand. Close it."""
        tls = self.pki.client(identity, signed_by=signed_by)
        return grpc.aio.secure_channel(self.workers[worker].grpc, ChannelCredentials(tls).current())

    def worker_for(self, session_id: str) -> int:
        """The worker rendezvous placement puts ``session_id`` on while all are healthy."""
        return self.worker_ids.index(rendezvous_pick(session_id, self.worker_ids) or "")

    def stop(self, p: StackProcess) -> None:
        """SIGSTOP ``p`` (a hung process: its sockets stay open, nothing answers)."""
        os.kill(p.pid, signal.SIGSTOP)

    def cont(self, p: StackProcess) -> None:
        """SIGCONT ``p``."""
        os.kill(p.pid, signal.SIGCONT)

    def kill(self, p: StackProcess) -> None:
        """SIGKILL ``p`` and reap it."""
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(10)

    def logs(self) -> dict[str, str]:
        """Every process's log text by name."""
        return {p.name: p.log_text() for p in self.processes}


def _write_tokens(path: Path, tokens: dict[str, str]) -> None:
    lines = ["# principal:sha256(token)", *(f"{who}:{token_digest(t)}" for who, t in tokens.items())]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def secure_stack(
    root: Path,
    *,
    workers: int = 2,
    replicas: int = 1,
    worker_args: Sequence[str] = (),
    session_args: Sequence[str] = (),
) -> Iterator[SecureStack]:
    """Start ``workers`` workers (parallel), then ``replicas`` session replicas (parallel) in
    front of all of them, the README's secure flags plus ``worker_args``/``session_args`` (which
    come last, so they override); yield once every process is SERVING on its health port and
    every replica has every worker healthy. Every process started is gone afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    pki = StackPki.make(root)
    tokens = {who: secrets.token_urlsafe(24) for who in PRINCIPALS}
    token_file = root / "tokens"
    _write_tokens(token_file, tokens)
    resume = f"{RESUME_KID}:{secrets.token_hex(32)}"
    env = {"DUPLEX_RESUME_SECRETS": resume}
    worker_ids = [f"w{i}" for i in range(workers)]
    started: list[StackProcess] = []
    try:
        worker_specs = [
            (
                wid,
                [
                    "worker",
                    *("--model", "parrot", "--device", "cpu", "--torch-threads", "1"),
                    *("--listen", "127.0.0.1:0", "--metrics-port", "0", "--health-listen", "127.0.0.1:0"),
                    *("--tls-cert", str(pki.worker_cert), "--tls-key", str(pki.worker_key)),
                    *("--tls-client-ca", str(pki.tier_ca_file), "--takeover-identities", SESSION_IDENTITY),
                    *("--worker-id", wid, "--drain-grace-s", str(DRAIN_GRACE_S)),
                    *worker_args,
                ],
            )
            for wid in worker_ids
        ]
        ws = _start_all(worker_specs, started, root=root, env=env)
        addresses = ",".join(w.grpc for w in ws)
        replica_specs = [
            (
                f"r{i}",
                [
                    "session",
                    *("--plugin", PARROT, "--workers", addresses),
                    *("--listen", "127.0.0.1:0", "--metrics-port", "0", "--health-listen", "127.0.0.1:0"),
                    *("--tls-cert", str(pki.api_cert), "--tls-key", str(pki.api_key)),
                    *("--auth-tokens", str(token_file)),
                    *("--worker-tls-ca", str(pki.tier_ca_file)),
                    *("--worker-tls-cert", str(pki.session_cert), "--worker-tls-key", str(pki.session_key)),
                    *("--replica-id", f"r{i}", "--drain-grace-s", str(DRAIN_GRACE_S)),
                    *session_args,
                ],
            )
            for i in range(replicas)
        ]
        rs = _start_all(replica_specs, started, root=root, env=env) if replicas else []
        deadline = time.monotonic() + START_TIMEOUT_S
        for p in [*ws, *rs]:
            _wait_serving(p, deadline)
        for r in rs:
            left = max(deadline - time.monotonic(), 1.0)
            wait_metric(r.metrics, "duplex_session_workers_healthy", float(workers), timeout=left)
        yield SecureStack(root, pki, ws, rs, tokens, token_file, resume, worker_ids)
    finally:
        # Replicas first (they drain and release their sessions), then the workers.
        _stop_all([p for p in started if p.args[0] == "session"], STOP_TIMEOUT_S)
        _stop_all([p for p in started if p.args[0] != "session"], STOP_TIMEOUT_S)
