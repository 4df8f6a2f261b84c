"""Workers discovered through DNS, placed by their own ids.

- ``--workers`` is a static ``HOST:PORT`` list or one ``dns:[//SERVER/]NAME:PORT`` target;
  anything else is refused with a line naming what is wrong.
- The resolver reads A and AAAA records from a REAL DNS server on loopback (``tests.dns_server``,
  dnslib) whose answers the tests change; NXDOMAIN and no records are empty answers, SERVFAIL
  and silence are failures; neither changes the workers (a DNS outage never takes workers
  away); an answer is bounded (unusable addresses skipped, at most ``max_workers``).
- Placement is rendezvous over worker ids: every replica agrees whatever addresses it dials;
  one link per worker id holds a Run stream (the lowest address, a serving one never cut).
- With in-process workers on 127.0.0.2, .3, .4 (one port, as a headless Service has): a worker
  added to DNS takes new sessions with no restart; one removed loses only its own sessions,
  which move at their next turn; a worker back under its id at a new address keeps its slot
  and is found at once because its link was lost (the periodic interval is a minute there);
  two workers under one id never both take sessions; TLS checks the resolved name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from prometheus_client import REGISTRY

from duplex.audio import PCM16K_MONO
from duplex.tls import ClientTLS, ServerTLS
from duplex.v1 import session_pb2
from session_service.api.cli import config_from_args
from session_service.api.server import SessionServer
from session_service.metrics import WORKER_STALLS, WORKER_TICK_COMMANDS, WORKER_TICK_LEAD
from session_service.workers.discovery import (
    DiscoveryError,
    DnsResolver,
    DnsTarget,
    IPAddress,
    WorkerDiscovery,
    WorkersSpecError,
    parse_workers,
)
from session_service.workers.link import WorkerLink
from session_service.workers.placement import WorkerPool, rendezvous_pick
from tests.dns_server import dns_server
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
from worker_service.server import WorkerServer

NAME = "workers.duplex.test"
RESOLUTIONS = "duplex_session_worker_resolutions_total"
RUNNER = {"idle_timeout_s": 60}


# ---- --workers ---------------------------------------------------------------------------------


def test_workers_is_a_static_list_or_one_dns_target() -> None:
    assert parse_workers(["w0:50052", "w1:50052", "w0:50052"]) == ("w0:50052", "w1:50052")
    assert parse_workers(["[::1]:7"]) == ("[::1]:7",)
    assert parse_workers([f"dns:///{NAME}:50052"]) == DnsTarget(NAME, 50052)
    assert parse_workers([f"dns:{NAME}:50052"]) == DnsTarget(NAME, 50052)
    assert parse_workers([f"dns://10.96.0.10/{NAME}.:1"]) == DnsTarget(NAME + ".", 1, ("10.96.0.10", 53))
    assert parse_workers([f"dns://127.0.0.1:5353/{NAME}:1"]) == DnsTarget(NAME, 1, ("127.0.0.1", 5353))
    assert parse_workers([f"dns://[::1]:5353/{NAME}:1"]) == DnsTarget(NAME, 1, ("::1", 5353))
    assert parse_workers([f"DNS:///{NAME}:2"]) == DnsTarget(NAME, 2)
    for spec in (f"dns:///{NAME}:50052", f"dns://127.0.0.1:5353/{NAME}:1", f"dns://[::1]:53/{NAME}.:1"):
        assert str(parse_workers([spec])) == spec
    assert DnsTarget(NAME + ".", 1).host == NAME  # what a worker's certificate names


@pytest.mark.parametrize(
    ("workers", "why"),
    [
        ([], "at least one"),
        (["w0"], "HOST:PORT"),
        (["w0:0"], "1 to 65535"),
        (["w0:x"], "1 to 65535"),
        ([f"dns:///{NAME}"], "NAME:PORT"),
        ([f"dns:///{NAME}:70000"], "1 to 65535"),
        ([f"dns://resolver.local/{NAME}:1"], "must be an IP address"),
        ([f"dns://127.0.0.1:99999/{NAME}:1"], "1 to 65535"),
        ([f"dns://127.0.0.1{NAME}:1"], "dns://"),
        (["dns:///bad name:1"], "not a DNS name"),
        (["dns:///a..b:1"], "not a DNS name"),
        (["dns:///-a.b:1"], "not a DNS name"),
        ([f"dns:///{'x' * 64}.b:1"], "not a DNS name"),
        (["dns:///10.0.0.1:1"], "an address, not a name"),
        ([f"dns:///{NAME}:1", "w0:1"], "not both"),
        ([f"w{i}:1" for i in range(5)], "more than --max-workers 4"),
    ],
)
def test_a_bad_workers_value_is_refused_with_the_reason(workers: list[str], why: str) -> None:
    with pytest.raises(WorkersSpecError, match=why):
        parse_workers(workers, max_workers=4)


def test_the_command_line_takes_a_dns_target_and_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUPLEX_RESUME_SECRETS", raising=False)
    target = f"dns:///{NAME}:50052"
    cfg = config_from_args(["--workers", target, "--workers-resolve-interval-s", "2.5", "--max-workers", "8"])
    assert (cfg.workers, cfg.workers_resolve_interval_s, cfg.max_workers) == ((target,), 2.5, 8)
    cfg = config_from_args(["--workers", "w0:50052, w1:50052"])  # a static list, as before
    assert (cfg.workers, cfg.workers_resolve_interval_s, cfg.max_workers) == (
        ("w0:50052", "w1:50052"),
        10,
        64,
    )
    for bad in (
        ["--workers", "dns:///x:1,w0:1"],
        ["--workers", "dns:///x"],
        ["--workers", "w0:1", "--max-workers", "0"],
        ["--workers", "w0:1", "--workers-resolve-interval-s", "0"],
    ):
        with pytest.raises(SystemExit):
            config_from_args(bad)


# ---- resolution, against a real DNS server -----------------------------------------------------


async def test_the_resolver_reads_a_and_aaaa_records_from_the_server_named() -> None:
    with dns_server() as (zone, port):
        target = DnsTarget(NAME, 50052, ("127.0.0.1", port))
        resolve = DnsResolver(target, timeout_s=0.5)
        zone.set(NAME, ["127.0.0.3", "127.0.0.2", "fd00::5"])
        assert sorted(map(str, await resolve())) == ["127.0.0.2", "127.0.0.3", "fd00::5"]
        assert zone.queries[(NAME + ".", "A")] == 1 and zone.queries[(NAME + ".", "AAAA")] == 1
        # A trailing dot (absolute) is the same name; asked once per resolution (no cache).
        absolute = DnsResolver(DnsTarget(NAME + ".", 50052, ("127.0.0.1", port)), timeout_s=0.5)
        assert len(await absolute()) == 3 and zone.asked(NAME) == 4
        zone.set(NAME, [])  # the name exists, no records
        assert await resolve() == []
        zone.remove(NAME)  # NXDOMAIN
        assert await resolve() == []
        zone.fail = True  # SERVFAIL
        with pytest.raises(DiscoveryError, match="no server answered"):
            await resolve()
        zone.fail, zone.drop = False, True  # no answer at all
        with pytest.raises(DiscoveryError, match="timed out"):
            await resolve()


async def test_discovery_applies_changes_only_and_keeps_the_workers_through_failures() -> None:
    applied: list[tuple[str, ...]] = []

    async def apply(addresses: Sequence[str]) -> None:
        applied.append(tuple(addresses))

    before = {r: sample(RESOLUTIONS, {"result": r}) for r in ("ok", "empty", "failed")}
    with dns_server() as (zone, port):
        target = DnsTarget(NAME, 50052, ("127.0.0.1", port))
        discovery = WorkerDiscovery(
            target, apply, interval_s=60, max_workers=3, resolve=DnsResolver(target, timeout_s=0.5)
        )
        zone.set(NAME, ["127.0.0.3", "127.0.0.2"])
        assert await discovery.refresh()
        assert applied == [("127.0.0.2:50052", "127.0.0.3:50052")]  # sorted: order-independent
        zone.set(NAME, ["127.0.0.2", "127.0.0.3"])
        assert await discovery.refresh() and len(applied) == 1  # the same set: nothing to do
        # Failures and empty answers leave the workers as they are.
        zone.fail = True
        assert not await discovery.refresh()
        zone.fail = False
        zone.remove(NAME)
        assert not await discovery.refresh()
        zone.set(NAME, [])
        assert not await discovery.refresh()
        assert len(applied) == 1 and discovery.addresses == applied[0]
        # Bounded: no address no worker can listen at; at most max_workers, the lowest.
        zone.set(NAME, ["0.0.0.0", "224.0.0.1", "fe80::1", "::", "127.0.0.2"])
        assert await discovery.refresh() and applied[-1] == ("127.0.0.2:50052",)
        zone.set(NAME, [f"127.0.0.{i}" for i in range(12, 1, -1)])
        assert await discovery.refresh() and applied[-1] == tuple(f"127.0.0.{i}:50052" for i in (2, 3, 4))
        zone.set(NAME, ["::1"])
        assert await discovery.refresh() and applied[-1] == ("[::1]:50052",)
    after = {r: sample(RESOLUTIONS, {"result": r}) - before[r] for r in before}
    assert after == {"ok": 5, "empty": 2, "failed": 1}


async def test_an_answer_the_pool_could_not_take_is_applied_again_next_time() -> None:
    applied: list[tuple[str, ...]] = []

    async def apply(addresses: Sequence[str]) -> None:
        applied.append(tuple(addresses))
        if len(applied) == 1:
            raise RuntimeError("the pool failed")

    async def resolve() -> list[IPAddress]:
        return [ipaddress.ip_address("127.0.0.2")]

    discovery = WorkerDiscovery(DnsTarget(NAME, 1), apply, resolve=resolve)
    with pytest.raises(RuntimeError):
        await discovery.refresh()
    assert discovery.addresses == ()
    assert await discovery.refresh() and applied == [("127.0.0.2:1",)] * 2


async def test_a_nudge_resolves_at_once_but_never_more_often_than_the_minimum_interval() -> None:
    times: list[float] = []
    fail = False

    async def resolve() -> list[IPAddress]:
        times.append(time.monotonic())
        if fail:
            raise DiscoveryError("down")
        return [ipaddress.ip_address("127.0.0.2")]

    async def apply(addresses: Sequence[str]) -> None:
        pass

    async def resolutions(n: int) -> None:
        await _until(lambda: len(times) >= n, within=5, what=f"{n} resolutions")

    discovery = WorkerDiscovery(DnsTarget(NAME, 1), apply, interval_s=60, min_interval_s=0.3, resolve=resolve)
    discovery.start()
    try:
        await resolutions(1)
        discovery.nudge()  # a link was lost: look again, but not within 0.3 s of the last look
        await resolutions(2)
        assert 0.28 <= times[1] - times[0] < 5.0  # soon, not the interval's minute away
        for _ in range(20):  # a burst of losses
            discovery.nudge()
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
        # The burst was looked at, and never more often than the minimum interval (spacing,
        # not a count: a late loop stretches the burst, and so the looks it may have).
        assert len(times) >= 3, len(times)
        assert all(b - a >= 0.28 for a, b in itertools.pairwise(times))
        # Nobody nudges: the next look is a minute away.
        settled = len(times)
        await asyncio.sleep(0.7)
        assert len(times) == settled
        # A failed look is retried with backoff from the minimum interval, without a nudge.
        fail = True
        discovery.nudge()
        await resolutions(settled + 3)
        gaps = [b - a for a, b in itertools.pairwise(times[settled:])]
        # 0.3 s, then 0.6 s. Lower bounds only: a late loop lengthens a gap, never shortens it.
        assert gaps[0] >= 0.28 and gaps[1] >= 0.58, gaps
    finally:
        await discovery.close()


# ---- the pool: one link per worker id, membership changes --------------------------------------


class _Link:
    """A link as the pool sees it; ``describe`` plays the link's Describe and claim."""

    def __init__(self, address: str, on_health: Callable[[], None]) -> None:
        self.address = address
        self.on_health = on_health
        self.worker_id: str | None = None
        self.healthy = False
        self.generation = 1
        self.started = self.closed = False
        self.pool: WorkerPool[_Link] | None = None

    def describe(self, worker_id: str) -> bool:
        """The worker answered as ``worker_id``: the link asks for its stream (healthy if granted)."""
        assert self.pool is not None
        self.worker_id = worker_id
        self.healthy = self.pool.claim(self, worker_id)
        return self.healthy

    def lose(self) -> None:
        assert self.pool is not None
        self.healthy, self.worker_id = False, None
        self.pool.release(self)

    def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True
        self.healthy = False
        self.on_health()

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
        return epoch


