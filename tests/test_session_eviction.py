"""Fencing follows the session: a resume attaches where the session lives, and a session that
must move is evicted from its old worker as soon as that worker is reachable.

End to end (in process, real gRPC servers on loopback): two session replicas and two workers
with fixed ids; a session opened on replica A lives on worker ``w-one``, its client resumes on
replica B. Then the units: placement with a preference, and the evictor's waiting list (bounded,
expiring, cancelled by this replica's own placement) with fake links.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from duplex.errors import DuplexError, ErrorCode, FencedError, UnavailableError
from duplex.v1 import session_pb2, worker_pb2
from session_service.api.server import SessionServer
from session_service.config import EvictionLimits
from session_service.trust import resume_tokens as resume
from session_service.trust.resume_tokens import ResumeKeys
from session_service.workers.eviction import Evictor, PendingEvictions, Waiting
from session_service.workers.placement import WorkerPool, rendezvous_pick, rendezvous_rank
from tests.fakes import ManualClock
from tests.session_helpers import Conversation, open_event, sample, session_server, worker_server
from tests.test_session_orphans import Proxy
from tests.worker_helpers import wait_until

FRAME = b"\x10\x00" * 512
EVICTIONS = "duplex_session_evictions_total"
W1, W2 = "w-one", "w-two"


def evictions(result: str) -> float:
    return sample(EVICTIONS, {"result": result})


def resume_event(session_id: str, token: str) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(
        resume=session_pb2.SessionResume(session_id=session_id, resume_token=token)
    )


async def open_until(
    ch: grpc.aio.Channel, want: Callable[[str], bool], *, tries: int = 40
) -> tuple[Conversation, session_pb2.SessionOpened]:
    """A session (opened on ``ch``) whose id ``want`` accepts; the others are closed."""
    for _ in range(tries):
        conv = Conversation(ch).start(open_event())
        opened = (await conv.wait_kind("opened")).opened
        if want(opened.session_id):
            return conv, opened
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_done()
    raise AssertionError(f"no session id in {tries} tries")


async def talk(conv: Conversation) -> None:
    """One append, acknowledged (the worker has seen the session's request)."""
    start = len(conv.events)
    conv.append(FRAME)
    await conv.wait_kind("input_ack", start=start, within=15)


def worker_of(server: SessionServer, session_id: str) -> str | None:
    runner = server.registry.get(session_id)
    link = runner.link if runner is not None else None
    return link.worker_id if link is not None else None


# ---- end to end ----------------------------------------------------------------------------------


async def test_a_resume_elsewhere_takes_the_session_over_on_its_worker_and_fences_the_old_owner() -> None:
    """B's rendezvous choice for the session is ``w-two``, but the token names ``w-one``, which
    is healthy at B: B attaches there with takeover, so A (still attached, still talking) is
    fenced out at once; nothing is placed on ``w-two``."""
    keys = ResumeKeys.single(os.urandom(32))
    async with (
        worker_server(worker_id=W1) as w1,
        worker_server(worker_id=W2) as w2,
        session_server([w1.address], resume_keys=keys) as a,
        session_server([w1.address, w2.address], resume_keys=keys) as b,
        grpc.aio.insecure_channel(a.address) as ch_a,
        grpc.aio.insecure_channel(b.address) as ch_b,
    ):
        old, opened = await open_until(ch_a, lambda sid: rendezvous_pick(sid, [W1, W2]) == W2)
        sid = opened.session_id
        assert resume.decode(keys, opened.resume_token, session_id=sid).worker_id == W1
        await talk(old)
        assert w1.fences.owner_of(sid) == a.config.replica_id

        new = Conversation(ch_b).start(resume_event(sid, opened.resume_token))
        taken = (await new.wait_kind("opened")).opened
        assert taken.epoch > opened.epoch
        assert worker_of(b, sid) == W1
        assert w1.fences.owner_of(sid) == b.config.replica_id and w2.fences.current(sid) is None
        assert resume.decode(keys, taken.resume_token, session_id=sid).worker_id == W1
        # A hears of it from the worker, without sending anything: closed{resumed_elsewhere}.
        assert (await old.wait_kind("closed", within=10)).closed.reason == "resumed_elsewhere"
        await talk(new)
        new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await new.wait_kind("closed")


@pytest.mark.parametrize("audio", [False, True], ids=["before_any_audio", "after_audio"])
async def test_a_session_taken_over_and_closed_elsewhere_stays_closed_on_the_replica_it_left(
    audio: bool,
) -> None:
    """Found by an attack on the secure deployment: a session opened on A *with no audio yet*
    (so the worker had no request id of A's for it), taken over and closed on B, answered
    ``opened`` to a resume on A, and A's stream heard nothing of the takeover. The worker now
    knows the request id from the Attach: A's stream is told closed{resumed_elsewhere} at once,
    and a resume on A is refused with session_closed, whether or not audio was sent."""
    keys = resume.ResumeKeys.single(os.urandom(32))
    async with (
        worker_server(worker_id=W1) as w1,
        session_server([w1.address], resume_keys=keys) as a,
        session_server([w1.address], resume_keys=keys) as b,
        grpc.aio.insecure_channel(a.address) as ch_a,
        grpc.aio.insecure_channel(b.address) as ch_b,
    ):
        old = Conversation(ch_a).start(open_event())
        opened = (await old.wait_kind("opened")).opened
        sid = opened.session_id
        if audio:
            await talk(old)
        new = Conversation(ch_b).start(resume_event(sid, opened.resume_token))
        await new.wait_kind("opened")
        assert (await old.wait_kind("closed", within=5)).closed.reason == "resumed_elsewhere"
        await old.wait_done()
        assert a.registry.get(sid) is None
        new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        assert (await new.wait_kind("closed")).closed.reason == "client_close"
        await new.wait_done()
        again = Conversation(ch_a).start(resume_event(sid, opened.resume_token))
        await again.wait_done()
        assert again.status == grpc.StatusCode.NOT_FOUND and again.error is not None
        assert again.of("opened") == []


async def test_a_resume_that_must_move_the_session_evicts_it_from_its_old_worker_once_reachable() -> None:
    """``w-one`` is not reachable from B when the client resumes there: B places the session on
    ``w-two``; A still holds it on ``w-one``. Once B's link to ``w-one`` is back, B takes it over
    there and releases it: A is fenced out, ``w-one`` holds nothing, B's session goes on."""
    keys = ResumeKeys.single(os.urandom(32))
    async with (
        worker_server(worker_id=W1) as w1,
        worker_server(worker_id=W2) as w2,
        Proxy(w1.port) as to_w1,
        session_server([w1.address], resume_keys=keys) as a,
        session_server([to_w1.address, w2.address], resume_keys=keys, worker_backoff_max_s=0.2) as b,
        grpc.aio.insecure_channel(a.address) as ch_a,
        grpc.aio.insecure_channel(b.address) as ch_b,
    ):
        old = Conversation(ch_a).start(open_event())
        opened = (await old.wait_kind("opened")).opened
        sid = opened.session_id
        await talk(old)
        assert w1.fences.owner_of(sid) == a.config.replica_id
        link_w1 = b.pool.links[to_w1.address]
        to_w1.cut()
        await wait_until(lambda: not link_w1.healthy, within=10)
        evicted = evictions("evicted")

        new = Conversation(ch_b).start(resume_event(sid, opened.resume_token))
        taken = (await new.wait_kind("opened")).opened
        assert worker_of(b, sid) == W2
        assert resume.decode(keys, taken.resume_token, session_id=sid).worker_id == W2
        assert b.evictor.pending.keys() == [(sid, W1)]
        # Meanwhile the old owner still holds it on w-one.
        await talk(old)
        assert w1.fences.owner_of(sid) == a.config.replica_id

        to_w1.restore()
        await wait_until(lambda: w1.fences.current(sid) is None, within=20)
        assert evictions("evicted") - evicted == 1 and b.evictor.pending.keys() == []
        assert w1.fences.live_sessions == 0
        await wait_until(lambda: w1.engine.active_requests == 0)  # its model state is freed too
        assert (await old.wait_kind("closed", within=10)).closed.reason == "resumed_elsewhere"
        # B's session goes on where it is, untouched by the eviction.
        await talk(new)
        assert worker_of(b, sid) == W2 and w2.fences.owner_of(sid) == b.config.replica_id
        new.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await new.wait_kind("closed")


async def test_a_session_its_runner_moved_is_released_at_its_old_worker_when_the_link_is_back() -> None:
    """No eviction needed when the runner itself moves a session (its worker's link was lost):
    the previous owner is this replica, and the kept releases / reconciliation of the link's
    next stream release it at the old worker, long before its orphan grace."""
    async with (
        worker_server(worker_id=W1, orphan_grace_s=120) as w1,
        worker_server(worker_id=W2) as w2,
        Proxy(w1.port) as to_w1,
        session_server([to_w1.address, w2.address], worker_backoff_max_s=0.2) as replica,
        grpc.aio.insecure_channel(replica.address) as ch,
    ):
        conv, opened = await open_until(ch, lambda sid: rendezvous_pick(sid, [W1, W2]) == W1)
        sid = opened.session_id
        await talk(conv)
        assert w1.fences.owner_of(sid) == replica.config.replica_id
        link_w1 = replica.pool.links[to_w1.address]
        to_w1.cut()
        await wait_until(lambda: not link_w1.healthy, within=10)
        await talk(conv)  # placed again: on w-two
        assert worker_of(replica, sid) == W2 and w2.fences.owner_of(sid) == replica.config.replica_id
        assert w1.fences.owner_of(sid) == replica.config.replica_id  # not told yet
        to_w1.restore()
        await wait_until(lambda: w1.fences.current(sid) is None, within=20)
        assert replica.evictor.pending.keys() == []
        await talk(conv)
        assert worker_of(replica, sid) == W2
        conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await conv.wait_kind("closed")


# ---- placement with a preference ---------------------------------------------------------------


class _Link:
    """A worker link as placement and eviction see it; every call is recorded."""

    def __init__(self, address: str, on_health: Callable[[], None]) -> None:
        self.address = address
        self.worker_id: str | None = address  # placement ranks workers by their ids
        self.healthy = True
        self.generation = 1
        self._on_health = on_health
        self.attaches: list[tuple[str, int, bool]] = []
        self.releases: list[worker_pb2.Release] = []
        self.outcome: Callable[[], int | DuplexError] = lambda: 7
        self.hold: asyncio.Event | None = None
        self.in_attach: set[str] = set()

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def set_healthy(self, healthy: bool) -> None:
        """Up on a new Run stream (as a ``WorkerLink``), or down; the pool hears of it."""
        if healthy:
            self.generation += 1
        self.healthy = healthy
        self._on_health()

    def attaching(self, session_id: str) -> bool:
        return session_id in self.in_attach

    def release(self, release: worker_pb2.Release) -> None:
        self.releases.append(release)

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
        self.attaches.append((session_id, epoch, takeover))
        self.in_attach.add(session_id)
        try:
            if self.hold is not None:
                await self.hold.wait()
            got = self.outcome()
        finally:
            self.in_attach.discard(session_id)
        if isinstance(got, DuplexError):
            raise got
        return got


def _pool(*worker_ids: str) -> WorkerPool[_Link]:
    return WorkerPool(list(worker_ids), link_factory=_Link)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_place_tries_the_preferred_worker_first_while_it_is_placeable() -> None:
    pool = _pool("a", "b", "c")
    ranked = rendezvous_rank("sess_x", pool.links)
    last = ranked[-1]
    link, _ = await pool.place("sess_x", 1, True, prefer=last)
    assert link.address == last and pool.rank("sess_x", prefer=last)[0].address == last
    # Not healthy, not known, or not answering: the rendezvous order, as without a preference.
    pool.links[last].set_healthy(False)
    link, _ = await pool.place("sess_x", 1, True, prefer=last)
    assert link.address == ranked[0]
    link, _ = await pool.place("sess_x", 1, True, prefer="gone")
    assert link.address == ranked[0]
    pool.links[last].set_healthy(True)
    down = UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "connection refused")
    pool.links[last].outcome = lambda: down
    link, _ = await pool.place("sess_x", 1, True, prefer=last)
    assert link.address == ranked[0] and pool.links[last].attaches[-1] == ("sess_x", 1, True)
    # A refusal there is final: the session is not moved around its owner (or its tombstone).
    pool.links[last].outcome = lambda: FencedError(ErrorCode.NOT_OWNER, "another identity")
    with pytest.raises(DuplexError) as err:
        await pool.place("sess_x", 1, True, prefer=last)
    assert err.value.code == ErrorCode.NOT_OWNER


