"""State nobody owns, from the session service's side (in process, real servers on loopback):
a lost link is reconciled when it comes back, releases wait for a stream instead of being
dropped, and nothing a client is told names a worker or carries gRPC's debug text.

A link is lost through ``Proxy``, a TCP forwarder between the replica and the worker that the
test can cut (every connection dropped, new ones refused) or freeze (nothing flows, as with a
SIGSTOPped worker) and then restore; the worker itself keeps running, with its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Callable
from types import TracebackType
from typing import Any

import grpc
import pytest

from duplex.errors import CapacityError, DuplexError, ErrorCode, UnavailableError
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.plugins.parrot import ParrotPlugin
from session_service.workers import kept_releases as kept_releases_module
from session_service.workers.link import WorkerLink
from session_service.workers.placement import WorkerPool
from session_service.workers.step_routing import Router, SessionRegistry
from tests.procs import start_service
from tests.session_helpers import (
    Conversation,
    metric_value,
    metrics_text,
    open_event,
    sample,
    session_server,
    worker_args,
    worker_server,
)
from tests.worker_helpers import wait_until

FRAME = b"\x10\x00" * 512
RECONCILED = "duplex_session_reconciled_releases_total"
DROPPED = "duplex_session_worker_releases_dropped_total"

#: What a client must never see: an address (host:port) or a gRPC object's repr.
LEAKS = re.compile(r"\d{1,3}(\.\d{1,3}){3}:\d+|localhost:\d+|\]:\d+|object at 0x|cygrpc|debug_error")


def assert_no_leak(message: str) -> None:
    assert not LEAKS.search(message), message


class Proxy:
    """A TCP forwarder to ``127.0.0.1:target`` that a test can ``cut`` (drop every connection,
    refuse new ones), ``freeze`` (hold every byte, as a stopped peer would) and ``restore``."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._up = True
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        self._flowing.set()
        self._drop()

    def cut(self) -> None:
        self._up = False
        self._drop()

    def freeze(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        self._up = True
        self._flowing.set()

    def _drop(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._up:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._writers.update(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in pair:
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()  # one direction ended: so does the connection


def append(seq: int) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=seq, pcm=FRAME))


CLOSE = session_pb2.ClientEvent(close=session_pb2.SessionClose())


# ---- a lost link, end to end ---------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["cut", "stall"])
async def test_worker_state_nobody_holds_is_released_once_the_link_is_back(loss: str) -> None:
    """Sessions closed while the replica's link to their worker was down (cut, or the worker
    stalled and the watchdog gave up on it) leave nothing at the worker once the link is back,
    although the replica came back long before the worker's orphan grace (which it cancels);
    the session that stayed open goes on."""
    async with (
        worker_server(orphan_grace_s=120) as worker,
        Proxy(worker.port) as proxy,
        session_server([proxy.address], worker_backoff_max_s=0.2, worker_stall_timeout_s=0.5) as replica,
        grpc.aio.insecure_channel(replica.address) as ch,
    ):
        link = replica.pool.links[proxy.address]
        convs = [Conversation(ch).start(open_event()) for _ in range(3)]
        for c in convs:
            await c.wait_kind("opened")
            c.append(FRAME)
            await c.wait_kind("input_ack")
        await wait_until(lambda: worker.engine.active_requests == 3 and worker.fences.live_sessions == 3)
        reconciled = sample(RECONCILED)

        if loss == "cut":
            proxy.cut()
        else:
            proxy.freeze()
            for c in convs:  # input the worker owes an answer to, which never comes
                c.append(FRAME)
        await wait_until(lambda: not link.healthy, within=15)
        # Meanwhile two clients close their sessions (nothing can tell the worker now).
        for c in convs[:2]:
            c.send(CLOSE)
            await c.wait_kind("closed")
        assert worker.fences.live_sessions == 3
        proxy.restore()
        await wait_until(lambda: link.healthy, within=20)
        # All three were held for the replica, none is bound to the link any more (the open one
        # lost its worker with the link): all are released, by the reconciliation.
        await wait_until(
            lambda: worker.fences.live_sessions == 0 and worker.engine.active_requests == 0, within=10
        )
        assert sample(RECONCILED) - reconciled == 3
        assert worker.owners() == [replica.config.replica_id]
        # The open session goes on: its next input places it again.
        start = len(convs[2].events)
        convs[2].append(FRAME)
        await convs[2].wait_kind("input_ack", start=start, within=15)
        await wait_until(lambda: worker.fences.live_sessions == 1 and worker.engine.active_requests == 1)
        convs[2].send(CLOSE)
        await convs[2].wait_kind("closed")
        await wait_until(lambda: worker.fences.live_sessions == 0)
        for c in convs:
            for e in c.of("error"):
                assert_no_leak(e.error.message)


@pytest.mark.process
async def test_a_stopped_worker_holds_nothing_for_closed_sessions_once_it_continues() -> None:
    """The measured case: the worker process is stopped (SIGSTOP) while its sessions talk, the
    replica's stall watchdog gives up on it, every client closes its session, the worker
    continues (SIGCONT). Its ``duplex_worker_active_requests`` goes back to 0 at once, not after
    an orphan grace (here 120 s, which the replica's reconnect cancels anyway)."""
    worker = await asyncio.to_thread(start_service, worker_args("--orphan-grace-s", "120", device="cpu"))
    stopped = False

    def active() -> float | None:
        return metric_value(metrics_text(worker.metrics), "duplex_worker_active_requests")

    async def until_active(n: float, within: float) -> None:
        async with asyncio.timeout(within):
            while await asyncio.to_thread(active) != n:  # noqa: ASYNC110  (another process's metric)
                await asyncio.sleep(0.1)

    try:
        async with (
            session_server([worker.grpc], worker_backoff_max_s=0.2, worker_stall_timeout_s=0.5) as replica,
            grpc.aio.insecure_channel(replica.address) as ch,
        ):
            link = replica.pool.links[worker.grpc]
            convs = [Conversation(ch).start(open_event()) for _ in range(3)]
            for c in convs:
                await c.wait_kind("opened")
                c.append(FRAME)
                await c.wait_kind("input_ack")
            await until_active(3, within=10)
            os.kill(worker.pid, signal.SIGSTOP)
            stopped = True
            for c in convs:  # input the stopped worker owes an answer to
                c.append(FRAME)
            await wait_until(lambda: not link.healthy, within=15)
            for c in convs:
                c.send(CLOSE)
                await c.wait_kind("closed")
                for e in c.of("error"):
                    assert_no_leak(e.error.message)
            os.kill(worker.pid, signal.SIGCONT)
            stopped = False
            await wait_until(lambda: link.healthy, within=20)
            await until_active(0, within=15)
    finally:
        if stopped:
            os.kill(worker.pid, signal.SIGCONT)
        worker.proc.kill()
        await asyncio.to_thread(worker.proc.wait, 10)


async def test_a_release_issued_while_the_link_is_down_reaches_the_worker() -> None:
    lists: list[list[str]] = []

    def on_step(_link: WorkerLink, step: worker_pb2.StepOutput) -> None:
        if step.held_sessions:  # no router here: nothing reconciles, only the kept release acts
            lists.append([f.session_id for f in step.held_sessions])

    async with worker_server() as worker, Proxy(worker.port) as proxy:
        link = WorkerLink(
            proxy.address,
            owner="replica-r",
            plugin=ParrotPlugin(),
            on_step=on_step,
            on_lost=lambda _l: None,
            on_health=lambda: None,
            backoff_max_s=0.2,
        )
        link.start()
        try:
            await wait_until(lambda: link.healthy)
            for sid in ("s1", "s2"):
                assert await link.attach(sid, 1, takeover=False, deadline_s=5) == 1
            proxy.cut()
            await wait_until(lambda: not link.healthy)
            fence = common_pb2.Fence(session_id="s1", epoch=1)
            link.release(worker_pb2.Release(request_id="s1", fence=fence, closed=True))
            assert link.kept_releases == ["s1"]
            proxy.restore()
            # Sent first on the next stream: s1 is closed for good (a tombstone), and the
            # worker's list, made after that first command, no longer has it.
            await wait_until(lambda: worker.fences.is_closed("s1"), within=15)
            await wait_until(lambda: bool(lists))
            assert lists == [["s2"]]
            assert link.kept_releases == []
            assert worker.fences.owner_of("s2") == "replica-r"
        finally:
            await link.close()


async def test_kept_releases_are_bounded_and_one_per_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept_releases_module, "MAX_KEPT_RELEASES", 3)
    link = _link()
    try:
        dropped = sample(DROPPED)

        def release(sid: str, epoch: int = 1, closed: bool = False) -> None:
            fence = common_pb2.Fence(session_id=sid, epoch=epoch)
            link.release(worker_pb2.Release(request_id=sid, fence=fence, closed=closed))

        release("a", closed=True)
        release("b")
        release("a", epoch=2)  # replaces the earlier one (still closed), now the newest
        assert link.kept_releases == ["b", "a"]
        release("c")
        release("d")
        release("e")
        assert link.kept_releases == ["c", "d", "e"]  # the oldest went first
        assert sample(DROPPED) - dropped == 2
    finally:
        await link.close()