def _pool(addresses: Sequence[str]) -> WorkerPool[_Link]:
    pool = WorkerPool(addresses, link_factory=_Link)
    for link in pool.links.values():
        link.pool = pool
    return pool


def test_one_link_per_worker_id_the_lowest_address_and_a_serving_one_is_never_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _pool(["10.0.0.2:1", "10.0.0.1:1", "10.0.0.3:1", "10.0.0.0:1"])
    low, high = pool.links["10.0.0.1:1"], pool.links["10.0.0.2:1"]
    # Both answer as worker-a; the higher one asks first but the lower one is up: it waits.
    low.worker_id = "worker-a"
    with caplog.at_level("WARNING", logger="session_service.workers.placement"):
        assert not high.describe("worker-a")
        assert not high.describe("worker-a")  # asking again: logged once
    assert len([r for r in caplog.records if "stands by" in r.getMessage()]) == 1
    assert low.describe("worker-a")
    assert [link.address for link in pool.healthy()] == [low.address]
    # One serves worker-b from the higher address; a lower one showing up later waits.
    third, lowest = pool.links["10.0.0.3:1"], pool.links["10.0.0.0:1"]
    assert third.describe("worker-b")
    assert not lowest.describe("worker-b")
    # Once the serving link goes, the lowest address serves, and the other one waits.
    third.lose()
    third.worker_id = "worker-b"  # its worker answers again
    assert not third.describe("worker-b")
    assert lowest.describe("worker-b")
    assert {link.address for link in pool.healthy()} == {low.address, lowest.address}
    assert {link.worker_id: link.address for link in pool.placeable().values()} == {
        "worker-a": low.address,
        "worker-b": lowest.address,
    }
    # A link refused and lost, and a worker that reports a new id (same address): fine.
    assert low.describe("worker-c") and pool.placeable()["worker-c"] is low
    assert high.describe("worker-a")