# ---- the evictor -------------------------------------------------------------------------------


@dataclass
class _Runner:
    session_id: str
    link: object | None
    closed: bool = False


class _Registry:
    """What the evictor reads of the sessions this replica holds: by default every one, live
    on a worker of its own (``w-else``); ``runners`` says otherwise (None: not held here)."""

    def __init__(self) -> None:
        self.runners: dict[str, _Runner | None] = {}

    def get(self, session_id: str) -> _Runner | None:
        if session_id in self.runners:
            return self.runners[session_id]
        return _Runner(session_id, type("Link", (), {"worker_id": "w-else"})())


def _evictor(
    pool: WorkerPool[_Link], *, clock: ManualClock | None = None, **limits: float
) -> tuple[Evictor[_Link], _Registry]:
    registry = _Registry()
    evictor = Evictor(
        pool,
        registry,  # type: ignore[arg-type]
        limits=EvictionLimits(**limits),
        clock=clock or ManualClock(),  # type: ignore[arg-type]
    )
    return evictor, registry


async def test_a_moved_session_is_evicted_from_its_old_worker_once_a_link_of_it_is_healthy() -> None:
    pool = _pool("w1", "w2")
    old, new = pool.links["w1"], pool.links["w2"]
    evictor, _ = _evictor(pool)
    old.set_healthy(False)
    evicted = evictions("evicted")
    link, _ = await evictor.place("sess_x", 1, True, prefer="w1")
    assert link is new and old.attaches == []
    assert evictor.pending.keys() == [("sess_x", "w1")]
    # Its link comes up (with another id first: not that worker).
    old.worker_id = "w9"
    old.set_healthy(True)
    await _settle()
    assert old.attaches == [] and evictor.pending.keys() == [("sess_x", "w1")]
    old.set_healthy(False)
    old.worker_id = "w1"
    old.set_healthy(True)
    await _settle()
    assert old.attaches == [("sess_x", 1, True)]
    assert [(r.fence.session_id, r.fence.epoch, r.closed) for r in old.releases] == [("sess_x", 7, False)]
    assert evictions("evicted") - evicted == 1 and evictor.pending.keys() == [] and evictor.running == []
    assert new.releases == []  # the new placement is untouched
    # Placed where the token says: nothing to evict.
    await evictor.place("sess_y", 1, True, prefer="w1")
    await _settle()
    assert evictor.pending.keys() == [] and [a[0] for a in old.attaches] == ["sess_x", "sess_y"]
    assert len(old.releases) == 1


