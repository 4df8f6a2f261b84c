"""Trust between the tiers (docs/worker-protocol.md, "Identity and fencing"): mutual TLS, the
fence as an authorization decision, closed sessions, bounded and escaped ids, plaintext kept to
loopback; and the session service reaching workers over mutual TLS, certificates rotating.

Each attack is played against real gRPC servers on loopback (workers and session services in
this process); certificates are made per test with trustme.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme
from prometheus_client import REGISTRY

from duplex.audio import PCM16K_MONO
from duplex.cli import main
from duplex.errors import DuplexError, ErrorCode, FencedError, NotFoundError, from_rpc_error
from duplex.tls import ChannelCredentials, ClientTLS, ServerTLS
from duplex.v1 import session_pb2, worker_pb2, worker_pb2_grpc
from session_service.workers.placement import WorkerPool
from tests.session_helpers import (
    Conversation,
    open_event,
    sample,
    session_server,
    speech,
    utterance_pcm,
    wait_workers_healthy,
    worker_server,
)
from tests.worker_helpers import (
    APPEND,
    FRAME,
    RunClient,
    error_codes,
    fence,
    pcm,
    sub,
    updates_of,
    wait_until,
)
from worker_service.cli import build_parser, config_from_args
from worker_service.config import WorkerConfig
from worker_service.fencing import Admission, FenceTable
from worker_service.server import WorkerServer

FENCED = "duplex_worker_fenced_total"
MAX_ID_LENGTH = 128
"""The bound of every id the worker keeps (``worker_service.fencing.MAX_ID_LENGTH``)."""


# ---- certificates ------------------------------------------------------------------------------


class Pki:
    """One CA and the files of the certificates it issues, under ``root``."""

    def __init__(self, root: Path, ca: trustme.CA | None = None) -> None:
        self.root = root
        self.ca = ca or trustme.CA()

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def server(self, name: str = "worker") -> ServerTLS:
        """A server certificate for 127.0.0.1/localhost; clients must be signed by this CA."""
        d = self._dir(name)
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        cert.cert_chain_pems[0].write_to_path(str(d / "tls.crt"))
        cert.private_key_pem.write_to_path(str(d / "tls.key"))
        self.ca.cert_pem.write_to_path(str(d / "ca.crt"))
        return ServerTLS(cert=d / "tls.crt", key=d / "tls.key", client_ca=d / "ca.crt")

    def client(self, identity: str | None, *, trust: trustme.CA | None = None, name: str = "") -> ClientTLS:
        """A client certificate naming ``identity`` (None: no certificate), trusting ``trust``'s
        (default: this) CA."""
        d = self._dir(name or f"client-{identity}")
        (trust or self.ca).cert_pem.write_to_path(str(d / "ca.crt"))
        if identity is None:
            return ClientTLS(ca=d / "ca.crt")
        cert = self.ca.issue_cert(identity)
        cert.cert_chain_pems[0].write_to_path(str(d / "tls.crt"))
        cert.private_key_pem.write_to_path(str(d / "tls.key"))
        return ClientTLS(ca=d / "ca.crt", cert=d / "tls.crt", key=d / "tls.key")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


class Peers:
    """Channels to a worker as different callers; all closed at the end."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, tls: ClientTLS | None) -> worker_pb2_grpc.DuplexWorkerStub:
        if tls is None:
            channel = grpc.aio.insecure_channel(self.address)
        else:
            channel = grpc.aio.secure_channel(self.address, ChannelCredentials(tls).current())
        self._channels.append(channel)
        return worker_pb2_grpc.DuplexWorkerStub(channel)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


@contextlib.asynccontextmanager
async def mtls_worker(pki: Pki, **config: object) -> AsyncIterator[tuple[WorkerServer, Peers]]:
    async with worker_server(tls=pki.server(), **config) as server:
        peers = Peers(server.address)
        try:
            yield server, peers
        finally:
            await peers.close()


@contextlib.asynccontextmanager
async def plain_worker(
    **config: object,
) -> AsyncIterator[tuple[WorkerServer, worker_pb2_grpc.DuplexWorkerStub]]:
    async with worker_server(**config) as server:
        peers = Peers(server.address)
        try:
            yield server, peers.stub(None)
        finally:
            await peers.close()