def test_placement_is_by_worker_id_whatever_the_addresses_and_their_order() -> None:
    one = _pool([f"10.0.0.{i}:1" for i in range(1, 4)])
    two = _pool([f"10.9.9.{i}:7" for i in (9, 5, 1)])
    ids = ["worker-0", "worker-1", "worker-2"]
    for links, order in ((one, ids), (two, ids[::-1])):
        for link, worker_id in zip(links.links.values(), order, strict=True):
            assert link.describe(worker_id)
    for i in range(64):
        sid = f"sess_{i}"
        assert one.pick(sid).worker_id == two.pick(sid).worker_id == rendezvous_pick(sid, ids)
    # A link that has not described its worker is not placeable, healthy or not.
    undescribed = _pool(["10.0.0.1:1"])
    undescribed.links["10.0.0.1:1"].healthy = True
    assert undescribed.rank("sess_0") == []


async def test_update_adds_and_removes_links_and_takes_their_metric_series_along() -> None:
    pool = _pool(["10.0.0.1:1", "10.0.0.2:1"])
    kept, gone = pool.links["10.0.0.1:1"], pool.links["10.0.0.2:1"]
    pool.start()
    assert kept.describe("worker-a") and gone.describe("worker-b")
    WORKER_STALLS.labels(worker=gone.address)  # what a WorkerLink makes
    WORKER_TICK_LEAD.labels(worker=gone.address).set(0.01)  # and its reader, against a frame clock
    WORKER_TICK_COMMANDS.labels(worker=gone.address, outcome="missed").inc()
    health: list[bool] = []
    pool.health_listeners.append(health.append)

    await pool.update(["10.0.0.3:1", "10.0.0.1:1"])
    assert list(pool.links) == ["10.0.0.1:1", "10.0.0.3:1"]
    assert pool.links["10.0.0.1:1"] is kept and not kept.closed  # untouched
    assert gone.closed and health == [True]
    added = pool.links["10.0.0.3:1"]
    added.pool = pool
    assert added.started and not added.healthy
    assert REGISTRY.get_sample_value("duplex_session_worker_stalls_total", {"worker": gone.address}) is None
    lead = "duplex_session_worker_tick_lead_seconds"
    assert REGISTRY.get_sample_value(lead, {"worker": gone.address}) is None
    missed = {"worker": gone.address, "outcome": "missed"}
    assert REGISTRY.get_sample_value("duplex_session_worker_tick_commands_total", missed) is None
    # The removed link's id is free: another address of worker-b serves it.
    assert added.describe("worker-b")
    assert [link.worker_id for link in pool.placeable().values()] == ["worker-a", "worker-b"]
    assert sample("duplex_session_worker_links") == 2


