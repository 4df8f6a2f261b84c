"""Losing a worker and getting it back: one session service, two parrot workers.

- ``kill -9`` of one worker process fails exactly its sessions (``worker_unavailable``,
  retryable; an active response ends FAILED) and nothing else: the other worker's sessions
  finish their turns with the right content, and no session ever hears another's audio.
- A session whose worker died goes on with its next turn on a healthy worker (its model state,
  e.g. the VAD state and any uncommitted input, is lost with the worker; the session is not).
- A hung worker process (SIGSTOP: its connection stays up) is dropped by the stall timeout and
  taken back when it answers again.
- Both workers hung: the failover finds none and the turn is given up, all of it (what the user
  said meanwhile too); once they answer again, the next turns are answered as before.
- Placement is rendezvous over the HEALTHY workers only; health stays SERVING while one worker is
  reachable, goes NOT_SERVING without any, and comes back when a worker is restarted on its old
  address (the link reconnects with backoff), after which old and new sessions use it.

The workers that get SIGKILL or SIGSTOP are real processes (only a process shows those); the
session service is in this process (``tests.session_helpers.session_server``), and so is the
whole stack of the placement test, where a worker is lost by stopping its server and restarted
by a new one on the same port.

In process (races a real kill can hit but a test cannot time): placement skips a worker that
does not answer its Attach or whose stream changed meanwhile, and never goes around a fencing
refusal; a session whose worker died with an append in flight goes on elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.audio import PCM16K_MONO, decode, encode
from duplex.errors import BadRequestError, DuplexError, ErrorCode, FencedError, UnavailableError
from duplex.serving import split_host_port
from duplex.v1 import common_pb2, session_pb2, worker_pb2, worker_pb2_grpc
from session_service.api.server import SessionServer
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.runner import WorkerHandle
from session_service.workers.link import WorkerLink
from session_service.workers.liveness import Liveness
from session_service.workers.placement import WorkerPool, rendezvous_pick, rendezvous_rank
from tests.fakes import ManualClock
from tests.procs import ServiceProcess, start_all
from tests.session_helpers import (
    Conversation,
    drain,
    open_event,
    sample,
    session_server,
    similarity,
    speech,
    to_16k,
    unit_runner,
    utterance_pcm,
    wait_workers_healthy,
    worker_args,
    worker_server,
)
from worker_service.models.parrot import parrot_reply

#: Every session asks for a non-default pitch: a session moved to another worker must carry its
#: model options there (the worker default, 4 semitones, would give a recognisably wrong reply).
PITCH = -3.0
FRAME = 512
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: The session tier's metrics read here (only the in-process session service writes them).
PLACED = "duplex_session_worker_sessions"
STALLS = "duplex_session_worker_stalls_total"
#: Sessions are never closed for idleness during a test.
# A restarted reply has restart_timeout_s (3 s by default) to bring audio back; here three sessions'
# seconds of input are replayed on the one worker left, which on a shared CI machine outlasted 3 s
# (that bound has tests of its own: tests/test_session_replay.py). These tests check what comes back.
RUNNER = {"idle_timeout_s": 60, "restart_timeout_s": 15.0}


class Placed:
    """Sessions the session service holds on each worker: its placement gauge, relative to its
    value when this was made (an earlier test in this process may have used the same port)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self.before = [sample(PLACED, {"worker": a}) for a in self.addresses]

    def __call__(self, worker: int) -> float:
        return sample(PLACED, {"worker": self.addresses[worker]}) - self.before[worker]


@dataclass
class Stack:
    """Two worker processes and a session service in this process in front of them."""

    workers: list[ServiceProcess]
    session: SessionServer
    placed: Placed

    @property
    def addresses(self) -> list[str]:
        return [w.grpc for w in self.workers]

    def choice(self, session_id: str) -> int:
        """The worker rendezvous placement chooses for the session when both are healthy: by
        the workers' own ids (what their Describe said; a link keeps it after a loss)."""
        ids = []
        for address in self.addresses:
            description = self.session.pool.links[address].description
            assert description is not None
            ids.append(description.worker_id)
        return ids.index(rendezvous_pick(session_id, ids) or "")

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i``: no drain, no goodbye, its streams just break."""
        proc = self.workers[i].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.asynccontextmanager
async def running(**session_config: Any) -> AsyncIterator[Stack]:
    """Two worker processes (started in parallel) and the session service (``session_config``:
    ``ServiceConfig`` fields), once both workers are healthy; every worker process is killed by
    its pid afterwards (the session service is stopped first)."""
    started: list[ServiceProcess] = []
    try:
        workers = await asyncio.to_thread(start_all, [worker_args(device="cpu") for _ in range(2)], started)
        addresses = [w.grpc for w in workers]
        async with session_server(addresses, runner=RUNNER, **session_config) as session:
            yield Stack(workers, session, Placed(addresses))
    finally:
        # SIGKILL, stopped (SIGSTOP) or not: a worker's own SIGTERM drain is not what these tests
        # check (test_worker_process does), and it takes a process most of a second.
        for w in started:
            if w.proc.poll() is None:
                w.proc.kill()
        await asyncio.gather(*(asyncio.to_thread(w.proc.wait, 10) for w in started))


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running() as s:
        yield s


@pytest.fixture
async def stall_stack() -> AsyncIterator[Stack]:
    """The stack with a 1 s worker stall timeout (keepalive would take about 40 s)."""
    async with running(worker_stall_timeout_s=1.0) as s:
        yield s


# ---- helpers ---------------------------------------------------------------------------------


async def health(address: str) -> int:
    """The session service's health, the same for the server ("") and the session service.

    The two are set one after the other, so a read that falls between the two writes of one
    change sees them differ: read again until they agree (they must, within a second)."""
    deadline = time.monotonic() + 1.0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            got = {
                (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                for name in ("", "duplex.v1.DuplexSession")
            }
            if len(got) == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
    assert len(got) == 1, got
    status: int = got.pop()
    return status


async def wait_health(address: str, want: int, *, within: float) -> None:
    deadline = time.monotonic() + within
    while (got := await health(address)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"health is {got}, want {want} after {within}s")
        await asyncio.sleep(0.05)


async def wait_links(server: SessionServer, n: int, *, within: float) -> None:
    """Until exactly ``n`` of the session service's worker links are healthy."""
    await wait_workers_healthy(server, n, within=within, exactly=True)