async def attach(
    stub: worker_pb2_grpc.DuplexWorkerStub, session: str, owner: str, epoch: int = 1, takeover: bool = False
) -> int:
    resp = await stub.Attach(
        worker_pb2.AttachRequest(session_id=session, epoch=epoch, owner=owner, takeover=takeover), timeout=5
    )
    return int(resp.epoch)


async def refused(call: object) -> DuplexError:
    """The typed error a call that must fail failed with."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return from_rpc_error(err.value)


def noise(frames: int, seed: int = 0) -> bytes:
    return pcm((np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.2).astype(np.float32))


def consumed(request_id: str, seq: int):  # type: ignore[no-untyped-def]
    return lambda m: any(u.request_id == request_id and u.input_seq == seq for u in m.updates)


def fenced(reason: str) -> float:
    return sample(FENCED, {"reason": reason})


NO_AUTO = {"auto_commit": False}


# ---- mutual TLS --------------------------------------------------------------------------------


async def test_plaintext_foreign_and_certificateless_clients_cannot_reach_an_mtls_worker(pki: Pki) -> None:
    async with mtls_worker(pki) as (_, peers):
        ok = await peers.stub(pki.client("replica-a")).Describe(worker_pb2.DescribeRequest(), timeout=5)
        assert ok.model_id == "parrot"
        stranger = Pki(pki.root / "stranger")
        callers = {
            "plaintext": None,
            "no certificate": pki.client(None),
            "another CA": stranger.client("replica-a", trust=pki.ca),
        }
        for name, tls in callers.items():
            err = await refused(peers.stub(tls).Describe(worker_pb2.DescribeRequest(), timeout=5))
            assert err.status == grpc.StatusCode.UNAVAILABLE, name


async def test_another_identity_cannot_replace_an_owners_run_stream(pki: Pki) -> None:
    async with mtls_worker(pki) as (server, peers):
        victim_stub = peers.stub(pki.client("replica-a"))
        attacker_stub = peers.stub(pki.client("intruder"))
        assert await attach(victim_stub, "s1", "replica-1") == 1
        victim = RunClient(victim_stub, "replica-1")
        victim.send(sub("r1", "s1", APPEND, seq=1, data=noise(2), params=NO_AUTO))
        await victim.until(consumed("r1", 1))
        # The attacker knows the victim's owner id (it is logged) and opens a Run stream with it,
        # then attaches a session of its own under it.
        attacker = RunClient(attacker_stub, "replica-1")
        assert await attach(attacker_stub, "s2", "replica-1") == 1
        attacker.send(sub("r2", "s2", APPEND, seq=1, data=noise(2, seed=1), params=NO_AUTO))
        mine = await attacker.until(consumed("r2", 1))
        # The victim's stream was not replaced: it keeps working and keeps receiving its output.
        victim.send(sub("r1", "s1", APPEND, seq=2, data=noise(3, seed=2)))
        got = await victim.until(consumed("r1", 2))
        assert error_codes(got, "r1") == []
        mine += await attacker.quiet(0.3)
        # The attacker's stream carries its own owner's output only.
        assert {e.request_id for m in mine for e in m.batch} == {"r2"}
        assert updates_of(mine, "r1") == []
        assert server.fences.owner_of("s1") == "replica-a/replica-1"
        assert server.fences.owner_of("s2") == "intruder/replica-1"
        victim.close()
        attacker.close()


async def test_a_higher_epoch_without_takeover_changes_nothing(pki: Pki) -> None:
    async with mtls_worker(pki) as (server, peers):
        victim_stub = peers.stub(pki.client("replica-a"))
        assert await attach(victim_stub, "s1", "replica-1", epoch=3) == 3
        victim = RunClient(victim_stub, "replica-1")
        before = fenced("not_owner")
        for identity, owner in (("intruder", "replica-1"), ("replica-a", "replica-2")):
            stub = peers.stub(pki.client(identity))
            for epoch in (3, 4, 1000):
                err = await refused(attach(stub, "s1", owner, epoch=epoch))
                assert (err.status, err.code) == (grpc.StatusCode.FAILED_PRECONDITION, "not_owner"), (
                    identity,
                    owner,
                    epoch,
                )
        assert fenced("not_owner") - before == 6
        # The victim's session keeps its owner and its epoch: its work at epoch 3 runs.
        assert server.fences.owner_of("s1") == "replica-a/replica-1"
        victim.send(sub("r1", "s1", APPEND, epoch=3, seq=1, data=noise(2)))
        got = await victim.until(consumed("r1", 1))
        assert error_codes(got, "r1") == []
        resp = await victim_stub.Attach(
            worker_pb2.AttachRequest(session_id="s1", epoch=3, owner="replica-1"), timeout=5
        )
        assert (resp.epoch, resp.resumed) == (3, True)
        victim.close()


async def test_only_an_allowed_identity_can_take_a_session_over(pki: Pki) -> None:
    allowed = frozenset({"replica-a", "replica-b"})
    # "intruder" may own sessions of its own here, but not take anyone's over.
    owners = allowed | {"intruder"}
    async with mtls_worker(pki, takeover_identities=allowed, session_identities=owners) as (server, peers):
        victim_stub = peers.stub(pki.client("replica-a"))
        assert await attach(victim_stub, "s1", "replica-1") == 1
        victim = RunClient(victim_stub, "replica-1")
        victim.send(sub("r1", "s1", APPEND, seq=1, data=noise(2), params=NO_AUTO))
        await victim.until(consumed("r1", 1))
        denied = fenced("takeover_denied")
        stranger = peers.stub(pki.client("intruder"))
        err = await refused(attach(stranger, "s1", "replica-9", epoch=50, takeover=True))
        assert (err.status, err.code) == (grpc.StatusCode.FAILED_PRECONDITION, "not_owner")
        assert fenced("takeover_denied") - denied == 1
        # Nothing changed for the victim.
        assert server.fences.owner_of("s1") == "replica-a/replica-1"
        victim.send(sub("r1", "s1", APPEND, seq=2, data=noise(2, seed=3)))
        got = await victim.until(consumed("r1", 2))
        assert error_codes(got, "r1") == []
        # A session replica allowed to take over does (that is how sessions move between replicas);
        # the old owner hears at once.
        other = peers.stub(pki.client("replica-b"))
        assert await attach(other, "s1", "replica-2", epoch=1, takeover=True) == 2
        assert server.fences.owner_of("s1") == "replica-b/replica-2"
        told = await victim.until(lambda m: bool(error_codes([m], "r1")))
        assert error_codes(told, "r1") == ["not_owner"]
        victim.close()


async def test_only_the_session_tiers_identities_may_attach_run_or_release(pki: Pki) -> None:
    """A CA signs many services: an identity not listed (``--takeover-identities``, the same list
    unless ``--session-identities`` sets it apart) can neither attach (no tombstone, no fence at
    the top epoch, no squatted capacity) nor open a Run stream (no Release)."""
    async with mtls_worker(pki, takeover_identities=frozenset({"replica-a"}), max_sessions=2) as (
        server,
        peers,
    ):
        owner = peers.stub(pki.client("replica-a"))
        assert await attach(owner, "s1", "replica-1") == 1
        denied = fenced("identity_not_allowed")
        stranger = peers.stub(pki.client("other-service"))
        for sid, epoch, takeover in (
            ("s1", 2**64 - 1, False),
            ("s1", 5, True),
            ("s2", 1, False),
            ("s3", 1, False),
        ):
            err = await refused(attach(stranger, sid, "x", epoch=epoch, takeover=takeover))
            assert (err.status, err.code) == (grpc.StatusCode.PERMISSION_DENIED, "identity_not_allowed")
        run = RunClient(stranger, "x")
        run.send(releases=(worker_pb2.Release(request_id="s1", fence=fence("s1", 1), closed=True),))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await run.recv()
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert fenced("identity_not_allowed") - denied == 5
        # Nothing of it took hold: the session is its owner's, not closed, and capacity is free.
        assert server.fences.owner_of("s1") == "replica-a/replica-1" and not server.fences.is_closed("s1")
        assert server.fences.live_sessions == 1
        assert await attach(owner, "s2", "replica-1") == 1


async def test_an_epoch_above_what_a_takeover_can_pass_is_refused() -> None:
    async with plain_worker() as (server, stub):
        err = await refused(attach(stub, "s1", "a", epoch=2**63))
        assert (err.status, err.code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
        assert await attach(stub, "s1", "a", epoch=2**63 - 1) == 2**63 - 1
        # The highest epoch a caller may ask for still leaves room to take the session over.
        assert await attach(stub, "s1", "b", epoch=1, takeover=True) == 2**63
        run = RunClient(stub, "b")
        run.send(sub("r1", "s1", APPEND, seq=1, data=noise(1), epoch=2**64 - 1))
        got = await run.until(lambda m: bool(error_codes([m], "r1")))
        assert error_codes(got, "r1") == ["bad_submission"]
        assert server.fences.current("s1") == (2**63, "b")
        run.close()


async def test_by_default_any_identity_of_the_client_ca_may_take_over(pki: Pki) -> None:
    async with mtls_worker(pki) as (server, peers):
        assert await attach(peers.stub(pki.client("replica-a")), "s1", "replica-1") == 1
        assert await attach(peers.stub(pki.client("replica-b")), "s1", "replica-2", takeover=True) == 2
        assert server.fences.owner_of("s1") == "replica-b/replica-2"


async def test_an_owner_id_cannot_smuggle_an_identity(pki: Pki) -> None:
    # "replica-a" + "/x" must not become the owner key of identity "replica-a/x" (or the reverse).
    async with mtls_worker(pki) as (_, peers):
        stub = peers.stub(pki.client("replica-a"))
        err = await refused(attach(stub, "s1", "x/replica-1"))
        assert (err.status, err.code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
        run = RunClient(stub, "x/replica-1")
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await run.recv()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- closed sessions ---------------------------------------------------------------------------


async def test_a_closed_session_stays_closed_and_a_plain_release_does_not_tombstone() -> None:
    async with plain_worker() as (server, stub):
        for s in ("closed", "moved"):
            assert await attach(stub, s, "o1") == 1
        run = RunClient(stub, "o1")
        run.send(
            releases=(
                worker_pb2.Release(request_id="closed", fence=fence("closed"), closed=True),
                worker_pb2.Release(request_id="moved", fence=fence("moved")),
            )
        )
        await wait_until(lambda: server.fences.live_sessions == 0)
        before = fenced("session_closed")
        for owner, takeover in (("o1", False), ("o1", True), ("o2", True), ("o2", False)):
            err = await refused(attach(stub, "closed", owner, epoch=9, takeover=takeover))
            assert (err.status, err.code) == (grpc.StatusCode.NOT_FOUND, "session_closed"), (owner, takeover)
        assert fenced("session_closed") - before == 4
        # A plain release: the session may come back (here, to its owner).
        resp = await stub.Attach(worker_pb2.AttachRequest(session_id="moved", epoch=1, owner="o1"), timeout=5)
        assert (resp.epoch, resp.resumed) == (1, False)
        run.close()


async def test_only_the_owner_closes_a_session(pki: Pki) -> None:
    async with mtls_worker(pki) as (server, peers):
        victim_stub = peers.stub(pki.client("replica-a"))
        assert await attach(victim_stub, "s1", "replica-1") == 1
        attacker = RunClient(peers.stub(pki.client("intruder")), "replica-1")
        attacker.send(releases=(worker_pb2.Release(request_id="s1", fence=fence("s1", 5), closed=True),))
        victim = RunClient(victim_stub, "replica-1")
        victim.send(sub("r1", "s1", APPEND, seq=1, data=noise(2)))
        await victim.until(consumed("r1", 1))
        assert server.fences.owner_of("s1") == "replica-a/replica-1"
        assert not server.fences.is_closed("s1")
        attacker.close()
        victim.close()


def test_tombstones_expire_and_are_bounded() -> None:
    now = [0.0]
    table = FenceTable(tombstone_ttl_s=100.0, max_closed=2, clock=lambda: now[0])
    for i, s in enumerate(("a", "b", "c")):
        table.attach(s, 1, "o", False)
        now[0] = float(i)
        assert table.close(s, 1, "o") is True
    # Three closed, two kept: the oldest was evicted.
    assert [table.is_closed(s) for s in ("a", "b", "c")] == [False, True, True]
    with pytest.raises(NotFoundError) as err:
        table.attach("b", 7, "o2", True)
    assert err.value.code == ErrorCode.SESSION_CLOSED
    now[0] = 101.5  # b (closed at 1) is past its time, c (closed at 2) is not
    assert not table.is_closed("b") and table.is_closed("c")
    admission, was_live = table.attach("b", 1, "o", False)
    assert (admission.epoch, was_live) == (1, False)


def test_an_owners_input_outlives_its_cancel_and_nothing_else_does() -> None:
    table = FenceTable()
    table.attach("s", 1, "o", False)
    # The owner's cancel (keep_input): its input of epoch 1 still comes in, under epoch 2; not
    # its RESPOND, and not anyone else's input.
    assert table.check("s", 2, "o", keep_input=True).bumped
    assert table.check("s", 1, "o", is_input=True) == Admission(2, bumped=False)
    with pytest.raises(FencedError):
        table.check("s", 1, "o")
    with pytest.raises(FencedError):
        table.check("s", 1, "other", is_input=True)
    # A raise without it (a submission ahead of its abort) ends that: epoch 1 and 2 input refused.
    assert table.check("s", 3, "o").bumped
    for epoch in (1, 2):
        with pytest.raises(FencedError):
            table.check("s", epoch, "o", is_input=True)
    # So does any Attach, even the owner's own at its epoch (a move replays its input itself).
    assert table.check("s", 4, "o", keep_input=True).bumped
    table.attach("s", 4, "o", False)
    with pytest.raises(FencedError):
        table.check("s", 3, "o", is_input=True)


# ---- ids: bounded, escaped in logs -------------------------------------------------------------


async def test_ids_are_logged_escaped(caplog: pytest.LogCaptureFixture) -> None:
    forged = "\n2030-01-01 00:00:00,000 WARNING worker_service: FORGED"
    owner, session = "o1" + forged, "s1" + forged
    caplog.set_level(logging.INFO, logger="worker_service")
    async with plain_worker(orphan_grace_s=0.05) as (server, stub):
        assert await attach(stub, session, owner) == 1
        run = RunClient(stub, owner)
        run.send(sub("r1", session, APPEND, seq=1, data=noise(1)))
        await run.until(consumed("r1", 1))
        assert await attach(stub, "s2", owner) == 1
        assert await attach(stub, "s2", "o2" + forged, takeover=True) == 2  # a takeover is logged
        run.close()
        await wait_until(lambda: server.fences.live_sessions == 1)  # the orphan reap is logged
    records = [r for r in caplog.records if r.name.startswith("worker_service")]
    assert records
    for r in records:
        assert "\n" not in r.getMessage(), r.getMessage()
    escaped = [r.getMessage() for r in records if "\\n2030-01-01" in r.getMessage()]
    assert any("releasing" in m and repr(owner) in m for m in escaped), escaped
    assert any("taken over" in m and repr("o2" + forged) in m for m in escaped), escaped


async def test_over_long_ids_are_refused() -> None:
    from worker_service import fencing

    assert getattr(fencing, "MAX_ID_LENGTH", None) == MAX_ID_LENGTH
    long = "x" * (MAX_ID_LENGTH + 1)
    ok = "y" * MAX_ID_LENGTH
    async with plain_worker() as (server, stub):
        for session, owner in ((long, "o1"), ("s1", long)):
            err = await refused(attach(stub, session, owner))
            assert (err.status, err.code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
        # The request id an Attach names (kept for a takeover notice) is bounded alike.
        req = worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1", request_id=long)
        err = await refused(stub.Attach(req, timeout=5))
        assert (err.status, err.code) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_event")
        assert server.fences.current("s1") is None
        assert await attach(stub, ok, ok) == 1
        run = RunClient(stub, ok)
        run.send(
            sub(long, ok, APPEND, seq=1, data=noise(1)),
            sub("r1", long, APPEND, seq=1, data=noise(1)),
            sub(ok, ok, APPEND, seq=1, data=noise(1)),
        )
        got = await run.until(consumed(ok, 1))
        got += await run.quiet(0.2)
        codes = [u.error.code for m in got for u in m.updates if u.error.code]
        assert codes == ["bad_submission", "bad_submission"]
        assert all(len(u.request_id) <= MAX_ID_LENGTH for m in got for u in m.updates)
        assert all(len(u.fence.session_id) <= MAX_ID_LENGTH for m in got for u in m.updates)
        assert server.fences.owner_of(long) is None
        run.close()
        bad = RunClient(stub, long)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await bad.recv()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- plaintext only on loopback ----------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the CLI configures logging
    try:
        code = main(["worker", *argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
def test_plaintext_off_loopback_is_refused_without_insecure(
    capsys: pytest.CaptureFixture[str], pki: Pki
) -> None:
    code, out, err = _cli(["--listen", "0.0.0.0:0", "--device", "cpu", "--metrics-port", "0"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--insecure" in err, err
    # Server-only TLS authenticates nobody: the same rule.
    tls = pki.server()
    code, out, err = _cli(
        ["--listen", "0.0.0.0:0", "--device", "cpu", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)],
        capsys,
    )
    assert code == 2 and "--insecure" in err, err
    bad_flags = (
        ["--tls-cert", str(tls.cert)],
        ["--tls-client-ca", str(tls.client_ca)],
        ["--takeover-identities", "replica-a"],
        ["--tls-cert", str(tls.cert), "--tls-key", str(pki.root / "missing.key")],
        ["--tombstone-ttl-s", "0"],
    )
    for flags in bad_flags:
        code, out, err = _cli(["--device", "cpu", *flags], capsys)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (flags, err)


def test_worker_tls_flags_make_the_config(pki: Pki) -> None:
    tls = pki.server()
    args = [
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        "--tls-client-ca",
        str(tls.client_ca),
        "--takeover-identities",
        "replica-a, replica-b",
        "--tombstone-ttl-s",
        "60",
    ]
    cfg = config_from_args(build_parser().parse_args(args))
    assert cfg.tls == tls and cfg.takeover_identities == frozenset({"replica-a", "replica-b"})
    assert cfg.tombstone_ttl_s == 60 and not cfg.insecure
    plain = config_from_args(build_parser().parse_args(["--listen", "0.0.0.0:0", "--insecure"]))
    assert plain.insecure and plain.tls is None and plain.tombstone_ttl_s == 24 * 3600


async def test_plaintext_off_loopback_starts_with_insecure() -> None:
    with pytest.raises(DuplexError) as err:
        WorkerServer(WorkerConfig(listen="0.0.0.0:0", device="cpu", metrics_port=-1))
    assert err.value.code == "invalid_config"
    async with worker_server(listen="0.0.0.0:0", insecure=True) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            desc = await worker_pb2_grpc.DuplexWorkerStub(channel).Describe(
                worker_pb2.DescribeRequest(), timeout=5
            )
        assert desc.model_id == "parrot"


@pytest.mark.process
def test_worker_process_serves_mutual_tls_off_loopback(pki: Pki) -> None:
    import grpc as sync_grpc

    from tests.worker_helpers import worker_process

    tls = pki.server()
    flags = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-client-ca", str(tls.client_ca)]
    with worker_process("--listen", "0.0.0.0:0", "--device", "cpu", "--torch-threads", "1", *flags) as (
        _,
        info,
    ):
        port = info["grpc"].rpartition(":")[2]
        creds = ChannelCredentials(pki.client("replica-a")).current()
        with sync_grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            desc = worker_pb2_grpc.DuplexWorkerStub(channel).Describe(
                worker_pb2.DescribeRequest(), timeout=10
            )
        assert desc.model_id == "parrot"
        with sync_grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(sync_grpc.RpcError) as err:
                worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
            assert err.value.code() == sync_grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


# ---- the session service over mutual TLS -------------------------------------------------------


async def _one_turn(target: str) -> str:
    """Open a session, say something, get the parrot's reply; returns the session id."""
    async with grpc.aio.insecure_channel(target) as ch:
        conv = Conversation(ch).start(open_event())
        sid = (await conv.wait_kind("opened")).opened.session_id
        await conv.stream(utterance_pcm(speech(3), PCM16K_MONO), PCM16K_MONO, speedup=8)
        done = (await conv.wait_kind("response_done", within=30)).response_done
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
        reply = b"".join(e.audio_delta.pcm for e in conv.of("audio_delta"))
        committed_ms = conv.of("committed")[0].committed.audio_ms
        # The parrot's reply is as long as the committed utterance.
        assert abs(len(reply) / 32 - committed_ms) < 40, (len(reply) / 32, committed_ms)
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done()
    return str(sid)