# ---- with workers: in process, on 127.0.0.N, one port ------------------------------------------


def _dns_workers(port: int, worker_port: int) -> str:
    return f"dns://127.0.0.1:{port}/{NAME}:{worker_port}"


async def _workers(
    exits: contextlib.AsyncExitStack, hosts: dict[str, str], **config: Any
) -> tuple[dict[str, WorkerServer], int]:
    """Workers by id: ``hosts`` maps each id to its loopback address, all on one port (the
    first one's, free), as a headless Service has them; stopped with ``exits``."""
    started: dict[str, WorkerServer] = {}
    port = 0
    for worker_id, host in hosts.items():
        started[worker_id] = worker = await _start_worker(exits, host, port, worker_id, **config)
        port = worker.port
    return started, port


async def _start_worker(
    exits: contextlib.AsyncExitStack, host: str, port: int, worker_id: str, **config: Any
) -> WorkerServer:
    return await exits.enter_async_context(
        worker_server(listen=f"{host}:{port}", worker_id=worker_id, **config)
    )


def _on(server: SessionServer, sid: str) -> str | None:
    """The address of the worker the session is placed on (None: on none)."""
    runner = server.registry.get(sid)
    assert runner is not None
    return runner.link.address if runner.link is not None else None


async def _open(ch: grpc.aio.Channel) -> tuple[Conversation, str]:
    conv = Conversation(ch).start(open_event())
    sid = (await conv.wait_kind("opened")).opened.session_id
    return conv, str(sid)