def open_session() -> session_pb2.ClientEvent:
    return open_event(extra_body={"pitch_semitones": PITCH})


def close(conv: Conversation) -> None:
    conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))


@dataclass
class Turn:
    """One utterance a session spoke, from where it began in the session's event list."""

    conv: Conversation
    voice: np.ndarray
    start: int
    phase: int
    """Where the utterance sits in the worker's frame grid (samples sent before it, mod a frame)."""
    pcm: bytes

    @classmethod
    async def speak(cls, conv: Conversation, voice: np.ndarray, *, speedup: float = 4.0) -> Turn:
        pcm = utterance_pcm(voice, PCM16K_MONO)
        turn = cls(conv, voice, len(conv.events), -(conv.sent_bytes // 2) % FRAME, pcm)
        await conv.stream(pcm, PCM16K_MONO, speedup=speedup)
        return turn

    def events(self, kind: str) -> list[session_pb2.ServerEvent]:
        return [e for e in self.conv.events[self.start :] if e.WhichOneof("event") == kind]

    async def done(self, within: float = 20) -> session_pb2.ResponseDone:
        ev = await self.conv.wait_kind("response_done", start=self.start, within=within)
        return ev.response_done

    def reply(self, response_id: str) -> np.ndarray:
        pcm = b"".join(
            e.audio_delta.pcm for e in self.events("audio_delta") if e.audio_delta.response_id == response_id
        )
        return to_16k(pcm, PCM16K_MONO)

    def expected(self, got: np.ndarray) -> np.ndarray:
        """parrot_reply of the frame-aligned committed span of this utterance that best explains
        ``got`` (the worker cuts the span on its frame grid, padded by a frame each side)."""
        committed = self.events("committed")[-1].committed
        n = round(committed.audio_ms * 16 / FRAME) * FRAME
        heard = decode(self.pcm, PCM16K_MONO)[:, 0]
        best, best_score = parrot_reply(heard[:n], PITCH), -1.0
        for a in range(self.phase, min(len(heard) - n, 14 * FRAME) + 1, FRAME):
            cand = to_16k(encode(parrot_reply(heard[a : a + n], PITCH), PCM16K_MONO), PCM16K_MONO)
            score = similarity(got, cand[: len(got)])
            if score > best_score:
                best, best_score = cand, score
        return best


def prefix_similarity(got: np.ndarray, expected: np.ndarray) -> float:
    """How well ``got`` matches the start of ``expected`` (a reply cut short is a prefix of it)."""
    return similarity(got, expected[: len(got)])


def assert_own_content(turns: list[Turn], got: list[np.ndarray], *, prefix: bool = False) -> None:
    """Each reply matches its own utterance's expected reply, clearly better than anyone else's."""
    expected = [t.expected(g) for t, g in zip(turns, got, strict=True)]
    score = prefix_similarity if prefix else similarity
    for i, g in enumerate(got):
        scores = [score(g, e) for e in expected]
        own = scores[i]
        others = max((s for j, s in enumerate(scores) if j != i), default=0.0)
        assert own > 0.8 and own > others + 0.3, (i, own, others)


def assert_only_own_audio(conv: Conversation) -> None:
    """Every audio delta belongs to a response this session started, in the session's epoch."""
    own = {e.response_started.response_id: e.response_started.epoch for e in conv.of("response_started")}
    for e in conv.of("audio_delta"):
        assert own.get(e.audio_delta.response_id) == e.audio_delta.epoch, e.audio_delta.response_id


# ---- tests -----------------------------------------------------------------------------------


async def close_all_checked(convs: Sequence[Conversation]) -> None:
    """Every session heard only its own audio and is still open; close them all."""
    for c in convs:
        assert_only_own_audio(c)
        assert "closed" not in c.kinds()
        close(c)
    await asyncio.gather(*(c.wait_done() for c in convs))


def restarted(turn: Turn) -> tuple[session_pb2.ResponseDone, session_pb2.ResponseStarted]:
    """The response of ``turn`` its worker's loss interrupted, and the one that replaced it."""
    started = turn.events("response_started")
    failed = [d.response_done for d in turn.events("response_done")]
    assert len(started) == 2 and len(failed) == 2, turn.conv.kinds()[turn.start :]
    first, second = started[0].response_started, started[1].response_started
    assert failed[0].response_id == first.response_id
    assert (failed[0].status, failed[0].reason) == (session_pb2.RESPONSE_STATUS_FAILED, "worker_unavailable")
    assert second.turn_id == first.turn_id and second.response_id != first.response_id
    # Nothing of the interrupted response after its response_done.
    kinds = turn.conv.kinds()
    i_done = next(
        i
        for i, e in enumerate(turn.conv.events)
        if e.HasField("response_done") and e.response_done.response_id == first.response_id
    )
    late = [e for e in turn.conv.events[i_done:] if e.HasField("audio_delta")]
    assert all(e.audio_delta.response_id != first.response_id for e in late)
    assert "error" not in kinds[turn.start :], "a turn that survived its worker reported an error"
    return failed[0], second


@pytest.mark.process
async def test_killed_worker_costs_its_sessions_nothing_and_no_one_else_anything(stack: Stack) -> None:
    """A worker SIGKILLed mid-turn: its sessions move to the other worker at once, their turns'
    input is replayed there, an interrupted reply is failed and restarted for the same turn and
    plays complete, and speech in progress goes on; the other worker's sessions see nothing."""
    replayed_before = sample("duplex_session_replayed_frames_total")
    async with grpc.aio.insecure_channel(stack.session.address) as ch:
        # Open sessions until worker 0 holds three and worker 1 two (rendezvous over both).
        convs: list[Conversation] = []
        on: dict[int, list[Conversation]] = {0: [], 1: []}
        while len(on[0]) < 3 or len(on[1]) < 2:
            assert len(convs) < 32, "rendezvous placement never used one of the workers"
            conv = Conversation(ch).start(open_session())
            sid = (await conv.wait_kind("opened")).opened.session_id
            convs.append(conv)
            on[stack.choice(sid)].append(conv)
        assert (stack.placed(0), stack.placed(1)) == (len(on[0]), len(on[1]))
        victims, survivors = on[0], on[1]
        replying, speaking = victims[:2], victims[2]

        # Two victims say something long (their replies run ~3 s at the input's pace), the
        # survivors something short; a third victim starts talking just before the kill.
        long_voices = [np.concatenate([speech(i), speech(i + 1), speech(i + 2)]) for i in (0, 3)]
        survivor_turns = asyncio.gather(
            *(Turn.speak(c, v) for c, v in zip(survivors[:2], [speech(8), speech(9)], strict=True))
        )
        victim_turns = await asyncio.gather(
            *(Turn.speak(c, v) for c, v in zip(replying, long_voices, strict=True))
        )
        for c in replying:
            await c.wait_kind("audio_delta", within=15)
        assert not any(c.of("response_done") for c in replying), "a reply ended before the kill"
        mid_speech = asyncio.ensure_future(Turn.speak(speaking, speech(11), speedup=1.0))
        await speaking.wait_kind("speech_started", within=5)
        stack.kill(0)

        # The interrupted replies end failed/worker_unavailable, restart for the same turn on the
        # surviving worker, and play out complete and right (the utterance was replayed there).
        for t in victim_turns:
            first = await t.conv.wait_kind("response_done", start=t.start, within=20)
            done = await t.conv.wait_kind("response_done", start=t.conv.events.index(first) + 1, within=20)
            assert done.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
        restarts = [restarted(t) for t in victim_turns]
        v_got = [t.reply(second.response_id) for t, (_, second) in zip(victim_turns, restarts, strict=True)]
        assert_own_content(victim_turns, v_got)
        # The speech in progress went on on the new worker: the whole utterance is answered.
        t = await mid_speech
        done = await t.done()
        assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, (done, t.conv.kinds()[t.start :])
        assert "error" not in t.conv.kinds()[t.start :]
        assert_own_content([t], [t.reply(done.response_id)])
        assert sample("duplex_session_replayed_frames_total") > replayed_before
        await wait_links(stack.session, 1, within=5)
        assert await health(stack.session.address) == SERVING

        # Survivors were not disturbed: full, correct replies, no errors.
        s_turns = await survivor_turns
        s_done = [await t.done() for t in s_turns]
        assert all(d.status == session_pb2.RESPONSE_STATUS_COMPLETED for d in s_done), s_done
        s_got = [t.reply(d.response_id) for t, d in zip(s_turns, s_done, strict=True)]
        assert_own_content(s_turns, s_got)
        for c in survivors:
            assert c.of("error") == [], c.of("error")
        # Every victim moved at once, idle or not; none was told of an error.
        assert (stack.placed(0), stack.placed(1)) == (0, len(convs))
        for c in victims:
            assert c.of("error") == [], c.of("error")

        # The victims' next turns work as any other.
        again = await asyncio.gather(*(Turn.speak(c, speech(12 + k)) for k, c in enumerate(replying)))
        a_done = [await t.done() for t in again]
        assert all(d.status == session_pb2.RESPONSE_STATUS_COMPLETED for d in a_done), a_done
        assert_own_content(again, [t.reply(d.response_id) for t, d in zip(again, a_done, strict=True)])
        await close_all_checked(convs)


async def test_placement_health_and_reconnect_after_worker_loss() -> None:
    # All in process: a worker is lost when its server stops (its streams end, its port closes),
    # and restarted as a new server on the same port. (A SIGKILLed process: the test above.)
    # Replies are paced by silence continuation, here at 4x (the checks are of content and
    # events); the reconnect backoff is capped at 0.5 s (the default 5 s cap would make the wait
    # for the restarted worker anything up to ~2.5 s, by the jitter of a backoff grown while it
    # was down).
    dead, alive = 0, 1
    async with contextlib.AsyncExitStack() as workers_up:
        workers = [await workers_up.enter_async_context(worker_server()) for _ in range(2)]
        both = [w.address for w in workers]
        ids = [w.config.worker_id for w in workers]  # placement ranks workers by their ids
        async with (
            session_server(both, runner=RUNNER, clock_speed=4.0, worker_backoff_max_s=0.5) as server,
            grpc.aio.insecure_channel(server.address) as ch,
        ):
            placed = Placed(both)
            await workers[dead].stop(grace=0)
            await wait_links(server, 1, within=5)
            assert await health(server.address) == SERVING
            # New sessions go only to the surviving worker, including ones whose first choice is dead.
            convs: list[Conversation] = []
            homeless: list[Conversation] = []
            while len(convs) < 3 or not homeless:
                assert len(convs) < 16, "no session id ever preferred the dead worker"
                conv = Conversation(ch).start(open_session())
                sid = (await conv.wait_kind("opened")).opened.session_id
                convs.append(conv)
                if rendezvous_pick(sid, ids) == ids[dead]:
                    homeless.append(conv)
            assert (placed(dead), placed(alive)) == (0, len(convs))
            talkers = [homeless[0], next(c for c in convs if c is not homeless[0])]
            turns = await asyncio.gather(*(Turn.speak(c, speech(k)) for k, c in enumerate(talkers)))
            done = [await t.done() for t in turns]
            assert all(d.status == session_pb2.RESPONSE_STATUS_COMPLETED for d in done), done
            assert_own_content(turns, [t.reply(d.response_id) for t, d in zip(turns, done, strict=True)])

            # Both workers gone: NOT_SERVING, sessions told, new opens refused (retryable).
            await workers[alive].stop(grace=0)
            await wait_health(server.address, NOT_SERVING, within=5)
            for c in convs:
                err = (await c.wait_kind("error", within=5)).error
                assert err.code == "worker_unavailable" and err.retryable
            refused = Conversation(ch).start(open_session())
            await refused.wait_done()
            assert refused.status == grpc.StatusCode.UNAVAILABLE and refused.error is not None
            assert refused.error.code == "worker_unavailable" and refused.error.retryable, refused.error
            # A session with no worker to go to gets a clear, retryable error and stays open.
            survivor = talkers[0]
            survivor.seq += 1
            n_errors = len(survivor.of("error"))
            survivor.send(
                session_pb2.ClientEvent(
                    event_id="orphan",
                    append=session_pb2.InputAudioAppend(seq=survivor.seq, pcm=b"\x00" * 2 * FRAME),
                )
            )
            err = (
                await survivor.wait_for(lambda e: e.HasField("error") and e.error.event_id == "orphan")
            ).error
            assert err.code == "worker_unavailable" and err.retryable, err
            assert len(survivor.of("error")) == n_errors + 1 and "closed" not in survivor.kinds()

            # A worker restarted on its old address: the link reconnects (with backoff), SERVING again.
            _, port = split_host_port(both[dead])
            restarted = await workers_up.enter_async_context(worker_server(listen=f"127.0.0.1:{port}"))
            assert restarted.address == both[dead]
            await wait_health(server.address, SERVING, within=15)
            await wait_links(server, 1, within=5)
            # New sessions use it, and so does the old session whose worker died (its next turn).
            fresh = Conversation(ch).start(open_session())
            await fresh.wait_kind("opened")
            back = list(await asyncio.gather(Turn.speak(fresh, speech(6)), Turn.speak(survivor, speech(7))))
            done = [await t.done() for t in back]
            assert all(d.status == session_pb2.RESPONSE_STATUS_COMPLETED for d in done), done
            assert_own_content(back, [t.reply(d.response_id) for t, d in zip(back, done, strict=True)])
            assert placed(dead) == 2
            for c in [*convs, fresh]:
                assert_only_own_audio(c)
                close(c)
            await asyncio.gather(*(c.wait_done() for c in [*convs, fresh]))


async def babble(conv: Conversation, stop: asyncio.Event) -> None:
    """Real-time silence in 20 ms appends until ``stop`` (input the worker owes consumption of)."""
    pcm = b"\x00\x00" * 320
    while not stop.is_set():
        conv.append(pcm)
        await asyncio.sleep(0.02)


async def open_until(
    ch: grpc.aio.Channel, stack: Stack, want: Callable[[int], bool], *, limit: int = 16
) -> tuple[Conversation, list[Conversation]]:
    """Open sessions until one's rendezvous choice (over both workers) satisfies ``want``;
    returns it and every session opened on the way (for the caller to close)."""
    opened: list[Conversation] = []
    while len(opened) < limit:
        conv = Conversation(ch).start(open_session())
        opened.append(conv)
        sid = (await conv.wait_kind("opened")).opened.session_id
        if want(stack.choice(sid)):
            return conv, opened
    raise AssertionError("rendezvous placement never chose the wanted worker")


@pytest.mark.process
async def test_hung_worker_is_dropped_quickly_and_taken_back_when_it_answers_again(
    stall_stack: Stack,
) -> None:
    # SIGSTOP keeps the worker's TCP connection up: only the application-level stall timeout
    # (1 s here) notices it, long before keepalive (30 s + 10 s) would.
    stack = stall_stack
    hung_pid = stack.workers[0].pid
    stalls_before = sample(STALLS, {"worker": stack.addresses[0]})
    stopped = False
    stop_babble = asyncio.Event()
    babblers: list[asyncio.Task[None]] = []
    try:
        async with grpc.aio.insecure_channel(stack.session.address) as ch:
            on: dict[int, list[Conversation]] = {0: [], 1: []}
            convs: list[Conversation] = []
            while min(len(v) for v in on.values()) < 2:
                conv, opened = await open_until(ch, stack, lambda _i: True)
                convs.extend(opened)
                sid = conv.events[0].opened.session_id
                on[stack.choice(sid)].append(conv)
                assert len(convs) < 24
            assert (stack.placed(0), stack.placed(1)) == (len(on[0]), len(on[1]))
            victims, survivors = on[0], on[1]
            talker, quiet = survivors[0], [*victims[1:], *survivors[1:]]
            babblers = [asyncio.create_task(babble(c, stop_babble)) for c in quiet]
            for c in quiet:
                await c.wait_kind("input_ack", within=5)
            turn = asyncio.ensure_future(Turn.speak(talker, speech(8)))
            # One victim is mid-reply when its worker hangs.
            long_voice = np.concatenate([speech(0), speech(1), speech(2)])
            hung_turn = await Turn.speak(victims[0], long_voice)
            await victims[0].wait_kind("audio_delta", start=hung_turn.start, within=15)

            # The worker hangs while its sessions send audio (appends it owes an answer to).
            os.kill(hung_pid, signal.SIGSTOP)
            stopped = True
            marks = [len(c.events) for c in victims]
            await wait_links(stack.session, 1, within=10)  # far below the ~40 s keepalive
            assert await health(stack.session.address) == SERVING
            stalls = sample(STALLS, {"worker": stack.addresses[0]}) - stalls_before
            assert stalls == 1.0, stalls  # counted, on the hung worker's label
            # Its sessions moved to the healthy worker at once and go on there: appends acked,
            # the interrupted reply restarted for its turn and complete; no error for anyone.
            for c, mark in zip(victims[1:], marks[1:], strict=True):
                await c.wait_kind("input_ack", start=mark, within=5)
            first = await victims[0].wait_kind("response_done", start=hung_turn.start, within=5)
            await victims[0].wait_kind("response_done", start=victims[0].events.index(first) + 1, within=20)
            _, second = restarted(hung_turn)
            assert_own_content([hung_turn], [hung_turn.reply(second.response_id)])
            assert stack.placed(0) == 0
            for c in victims:
                assert c.of("error") == [], c.of("error")

            # The healthy worker's sessions were not disturbed: a full, correct reply, no errors.
            t = await turn
            done = await t.done()
            assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
            assert_own_content([t], [t.reply(done.response_id)])
            for c in survivors:
                assert c.of("error") == [], c.of("error")

            # New sessions go to the healthy worker, even those whose first choice is hung.
            homeless, opened = await open_until(ch, stack, lambda i: i == 0)
            convs.extend(opened)
            assert stack.placed(0) == 0

            # The worker answers again: the link reconnects and new sessions use it.
            # Still out while hung (a reconnect needs the worker to answer Describe).
            assert len(stack.session.pool.healthy()) == 1
            os.kill(hung_pid, signal.SIGCONT)
            stopped = False
            await wait_links(stack.session, 2, within=10)
            assert await health(stack.session.address) == SERVING
            back, opened = await open_until(ch, stack, lambda i: i == 0)
            convs.extend(opened)
            t = await Turn.speak(back, speech(6))
            done = await t.done()
            assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
            assert_own_content([t], [t.reply(done.response_id)])
            assert stack.placed(0) == 1
            assert back.of("error") == [] and homeless.of("error") == []

            stop_babble.set()
            await asyncio.gather(*babblers)
            await close_all_checked(convs)
    finally:
        stop_babble.set()
        for task in babblers:
            task.cancel()
        if stopped:
            os.kill(hung_pid, signal.SIGCONT)


@pytest.mark.process
async def test_after_a_failed_failover_the_next_turns_are_answered_as_before() -> None:
    """Both workers hang mid-reply, so the failover finds none (the Attach to the other one
    times out): the reply ends failed/worker_unavailable and the turn is given up
    (``error{worker_unavailable}``), with what the user said while the reply was stuck, which
    the hung worker never heard. Once the workers answer again, each of the next turns gets one
    response, complete, answering that turn's own utterance: nothing barged in on.

    Before, the session kept the failed turn's input after its commit, that utterance included,
    and replayed it on the worker it found next, ahead of the next turn's input: the model heard
    the utterance only then, committed and answered it, and the user's next turn barged in on
    that answer (a client taking it for its own reply saw each next reply cut ~1 s in)."""
    stopped: list[int] = []
    async with running(worker_stall_timeout_s=1.0, attach_timeout_s=0.5, worker_backoff_max_s=0.5) as stack:
        try:
            async with grpc.aio.insecure_channel(stack.session.address) as ch:
                conv = Conversation(ch).start(open_session())
                await conv.wait_kind("opened")
                turn = await Turn.speak(conv, speech(0))
                await conv.wait_kind("audio_delta", start=turn.start, within=15)
                for w in stack.workers:
                    os.kill(w.pid, signal.SIGSTOP)
                    stopped.append(w.pid)
                # The reply stops and the user says something (fast: all of it reaches the hung
                # worker's link before the stall timeout, as input the worker owes an answer to).
                await Turn.speak(conv, speech(3), speedup=16.0)
                failed = await turn.done()
                assert (failed.status, failed.reason) == (
                    session_pb2.RESPONSE_STATUS_FAILED,
                    "worker_unavailable",
                ), failed
                err = (await conv.wait_kind("error", start=turn.start, within=20)).error
                assert err.code == "worker_unavailable" and err.retryable, err
                assert len(turn.events("response_started")) == 1, "a failed failover restarted the reply"
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
                stopped.clear()
                await wait_links(stack.session, 2, within=10)

                back = len(conv.events)
                turns: list[Turn] = []
                got: list[np.ndarray] = []
                expected: list[np.ndarray] = []
                for i in (4, 5, 6):
                    t = await Turn.speak(conv, speech(i))
                    done = await t.done()
                    assert done.status == session_pb2.RESPONSE_STATUS_COMPLETED, (i, conv.kinds()[t.start :])
                    assert len(t.events("response_started")) == 1, (i, conv.kinds()[t.start :])
                    turns.append(t)
                    got.append(t.reply(done.response_id))
                    expected.append(t.expected(got[-1]))  # now: it reads the turn's last commit
                # Each reply is its own utterance's, clearly better than another turn's.
                for i, g in enumerate(got):
                    scores = [similarity(g, e) for e in expected]
                    others = max(s for j, s in enumerate(scores) if j != i)
                    assert scores[i] > 0.8 and scores[i] > others + 0.3, (i, scores)
                after = conv.events[back:]
                # A worker that fenced the session before may say so (worker_moved); nothing else
                # is cancelled, and nothing fails.
                cancelled = [e.audio_cancelled.reason for e in after if e.HasField("audio_cancelled")]
                assert set(cancelled) <= {"worker_moved"}, cancelled
                assert [e.error for e in after if e.HasField("error")] == []
                assert len(conv.of("speech_started")) == len(conv.of("speech_stopped")), conv.kinds()
                assert_only_own_audio(conv)
                close(conv)
                await conv.wait_done()
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)


# ---- placement, in process (the races a real kill can hit but a test cannot time) ------------


class _PlaceLink:
    """A worker link as placement sees it; its Attach answers ``outcome(link)``."""

    def __init__(self, address: str, on_health: Callable[[], None]) -> None:
        self.address = address
        self.worker_id = address  # placement ranks workers by their ids
        self.healthy = True
        self.generation = 1
        self.outcome: Outcome = lambda _link: 1
        self.calls: list[str] | None = None

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
        assert self.calls is not None
        self.calls.append(self.address)
        got = self.outcome(self)
        if isinstance(got, DuplexError):
            raise got
        return got


def _pool(n: int) -> WorkerPool[_PlaceLink]:
    """A pool of ``n`` healthy links (nothing is dialled)."""
    return WorkerPool([f"127.0.0.1:{5000 + i}" for i in range(n)], link_factory=_PlaceLink)


Outcome = Callable[[_PlaceLink], "int | DuplexError"]


def _unreachable(status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> DuplexError:
    err = UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "connection refused")
    err.status = status
    return err


async def _place_with(
    pool: WorkerPool[_PlaceLink], outcome: Outcome
) -> tuple[list[str], tuple[_PlaceLink, int] | DuplexError]:
    """``pool.place`` with each link's Attach answering ``outcome(link)``; the links tried, in order."""
    calls: list[str] = []
    for link in pool.links.values():
        link.outcome, link.calls = outcome, calls
    try:
        return calls, await pool.place("sess_x", 3, False)
    except DuplexError as err:
        return calls, err
    finally:
        await pool.close()


async def test_place_uses_the_rendezvous_choice_among_healthy_workers() -> None:
    pool = _pool(3)
    ranked = rendezvous_rank("sess_x", pool.links)
    pool.links[ranked[0]].healthy = False
    calls, got = await _place_with(pool, lambda link: 3)
    assert calls == [ranked[1]]
    assert not isinstance(got, DuplexError) and (got[0].address, got[1]) == (ranked[1], 3)


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_place_skips_a_worker_that_does_not_answer(status: grpc.StatusCode) -> None:
    pool = _pool(3)
    ranked = rendezvous_rank("sess_x", pool.links)
    calls, got = await _place_with(
        pool, lambda link: _unreachable(status) if link.address == ranked[0] else 4
    )
    assert calls == ranked[:2]
    assert not isinstance(got, DuplexError) and (got[0].address, got[1]) == (ranked[1], 4)


async def test_place_fails_retryably_when_no_worker_answers() -> None:
    calls, got = await _place_with(_pool(2), lambda link: _unreachable())
    assert len(calls) == 2 and isinstance(got, DuplexError)
    assert got.code == "worker_unavailable" and got.retryable
    calls, got = await _place_with(_pool(0), lambda link: 1)
    assert calls == [] and isinstance(got, DuplexError) and got.code == "worker_unavailable"


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (FencedError(ErrorCode.NOT_OWNER, "another owner"), "not_owner"),
        (FencedError(ErrorCode.STALE_EPOCH, "stale"), "stale_epoch"),
        (BadRequestError(ErrorCode.INVALID_EVENT, "bad"), "worker_unavailable"),
    ],
)
async def test_place_does_not_go_around_a_refusal(err: DuplexError, code: str) -> None:
    calls, got = await _place_with(_pool(2), lambda link: err)
    assert len(calls) == 1 and isinstance(got, DuplexError) and got.code == code, (calls, got)