async def test_an_attach_that_outlives_its_stream_is_released_again() -> None:
    """Placement does not use an Attach made under a stream that is gone by its answer (the
    session goes elsewhere); the link releases it, and does not judge it meanwhile."""
    link = _link()
    answer = asyncio.Event()

    class Stub:
        async def Attach(self, request: worker_pb2.AttachRequest, **_kw: Any) -> worker_pb2.AttachResponse:
            await answer.wait()
            return worker_pb2.AttachResponse(epoch=7)

    link._stub = Stub()  # type: ignore[assignment]  # the Attach RPC, answered when the test says
    try:
        task = asyncio.create_task(link.attach("s1", 1, takeover=True, deadline_s=5))
        await asyncio.sleep(0)
        assert link.attaching("s1") and not link.attaching("s2")
        link.generation += 1  # the stream it was made under went away meanwhile
        answer.set()
        assert await task == 7
        assert not link.attaching("s1")
        assert link.kept_releases == ["s1"]
        # Attaching it here again makes that release out of date.
        answer.clear()
        task = asyncio.create_task(link.attach("s1", 1, takeover=True, deadline_s=5))
        await asyncio.sleep(0)
        assert link.kept_releases == []
        answer.set()
        await task
    finally:
        await link.close()


# ---- the reconciliation rule ---------------------------------------------------------------------