async def _open_until(
    ch: grpc.aio.Channel, want: Callable[[str], bool], *, limit: int = 24
) -> tuple[list[tuple[Conversation, str]], tuple[Conversation, str]]:
    """Open sessions until one's id satisfies ``want``: all opened before it, and it."""
    opened: list[tuple[Conversation, str]] = []
    while len(opened) < limit:
        conv, sid = await _open(ch)
        if want(sid):
            return opened, (conv, sid)
        opened.append((conv, sid))
    raise AssertionError("no session id satisfied the condition")


async def _next_turn_on(server: SessionServer, conv: Conversation, sid: str) -> str:
    """The session's next turn starts (an append, acknowledged): the address it runs on."""
    start = len(conv.events)
    conv.append(b"\x00\x00" * 512)
    await conv.wait_kind("input_ack", start=start, within=10)
    address = _on(server, sid)
    assert address is not None
    return address


async def _speak(conv: Conversation) -> None:
    """A whole turn: speech in, the parrot's reply out, completed."""
    start = len(conv.events)
    await conv.stream(utterance_pcm(speech(3), PCM16K_MONO), PCM16K_MONO, speedup=8)
    done = (await conv.wait_kind("response_done", start=start, within=40)).response_done
    assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done


def _errors(conv: Conversation) -> list[str]:
    return [e.error.code for e in conv.of("error")]