async def test_an_eviction_the_worker_does_not_answer_waits_for_it_again() -> None:
    pool = _pool("w1", "w2")
    old = pool.links["w1"]
    evictor, _ = _evictor(pool)
    down = UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "connection refused")
    old.outcome = lambda: down
    evictor.evict("sess_x", "w1")
    await _settle()
    assert len(old.attaches) == 1 and evictor.pending.keys() == [("sess_x", "w1")]
    old.outcome = lambda: 3
    old.set_healthy(False)
    old.set_healthy(True)
    await _settle()
    assert len(old.attaches) == 2 and old.releases[0].fence.epoch == 3 and evictor.pending.keys() == []
    # A refusal is final, and counted.
    refused = evictions("refused")
    old.outcome = lambda: FencedError(ErrorCode.NOT_OWNER, "this identity may not take it over")
    evictor.evict("sess_z", "w1")
    await _settle()
    assert evictions("refused") - refused == 1 and evictor.pending.keys() == [] and len(old.releases) == 1


async def test_evictions_wait_bounded_and_expire() -> None:
    clock = ManualClock()
    pool = _pool("w1", "w2")
    old = pool.links["w1"]
    old.set_healthy(False)
    evictor, _ = _evictor(pool, clock=clock, max_pending=2, ttl_s=60.0)
    dropped, expired = evictions("dropped"), evictions("expired")
    for sid in ("s1", "s2", "s3"):
        evictor.evict(sid, "w1")
    assert evictor.pending.keys() == [("s2", "w1"), ("s3", "w1")]
    assert evictions("dropped") - dropped == 1
    assert sample("duplex_session_evictions_pending") == 2
    await clock.advance(30)
    evictor.evict("s2", "w1")  # again: its time starts over
    await clock.advance(31)
    assert evictor.pending.keys() == [("s2", "w1")] and evictions("expired") - expired == 1
    await clock.advance(30)
    old.set_healthy(True)
    await _settle()
    assert old.attaches == [] and evictor.pending.keys() == [] and evictions("expired") - expired == 2
    assert sample("duplex_session_evictions_pending") == 0