class _Link:
    address = "w:1"
    healthy = True

    def __init__(self, attaching: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.releases: list[worker_pb2.Release] = []
        self._attaching = attaching

    def attaching(self, session_id: str) -> bool:
        return session_id in self._attaching

    def release(self, release: worker_pb2.Release) -> None:
        self.releases.append(release)

    def submit(self, subs: Any, *, prompt: bool = False) -> Any:
        raise AssertionError("not expected")

    def abort(self, abort: worker_pb2.Abort) -> None:
        raise AssertionError("not expected")


class _Runner:
    def __init__(self, session_id: str, link: object, closed: bool = False) -> None:
        self.session_id = session_id
        self.link = link
        self.closed = closed

    def on_worker_lost(self, link: object) -> None:
        pass

    def holds(self, link: object) -> bool:
        """One worker per session here (no later stages)."""
        return self.link is link


def test_reconciliation_keeps_exactly_what_is_held_on_the_link() -> None:
    link, other = _Link(attaching={"attaching"}), _Link()
    registry = SessionRegistry()
    for runner in (
        _Runner("bound", link),
        _Runner("elsewhere", other),
        _Runner("unbound", None),
        _Runner("closing", link, closed=True),
    ):
        registry.add(runner)  # type: ignore[arg-type]
    held = [
        common_pb2.Fence(session_id=sid, epoch=i + 3)
        for i, sid in enumerate(["bound", "elsewhere", "unbound", "closing", "unknown", "attaching"])
    ]
    step = worker_pb2.StepOutput(step=0, held_sessions=held)
    Router(registry).on_step(link, step)
    released = {r.fence.session_id: r for r in link.releases}
    assert sorted(released) == ["closing", "elsewhere", "unbound", "unknown"]
    # Each echoes the fence the worker listed, and is not a close (the session may be elsewhere).
    assert [(r.fence.epoch, r.request_id, r.closed) for r in link.releases] == [
        (4, "elsewhere", False),
        (5, "unbound", False),
        (6, "closing", False),
        (7, "unknown", False),
    ]
    assert other.releases == []


# ---- what a client may be told ---------------------------------------------------------------


GRPC_DETAILS = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:7000: "
    "Failed to connect to remote host: Connection refused"
)