async def _until(check: Callable[[], bool], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.02)


async def _close(convs: Sequence[Conversation]) -> None:
    for conv in convs:
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
    await asyncio.gather(*(conv.wait_done() for conv in convs))


@contextlib.asynccontextmanager
async def _discovering(dns_port: int, worker_port: int, **config: Any) -> AsyncIterator[SessionServer]:
    """A session-service replica whose workers are the records of ``NAME`` at the test's DNS
    server (resolved again every 0.2 s unless ``config`` says otherwise)."""
    config.setdefault("workers_resolve_interval_s", 0.2)
    async with session_server(
        [_dns_workers(dns_port, worker_port)], runner=RUNNER, clock_speed=4.0, **config
    ) as server:
        yield server


async def test_a_worker_added_to_dns_takes_new_sessions_without_a_restart() -> None:
    async with contextlib.AsyncExitStack() as exits:
        workers, port = await _workers(exits, {"worker-a": "127.0.0.2", "worker-b": "127.0.0.3"})
        a, b = workers["worker-a"], workers["worker-b"]
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["127.0.0.2"])
        server = await exits.enter_async_context(_discovering(dns_port, port, wait_workers=1))
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        assert list(server.pool.links) == [a.address]
        # Only worker-a is known: sessions that worker-b would own go to worker-a.
        before, (early, early_sid) = await _open_until(
            ch, lambda sid: rendezvous_pick(sid, ["worker-a", "worker-b"]) == "worker-b"
        )
        assert _on(server, early_sid) == a.address

        zone.set(NAME, ["127.0.0.3", "127.0.0.2"])
        await wait_workers_healthy(server, 2, within=10)
        assert sorted(server.pool.links) == sorted([a.address, b.address])
        # New sessions of worker-b's go there, and converse; the earlier ones stay where they are.
        more, (new, new_sid) = await _open_until(
            ch, lambda sid: rendezvous_pick(sid, ["worker-a", "worker-b"]) == "worker-b"
        )
        assert _on(server, new_sid) == b.address
        await _speak(new)
        assert _on(server, new_sid) == b.address
        assert _on(server, early_sid) == a.address and _errors(early) == []
        assert all(_on(server, sid) == a.address for _, sid in [*before, *more])
        await _close([c for c, _ in [*before, *more, (early, early_sid), (new, new_sid)]])


async def test_a_worker_removed_from_dns_loses_only_its_own_sessions_which_move_at_once() -> None:
    async with contextlib.AsyncExitStack() as exits:
        workers, port = await _workers(exits, {"worker-a": "127.0.0.2", "worker-b": "127.0.0.3"})
        a, b = workers["worker-a"], workers["worker-b"]
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["127.0.0.2", "127.0.0.3"])
        server = await exits.enter_async_context(_discovering(dns_port, port, wait_workers=2))
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        on: dict[str, list[tuple[Conversation, str]]] = {a.address: [], b.address: []}
        while min(len(v) for v in on.values()) < 2:
            conv, sid = await _open(ch)
            address = _on(server, sid)
            assert address is not None
            on[address].append((conv, sid))
            assert sum(len(v) for v in on.values()) < 24
        placed = "duplex_session_worker_sessions"
        assert sample(placed, {"worker": b.address}) == len(on[b.address])

        zone.set(NAME, ["127.0.0.2"])  # worker-b leaves the Service (it still runs)
        await _until(lambda: b.address not in server.pool.links, within=5, what="worker-b's link removed")
        # Its sessions move to worker-a at once (their turns' input replayed there), and no one
        # is told of an error: a worker leaving costs its sessions nothing.
        for _, sid in on[b.address]:
            await _until(lambda sid=sid: _on(server, sid) == a.address, within=5, what="moved to worker-a")
        for _, sid in on[a.address]:
            assert _on(server, sid) == a.address
        assert all(_errors(conv) == [] for v in on.values() for conv, _ in v)
        assert REGISTRY.get_sample_value(placed, {"worker": b.address}) is None  # its series went
        assert len(server.pool.healthy()) == 1
        # A whole turn converses on worker-a.
        moved, moved_sid = on[b.address][0]
        await _speak(moved)
        assert _on(server, moved_sid) == a.address
        assert all(_errors(conv) == [] for v in on.values() for conv, _ in v)
        await _close([c for v in on.values() for c, _ in v])