def test_the_waiting_list_keeps_one_entry_per_session_and_worker() -> None:
    now = [0.0]
    pending = PendingEvictions(EvictionLimits(max_pending=8, ttl_s=10.0), lambda: now[0])
    pending.add("s", "w1")
    pending.add("s", "w2")
    pending.add("s", "w1")
    assert pending.keys() == [("s", "w2"), ("s", "w1")]
    assert pending.take(lambda w: w.worker_id == "w1") == [Waiting("s", "w1", 10.0)]
    pending.add("s", "w1", deadline=5.0, tried_on=("a:1", 3))  # put back: its own deadline
    now[0] = 6.0
    assert pending.take(lambda w: True) == [Waiting("s", "w2", 10.0)] and len(pending) == 0
    with pytest.raises(ValueError):
        EvictionLimits(max_pending=0)
    with pytest.raises(ValueError):
        EvictionLimits(ttl_s=0)


async def test_an_eviction_waits_for_this_replicas_placement_of_the_session_and_is_cancelled_by_it() -> None:
    pool = _pool("w1", "w2")
    old = pool.links["w1"]
    old.set_healthy(False)
    evictor, _ = _evictor(pool)
    evictor.evict("sess_x", "w1")
    cancelled = evictions("cancelled")
    # The runner places the session on w1 itself (with takeover) while that link comes up.
    old.healthy = True  # up; the pool hears of it only once the placement is under way
    old.hold = asyncio.Event()
    placing = asyncio.create_task(evictor.place("sess_x", 2, True, prefer="w1"))
    await _settle()
    old._on_health()  # the eviction waits: the session is being placed here
    await _settle()
    assert old.attaches == [("sess_x", 2, True)] and evictor.pending.keys() == [("sess_x", "w1")]
    old.hold.set()
    link, _ = await placing
    await _settle()
    assert link is old and old.attaches == [("sess_x", 2, True)] and old.releases == []
    assert evictor.pending.keys() == [] and evictions("cancelled") - cancelled == 1