async def test_a_session_service_converses_through_an_mtls_worker(pki: Pki) -> None:
    async with mtls_worker(pki) as (worker, _):
        async with session_server(
            [worker.address], worker_tls=pki.client("replica-a"), clock_speed=4.0
        ) as session:
            sid = await asyncio.wait_for(_one_turn(session.address), 60)
            assert sid
            # The worker knew the replica by its certificate.
            assert any(k.startswith("replica-a/") for k in worker.owners())


async def test_rotated_certificates_are_used_after_a_reconnect(pki: Pki) -> None:
    worker_tls = pki.server()
    replica_tls = pki.client("replica-a")
    async with contextlib.AsyncExitStack() as exits:
        first = await exits.enter_async_context(worker_server(tls=worker_tls))
        port = first.port
        session = await exits.enter_async_context(
            session_server([first.address], worker_tls=replica_tls, clock_speed=4.0)
        )
        await wait_until(lambda: any(k.startswith("replica-a/") for k in first.owners()))
        # Both Secrets rotate to certificates of a new CA; the worker restarts on them (same
        # address). The replica's old credentials cannot reach it: only new ones can.
        new = Pki(pki.root / "rotated")
        new_worker = new.server()
        new_client = new.client("replica-a-rotated")
        for src, dst in (
            (new_worker.cert, worker_tls.cert),
            (new_worker.key, worker_tls.key),
            (new_worker.client_ca, worker_tls.client_ca),
            (new_client.ca, replica_tls.ca),
            (new_client.cert, replica_tls.cert),
            (new_client.key, replica_tls.key),
        ):
            assert src is not None and dst is not None
            dst.write_bytes(src.read_bytes())
        await asyncio.wait_for(first.stop(grace=0.2), 30)
        await wait_workers_healthy(session, 0, exactly=True)
        second = await exits.enter_async_context(worker_server(tls=worker_tls, listen=f"127.0.0.1:{port}"))
        await wait_workers_healthy(session, 1)
        # The worker knows the replica by its new certificate (once it has read the stream's
        # first command; the link counts as healthy as soon as it has written it).
        await wait_until(lambda: any(k.startswith("replica-a-rotated/") for k in second.owners()))
        assert not any(k.startswith("replica-a/") for k in second.owners())
        await asyncio.wait_for(_one_turn(session.address), 60)