async def test_a_worker_back_under_its_id_at_a_new_address_keeps_its_slot_found_once_its_link_is_lost() -> (
    None
):
    async with contextlib.AsyncExitStack() as exits:
        workers, port = await _workers(exits, {"worker-a": "127.0.0.2", "worker-b": "127.0.0.3"})
        a = workers["worker-a"]
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["127.0.0.2", "127.0.0.3"])
        # A minute between periodic resolutions: only the lost link can make it look again soon.
        server = await exits.enter_async_context(
            _discovering(dns_port, port, wait_workers=2, workers_resolve_interval_s=60)
        )
        assert server.discovery is not None
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        sids = [f"sess_probe_{i}" for i in range(64)]
        slots = {sid: server.pool.pick(sid).worker_id for sid in sids}
        convs: list[tuple[Conversation, str]] = []
        while {_on(server, sid) for _, sid in convs} != {a.address, workers["worker-b"].address}:
            convs.append(await _open(ch))
            assert len(convs) < 24

        # worker-b's pod moves: the new one is up at .4 and in DNS, then the old one goes.
        moved = await _start_worker(exits, "127.0.0.4", port, "worker-b")
        zone.set(NAME, ["127.0.0.2", "127.0.0.4"])
        looked = server.discovery.resolutions
        await workers["worker-b"].stop(grace=0)
        await _until(
            lambda: [link.address for link in server.pool.healthy()] == [a.address, moved.address],
            within=10,
            what="the moved worker linked",
        )
        assert server.discovery.resolutions - looked <= 3  # looked again because of the loss
        assert {sid: server.pool.pick(sid).worker_id for sid in sids} == slots
        for conv, sid in convs:
            before = _on(server, sid)
            after = await _next_turn_on(server, conv, sid)
            assert after == (a.address if before == a.address else moved.address)
            assert (_errors(conv) == []) == (before == a.address)
        await _close([c for c, _ in convs])


async def test_two_workers_under_one_id_never_both_take_sessions() -> None:
    async with contextlib.AsyncExitStack() as exits:
        first = await _start_worker(exits, "127.0.0.2", 0, "worker-a")
        second = await _start_worker(exits, "127.0.0.3", first.port, "worker-a")
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["127.0.0.3", "127.0.0.2"])
        server = await exits.enter_async_context(
            _discovering(dns_port, first.port, wait_workers=1, worker_backoff_max_s=0.3)
        )
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        # One address serves worker-a (the lower one when both described together, otherwise the
        # first to describe); the other answers as worker-a too and stands by, with no Run stream.
        for address in (first.address, second.address):
            link = server.pool.links[address]
            await _until(
                lambda link=link: link.worker_id == "worker-a", within=5, what=f"{address} described"
            )
        await asyncio.sleep(0.5)
        healthy = [link.address for link in server.pool.healthy()]
        assert len(healthy) == 1
        serving, standing = (first, second) if healthy == [first.address] else (second, first)
        assert healthy == [serving.address]
        assert standing.owners() == []  # no Run stream was opened to it
        convs = [await _open(ch) for _ in range(3)]
        assert {_on(server, sid) for _, sid in convs} == {serving.address}
        # The serving one goes: the other takes over, and the sessions move there.
        await serving.stop(grace=0)
        await _until(
            lambda: [link.address for link in server.pool.healthy()] == [standing.address],
            within=5,
            what="the standing-by address took over",
        )
        for conv, sid in convs:
            assert await _next_turn_on(server, conv, sid) == standing.address
        await _close([c for c, _ in convs])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_and_aaaa_records_are_workers_alike() -> None:
    async with contextlib.AsyncExitStack() as exits:
        workers, port = await _workers(exits, {"worker-a": "127.0.0.2", "worker-b": "[::1]"})
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["::1", "127.0.0.2"])
        server = await exits.enter_async_context(_discovering(dns_port, port, wait_workers=2))
        v4, v6 = f"127.0.0.2:{port}", f"[::1]:{port}"
        assert sorted(server.pool.links) == sorted([v4, v6])
        assert {link.worker_id: link.address for link in server.pool.placeable().values()} == {
            "worker-a": v4,
            "worker-b": v6,
        }
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        convs: list[tuple[Conversation, str]] = []
        while {_on(server, sid) for _, sid in convs} != {v4, v6}:
            convs.append(await _open(ch))
            assert len(convs) < 24
        await _speak(next(c for c, sid in convs if _on(server, sid) == v6))  # a whole turn over IPv6
        assert workers["worker-b"].owners()
        await _close([c for c, _ in convs])