async def test_nothing_is_evicted_for_a_session_held_there_or_not_held_here() -> None:
    """Held on that worker here: our takeover there fenced the old owner. Not held here any more
    (ended, or taken over again by another replica): the latest owner decides where it lives."""
    pool = _pool("w1", "w2")
    old = pool.links["w1"]
    old.set_healthy(False)
    evictor, registry = _evictor(pool)
    registry.runners["held_there"] = _Runner("held_there", old)
    registry.runners["ended"] = _Runner("ended", pool.links["w2"], closed=True)
    registry.runners["gone"] = None
    for sid in ("held_there", "ended", "gone", "held_elsewhere"):
        evictor.evict(sid, "w1")
    cancelled = evictions("cancelled")
    old.set_healthy(True)
    await _settle()
    assert [a[0] for a in old.attaches] == ["held_elsewhere"] and evictor.pending.keys() == []
    assert evictions("cancelled") - cancelled == 3


async def test_a_placement_waits_for_an_eviction_of_its_session_in_flight() -> None:
    """Our own Attach racing the eviction's on one worker could get the lower epoch and be
    fenced by the eviction: it goes after it, and is granted the higher one."""
    pool = _pool("w1", "w2")
    old = pool.links["w1"]
    evictor, _ = _evictor(pool)
    old.hold = asyncio.Event()
    evictor.evict("sess_x", "w1")
    await _settle()
    assert evictor.running == ["sess_x"]
    placing = asyncio.create_task(evictor.place("sess_x", 2, True, prefer="w1"))
    await _settle()
    assert old.attaches == [("sess_x", 1, True)]
    old.hold.set()
    await placing
    assert old.attaches == [("sess_x", 1, True), ("sess_x", 2, True)]
    assert [r.fence.epoch for r in old.releases] == [7]
    await evictor.close()