async def test_place_never_returns_a_link_whose_stream_changed_during_attach() -> None:
    # The Run stream was lost (and maybe reopened to a restarted worker) while the Attach was in
    # flight: the attachment may be gone with it, and the session's runner would never hear of
    # the loss (it is not registered yet), so the next worker is used.
    pool = _pool(2)
    ranked = rendezvous_rank("sess_x", pool.links)

    def outcome(link: _PlaceLink) -> int:
        if link.address == ranked[0]:
            link.generation += 1
        return 5

    calls, got = await _place_with(pool, outcome)
    assert calls == ranked
    assert not isinstance(got, DuplexError) and got[0].address == ranked[1]


# ---- a session whose worker died mid-write, in process --------------------------------------


class _Link:
    """A worker link for one runner: writes stay in flight until the test resolves them."""

    def __init__(self, address: str, *, hold: bool) -> None:
        self.address = address
        self.healthy = True
        self.hold = hold
        self.subs: list[worker_pb2.Submission] = []
        self.in_flight: list[asyncio.Future[None]] = []

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.subs.extend(subs)
        if self.hold:
            self.in_flight.append(fut)
        else:
            fut.set_result(None)
        return fut

    def abort(self, abort: worker_pb2.Abort) -> None:
        pass

    def release(self, release: worker_pb2.Release) -> None:
        pass

    def die(self) -> None:
        """What a ``WorkerLink`` does when its stream is lost: fail the writes in flight."""
        self.healthy = False
        for fut in self.in_flight:
            fut.set_exception(ConnectionError(f"worker {self.address} went away"))