async def test_a_static_list_still_works_and_places_by_worker_id() -> None:
    async with contextlib.AsyncExitStack() as exits:
        workers, _ = await _workers(exits, {"worker-b": "127.0.0.3", "worker-a": "127.0.0.2"})
        addresses = {w.address: worker_id for worker_id, w in workers.items()}
        server = await exits.enter_async_context(session_server(list(addresses), runner=RUNNER))
        assert server.discovery is None and sorted(server.pool.links) == sorted(addresses)
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        convs: list[tuple[Conversation, str]] = []
        while len({_on(server, sid) for _, sid in convs}) < 2:
            convs.append(await _open(ch))
            assert len(convs) < 24
        for _, sid in convs:
            address = _on(server, sid)
            assert address is not None
            assert addresses[address] == rendezvous_pick(sid, ["worker-a", "worker-b"])
        await _close([c for c, _ in convs])


async def test_a_discovered_worker_is_dialled_at_its_address_and_checked_against_the_name(
    tmp_path: Path,
) -> None:
    # The worker's certificate names the Service, not an address: as gRPC's own DNS resolver
    # would, the link checks it against the name it resolved.
    ca = trustme.CA()

    def files(name: str, *identities: str) -> tuple[Path, Path, Path]:
        d = tmp_path / name
        d.mkdir()
        issued = ca.issue_cert(*identities)
        issued.cert_chain_pems[0].write_to_path(str(d / "tls.crt"))
        issued.private_key_pem.write_to_path(str(d / "tls.key"))
        ca.cert_pem.write_to_path(str(d / "ca.crt"))
        return d / "tls.crt", d / "tls.key", d / "ca.crt"

    cert, key, ca_file = files("worker", NAME)
    worker_tls = ServerTLS(cert=cert, key=key, client_ca=ca_file)
    cert, key, ca_file = files("session", "duplex-session")
    async with contextlib.AsyncExitStack() as exits:
        worker = await _start_worker(exits, "127.0.0.2", 0, "worker-0", tls=worker_tls)
        zone, dns_port = exits.enter_context(dns_server())
        zone.set(NAME, ["127.0.0.2"])
        server = await exits.enter_async_context(
            _discovering(
                dns_port,
                worker.port,
                wait_workers=1,
                worker_tls=ClientTLS(ca=ca_file, cert=cert, key=key),
            )
        )
        link = server.pool.links[worker.address]
        assert isinstance(link, WorkerLink) and link.healthy and link.worker_id == "worker-0"
        # The worker knows the replica by its certificate (once it has read the first command).
        await _until(
            lambda: any(k.startswith("duplex-session/") for k in worker.owners()),
            within=5,
            what="the worker saw the replica's certificate",
        )
        ch = await exits.enter_async_context(grpc.aio.insecure_channel(server.address))
        conv, sid = await _open(ch)
        assert _on(server, sid) == worker.address
        await _close([conv])