def _unreachable() -> DuplexError:
    err = UnavailableError(ErrorCode.WORKER_UNAVAILABLE, GRPC_DETAILS)
    err.status = grpc.StatusCode.UNAVAILABLE
    return err


class _PlaceLink:
    def __init__(self, address: str, on_health: Callable[[], None]) -> None:
        self.address = address
        self.worker_id = address  # placement ranks workers by their ids
        self.healthy = True
        self.generation = 1
        self.outcome: Callable[[_PlaceLink], int | DuplexError] = lambda _l: 1

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
        got = self.outcome(self)
        if isinstance(got, DuplexError):
            raise got
        return got


async def _place(outcome: Callable[[_PlaceLink], int | DuplexError]) -> tuple[_PlaceLink, int] | DuplexError:
    pool = WorkerPool(["10.1.2.3:7000", "10.1.2.4:7000"], link_factory=_PlaceLink)
    for link in pool.links.values():
        link.outcome = outcome
    try:
        return await pool.place("sess_x", 1, False)
    except DuplexError as err:
        return err


async def test_placement_failures_name_no_worker(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="session_service.workers.placement")
    got = await _place(lambda _l: _unreachable())
    assert isinstance(got, DuplexError) and (got.code, got.retryable) == ("worker_unavailable", True)
    assert_no_leak(got.message)
    # The details are logged, for the operator.
    assert "10.1.2.3:7000" in caplog.text and "Connection refused" in caplog.text

    odd = DuplexError(
        ErrorCode.INTERNAL, f"<grpc._cython.cygrpc.SendMessageOperation object at 0x7f3a> {GRPC_DETAILS}"
    )
    got = await _place(lambda _l: odd)
    assert isinstance(got, DuplexError) and got.code == "worker_unavailable"
    assert_no_leak(got.message)

    def went_away(link: _PlaceLink) -> int:
        link.generation += 1
        return 1

    got = await _place(went_away)
    assert isinstance(got, DuplexError) and got.code == "worker_unavailable"
    assert_no_leak(got.message)


async def test_a_full_worker_is_skipped_and_all_full_is_capacity_exhausted() -> None:
    full = CapacityError(ErrorCode.CAPACITY_EXHAUSTED, "worker holds its maximum of 2 sessions")
    got = await _place(lambda _l: full)
    assert isinstance(got, CapacityError) and (got.code, got.retryable) == ("capacity_exhausted", True)
    assert_no_leak(got.message)
    first: list[str] = []

    def one_full(link: _PlaceLink) -> int | DuplexError:
        first.append(link.address)
        return full if len(first) == 1 else 5

    got = await _place(one_full)
    assert not isinstance(got, DuplexError) and got[1] == 5 and got[0].address == first[1]


class _FailingCall:
    async def write(self, cmd: worker_pb2.WorkerCommand) -> None:
        raise RuntimeError(f"<grpc._cython.cygrpc.SendMessageOperation object at 0x7f3a4c> to {GRPC_DETAILS}")


def _link() -> WorkerLink:
    return WorkerLink(
        "10.1.2.3:7000",
        owner="replica-m",
        plugin=ParrotPlugin(),
        on_step=lambda _l, _s: None,
        on_lost=lambda _l: None,
        on_health=lambda: None,
    )


async def test_link_failures_name_no_worker() -> None:
    link = _link()
    try:
        with pytest.raises(UnavailableError) as err:
            link.submit([])
        assert err.value.code == "worker_unavailable"
        assert_no_leak(err.value.message)
        # A write that fails: the writers waiting on it hear a generic loss.
        link._healthy = True  # as on an open stream (the test drives the sender itself)
        fut = link.submit([worker_pb2.Submission(request_id="s1")])
        with pytest.raises(RuntimeError):
            await link._send_loop(_FailingCall())  # type: ignore[arg-type]
        assert isinstance(fut.exception(), ConnectionError)
        assert_no_leak(str(fut.exception()))
        # A stream lost with writes pending: the same.
        link._healthy = True
        fut = link.submit([worker_pb2.Submission(request_id="s1")])
        link._lose()
        assert isinstance(fut.exception(), ConnectionError)
        assert_no_leak(str(fut.exception()))
    finally:
        with contextlib.suppress(Exception):
            await link.close()