def _append(seq: int) -> session_pb2.ClientEvent:
    pcm = b"\x10\x00" * FRAME
    return session_pb2.ClientEvent(event_id=f"a{seq}", append=session_pb2.InputAudioAppend(seq=seq, pcm=pcm))


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_an_append_lost_mid_write_goes_to_the_new_worker() -> None:
    dead, healthy = _Link("a:1", hold=True), _Link("b:1", hold=False)

    async def placer(session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        return healthy, epoch

    # An ack per append (unit_runner's default), each read.
    runner = unit_runner(dead, session_id="sess_mid_write", pitch=PITCH, placer=placer)
    try:
        await runner.post(_append(1))
        await _settle()
        assert dead.in_flight, "the append was not written"
        dead.die()
        runner.on_worker_lost(dead)
        await _settle()
        await runner.post(_append(2))
        await _settle()
        events = drain(runner)
        # The append lost mid-write went to the healthy worker instead: no error, both acked,
        # and the healthy worker got the session's model options with the first submission.
        # (The append is in the turn's replay log from the moment it is handed to the link, so
        # the move replays it, after the replay's CLEAR.)
        assert [e for e in events if e.HasField("error")] == []
        assert [e.input_ack.seq for e in events if e.HasField("input_ack")] == [1, 2]
        assert [s.kind for s in healthy.subs] == [CLEAR, APPEND, APPEND]
        appends = [s for s in healthy.subs if s.kind == APPEND]
        assert [s.pcm for s in appends] == [s.pcm for s in dead.subs] + [_append(2).append.pcm]
        assert not any(s.replay for s in appends)  # no worker reported it: its news are heard
        assert healthy.subs[0].params["pitch_semitones"] == PITCH
    finally:
        runner.close("test")
        await runner.wait_closed()


# ---- liveness of a worker link, in process ---------------------------------------------------


def _sub(
    kind: worker_pb2.SubmissionKind.ValueType, rid: str = "r1", epoch: int = 1, seq: int = 0
) -> worker_pb2.Submission:
    return worker_pb2.Submission(
        request_id=rid, fence=common_pb2.Fence(session_id=rid, epoch=epoch), kind=kind, seq=seq
    )


def _update(
    rid: str = "r1",
    epoch: int = 1,
    *,
    input_seq: int = 0,
    committed_samples: int = 0,
    error: worker_pb2.WorkerError | None = None,
) -> worker_pb2.StepOutput:
    upd = worker_pb2.RequestUpdate(
        request_id=rid,
        fence=common_pb2.Fence(session_id=rid, epoch=epoch),
        input_seq=input_seq,
        committed_samples=committed_samples,
        error=error,
    )
    return worker_pb2.StepOutput(step=0, updates=[upd])


def _columns(*rows: tuple[str, int, int]) -> worker_pb2.StepOutput:
    """A step in columns: (request id, epoch, input_seq) per request stepped."""
    step = worker_pb2.StepOutput(step=5)
    for rid, epoch, seq in rows:
        c = step.columns
        c.request_id.append(rid)
        c.session_id.append(rid)
        c.epoch.append(epoch)
        c.turn_id.append(0)
        c.input_seq.append(seq)
    return step


def test_liveness_reads_acks_and_steps_in_columns() -> None:
    now = [100.0]
    live = Liveness(respond_answers=True, clock=lambda: now[0])
    live.written([_sub(APPEND, seq=1), _sub(APPEND, seq=2), _sub(RESPOND, rid="r2")])
    now[0] += 2
    assert live.owing == 2 and live.quiet_for() == 2.0
    live.heard(_columns(("r1", 1, 1), ("r2", 1, 0)))  # r2 stepped (its RESPOND answered), r1 half
    assert live.owing == 1 and live.quiet_for() == 0.0
    live.heard(_columns(("r1", 0, 9)))  # an older epoch's ack settles nothing
    assert live.owing == 1
    live.heard(_columns(("r1", 1, 0)))  # stepped without consuming more: still owed
    assert live.owing == 1
    live.heard(_columns(("r1", 1, 2)))
    assert live.owing == 0
    # A newer epoch's ack: the worker dropped the older work, nothing more comes of it.
    live.written([_sub(APPEND, seq=3)])
    live.heard(_columns(("r1", 2, 1)))
    assert live.owing == 0


APPEND = worker_pb2.SUBMISSION_KIND_APPEND
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND


def test_liveness_owes_only_what_the_worker_must_answer() -> None:
    now = [100.0]
    live = Liveness(respond_answers=False, clock=lambda: now[0])
    now[0] += 60
    assert live.quiet_for() == 0.0, "an idle link is never stalled"
    # A lockstep model's RESPOND (it replies only as input comes) and CLEAR owe nothing.
    live.written([_sub(RESPOND), _sub(worker_pb2.SUBMISSION_KIND_CLEAR)])
    now[0] += 60
    assert live.quiet_for() == 0.0
    # APPENDs owe their consumption: quiet counts from the write, not from the last output.
    live.written([_sub(APPEND, seq=1), _sub(APPEND, seq=2)])
    now[0] += 2
    assert live.quiet_for() == 2.0 and live.owing == 1
    live.heard(_update(input_seq=1))  # partly consumed: still owed, but the worker is alive
    assert live.quiet_for() == 0.0 and live.owing == 1
    now[0] += 1
    assert live.quiet_for() == 1.0
    live.heard(_update(input_seq=2))
    assert live.owing == 0
    now[0] += 60
    assert live.quiet_for() == 0.0
    # Output of an older epoch settles nothing; a release, a newer abort or an error do.
    live.written([_sub(APPEND, epoch=2, seq=1), _sub(COMMIT, rid="r2")])
    live.heard(_update(epoch=1, input_seq=5))
    assert live.owing == 2
    live.written([], abort=[worker_pb2.Abort(request_id="r1", fence=common_pb2.Fence(epoch=3))])
    live.written([], release=[worker_pb2.Release(request_id="r2")])
    assert live.owing == 0
    live.written([_sub(APPEND, rid="r3", seq=1)])
    live.heard(_update(rid="r3", error=worker_pb2.WorkerError(code="capacity")))
    assert live.owing == 0
    # Rejections come from the worker's asyncio side, which answers even with its engine thread
    # stuck: they settle the rejected request but do not prove the worker alive.
    live.written([_sub(APPEND, rid="r4", seq=1)])
    now[0] += 2
    live.heard(_update(rid="r5", error=worker_pb2.WorkerError(code="capacity")))
    assert live.owing == 1 and live.quiet_for() == 2.0
    live.heard(_update(rid="r4", input_seq=1))
    assert live.owing == 0
    # A newer epoch's work replaces what the older one owed (the worker drops the older work).
    live.written([_sub(APPEND, seq=7)])
    live.written([_sub(APPEND, epoch=2, seq=1)])
    live.heard(_update(epoch=2, input_seq=1))
    assert live.owing == 0
    # A free-running model's RESPOND owes its first step; a COMMIT its answer.
    free = Liveness(respond_answers=True, clock=lambda: now[0])
    free.written([_sub(RESPOND), _sub(COMMIT, rid="r2")])
    now[0] += 5
    assert free.quiet_for() == 5.0
    step = worker_pb2.StepOutput(
        step=3,
        batch=[worker_pb2.BatchEntry(request_id="r1", fence=common_pb2.Fence(session_id="r1", epoch=1))],
    )
    free.heard(step)
    free.heard(_update(rid="r2", committed_samples=512))
    assert free.owing == 0 and free.quiet_for() == 0.0


class _FakeWorker(worker_pb2_grpc.DuplexWorkerServicer):
    """A parrot-shaped worker that answers APPENDs (``answer``) or owes them forever (hung).

    An answer reports the input consumed up to ``behind`` appends before the one just read, so
    with ``behind`` 1 the worker is never quite done: it always owes the newest append."""

    def __init__(self) -> None:
        self.answer = True
        self.behind = 0
        self.streams = 0

    async def Describe(self, request: Any, context: Any) -> worker_pb2.WorkerDescription:
        return worker_pb2.WorkerDescription(model_id="parrot", frame_samples=FRAME)

    async def Attach(self, request: worker_pb2.AttachRequest, context: Any) -> worker_pb2.AttachResponse:
        return worker_pb2.AttachResponse(epoch=request.epoch)

    async def Run(self, request_iterator: Any, context: Any) -> AsyncIterator[worker_pb2.StepOutput]:
        self.streams += 1
        out: asyncio.Queue[worker_pb2.StepOutput] = asyncio.Queue()

        async def read() -> None:
            async for cmd in request_iterator:
                for sub in cmd.submit:
                    if self.answer and sub.kind == APPEND:
                        seq = sub.seq - self.behind
                        out.put_nowait(_update(sub.request_id, sub.fence.epoch, input_seq=seq))

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()


async def test_link_stalls_only_when_the_worker_owes_output_and_comes_back() -> None:
    # The watchdog runs on a manual clock (the stream itself in real time): "quiet for the
    # timeout" is exactly that much of the clock's time, however fast this machine is.
    fake = _FakeWorker()
    server = grpc.aio.server()
    worker_pb2_grpc.add_DuplexWorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    clock = ManualClock()
    timeout, tick = 0.2, 0.05  # the link's watchdog polls every timeout / 4
    lost: list[WorkerLink] = []
    steps: list[worker_pb2.StepOutput] = []
    changed = asyncio.Event()

    def on_lost(gone: WorkerLink) -> None:
        lost.append(gone)
        changed.set()

    def on_step(_link: WorkerLink, step: worker_pb2.StepOutput) -> None:
        steps.append(step)
        changed.set()

    async def until(pred: Callable[[], bool], within: float) -> None:
        async with asyncio.timeout(within):
            while not pred():
                changed.clear()
                await changed.wait()

    link = WorkerLink(
        f"127.0.0.1:{port}",
        owner="replica-a",
        plugin=ParrotPlugin(),
        on_step=on_step,
        on_lost=on_lost,
        on_health=changed.set,
        backoff_max_s=0.2,
        stall_timeout_s=timeout,
        clock=clock,
    )
    link.start()

    async def answered_work(n: int) -> None:
        """``n`` appends, half a timeout of the clock apart, the worker owing input all along
        (each answer reports all but the newest append consumed); then the last is consumed."""
        fake.behind = 1
        for seq in range(1, n + 1):
            heard = len(steps)
            await link.submit([_sub(APPEND, seq=seq)])
            await until(lambda: len(steps) > heard, 5)  # noqa: B023 (awaited here)
            assert link.liveness.owing == 1
            await clock.advance(timeout / 2, step=tick)
        fake.behind = 0
        heard = len(steps)
        await link.submit([_sub(APPEND, seq=n + 1)])
        await until(lambda: len(steps) > heard, 5)
        assert link.liveness.owing == 0

    try:
        await until(lambda: link.healthy, 5)
        # Idle for five stall timeouts: nothing is owed, so nothing is stalled.
        await clock.advance(5 * timeout, step=tick)
        # A worker that answers is not stalled either, however long the work goes on (here
        # ten timeouts, with input owed throughout).
        await answered_work(20)
        await clock.advance(5 * timeout, step=tick)
        assert (link.healthy, link.generation, link.stalls, lost) == (True, 1, 0, [])
        # The worker hangs with input owed: not lost before the timeout ...
        fake.answer = False
        for seq in range(21, 24):
            await link.submit([_sub(APPEND, seq=seq)])
        await clock.advance(timeout - tick, step=tick)
        assert (link.healthy, link.stalls, lost) == (True, 0, [])
        # ... lost once it has passed (by a watchdog tick), and counted once ...
        await clock.advance(2 * tick, step=tick)
        await until(lambda: bool(lost), 5)
        assert link.stalls == 1
        # ... and the link reconnects with backoff; a worker that answers again keeps it.
        fake.answer = True
        await until(lambda: link.healthy, 5)
        await answered_work(10)
        await clock.advance(5 * timeout, step=tick)
        assert (link.healthy, link.generation, link.stalls, len(lost)) == (True, 2, 1, 1)
        assert fake.streams == 2
    finally:
        await link.close()
        await server.stop(None)