async def test_placement_passes_session_closed_through() -> None:
    class ClosedLink:
        address = "w:1"
        worker_id = "w-1"
        generation = 1
        healthy = True

        def start(self) -> None: ...

        async def close(self) -> None: ...

        async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
            raise NotFoundError(ErrorCode.SESSION_CLOSED, "the session was closed")

    pool: WorkerPool[ClosedLink] = WorkerPool(["w:1"], link_factory=lambda a, h: ClosedLink())
    with pytest.raises(DuplexError) as err:
        await pool.place("s1", 1, True)
    assert err.value.code == "session_closed"


def test_refusal_reasons_are_precreated() -> None:
    for reason in ("not_owner", "takeover_denied", "session_closed"):
        assert REGISTRY.get_sample_value(FENCED, {"reason": reason}) is not None, reason


def test_session_worker_tls_flags_make_the_config(pki: Pki) -> None:
    from session_service.api.cli import config_from_args as session_config

    tls = pki.client("replica-a")
    assert tls.cert is not None and tls.key is not None
    base = ["--workers", "127.0.0.1:1"]
    cfg = session_config(
        [
            *base,
            "--worker-tls-ca",
            str(tls.ca),
            "--worker-tls-cert",
            str(tls.cert),
            "--worker-tls-key",
            str(tls.key),
        ]
    )
    assert cfg.worker_tls == tls
    assert session_config(base).worker_tls is None
    for flags in (
        ["--worker-tls-cert", str(tls.cert)],
        ["--worker-tls-ca", str(tls.ca), "--worker-tls-key", str(tls.key)],
    ):
        with pytest.raises(SystemExit):
            session_config([*base, *flags])
