"""A worker hung mid-reply under a caller that talks like a live one (issue 36), in the README's
secure deployment (two parrot workers with mutual TLS, one session replica with TLS and bearer
tokens), as real processes.

The caller streams continuously at real time in 32 ms appends: a 3.3 s utterance, 1.2 s of
silence, then silence until its turn's reply is done (``response_done`` of its turn that is not
``restarting``), waiting at most ``PATIENCE_S`` after its end of speech; then its next utterance.
The worker its session is on is SIGSTOPped for ``HANG_S`` 2.5 s into turn 2's reply: the caller
gives up on turn 2 and speaks turn 3 while the worker is still hung, so turn 3's start is in the
input the session replays on the other worker, with turn 2's restarted reply.

What must hold: turn 2 is told (``response_done{FAILED, worker_unavailable, restarting}`` within
the stall timeout of the hang, then its restarted reply, which ends with a status of its own);
every later turn is answered once, completely (all of the utterance committed: nothing the user
said while the session moved is lost), with its end of speech -> first audio back to what it was
before the fault; no error; no audio of a response after it ended. On a build whose replay is
slow or whose barge-in drops the queued input, turn 3 loses its first second or more, or the
conversation runs behind.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from duplex.audio import PCM16K_MONO, encode
from duplex.v1 import session_pb2
from session_service.config import ServiceConfig
from tests.secure_stack import SecureStack, secure_stack
from tests.session_helpers import Conversation, open_event, speech

pytestmark = pytest.mark.process

CHUNK_MS = 32
UTTERANCE_S = 3.3
TAIL_S = 1.2
PATIENCE_S = 6.0
"""How long after its end of speech the caller waits for its turn's reply to be done."""
HANG_AFTER_S = 2.5
"""The worker is stopped this long after turn 2's first audio (mid-reply: the reply is 3.3 s)."""
HANG_S = 6.0
TURNS = 6
STALL_S = ServiceConfig(plugin="", workers=()).worker_stall_timeout_s
"""The session tier's stall timeout (its default, which the stack runs with)."""
LATENCY_SLACK_S = 0.5
"""How much later than turn 1's a later turn's first audio may come (a busy machine's jitter;
a conversation that fell behind is seconds behind)."""

COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
FAILED = session_pb2.RESPONSE_STATUS_FAILED


@dataclass
class Turn:
    index: int
    speech_start: float
    speech_end: float = 0.0
    turn_id: int | None = None
    committed_ms: int = 0
    done: list[session_pb2.ResponseDone] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    first_audio: float | None = None

    @property
    def final(self) -> session_pb2.ResponseDone | None:
        """The response_done that ends the turn (not one followed by a restart)."""
        return next((d for d in reversed(self.done) if not d.restarting), None)

    @property
    def latency(self) -> float | None:
        return None if self.first_audio is None else self.first_audio - self.speech_end


class LiveCaller:
    """Talks like a live caller: always streaming at real time; see the module docstring."""

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self.turns: list[Turn] = []
        self.step = PCM16K_MONO.bytes_for_ms(CHUNK_MS)
        self.silence = bytes(self.step)
        self._t0 = time.monotonic()
        self._sent = 0
        self._seen = 0
        self.audio_after_done: list[str] = []
        self.audio_ms: dict[str, int] = {}
        self._ended: set[str] = set()
        self.replying: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(1, TURNS + 1)}
        """Set once turn ``i``'s reply audio has begun."""

    async def _tick(self, pcm: bytes) -> None:
        self.conv.append(pcm)
        self._sent += 1
        delay = self._t0 + self._sent * CHUNK_MS / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self._read()

    def _read(self) -> None:
        """Files the events that came since the last look under the turns they belong to."""
        conv = self.conv
        while self._seen < len(conv.events):
            ev, at = conv.events[self._seen], conv.arrival[self._seen]
            self._seen += 1
            kind = ev.WhichOneof("event")
            if kind == "committed":
                turn = next((t for t in reversed(self.turns) if t.speech_start <= at), None)
                if turn is not None and turn.turn_id is None:
                    turn.turn_id, turn.committed_ms = ev.committed.turn_id, ev.committed.audio_ms
            elif kind == "audio_delta":
                ad = ev.audio_delta
                if ad.response_id in self._ended:
                    self.audio_after_done.append(ad.response_id)
                self.audio_ms[ad.response_id] = self.audio_ms.get(ad.response_id, 0) + len(ad.pcm) // 32
                turn = self._turn_of(ad.turn_id)
                if turn is not None and turn.first_audio is None:
                    turn.first_audio = at
                    self.replying[turn.index].set()
            elif kind == "response_done":
                rd = ev.response_done
                self._ended.add(rd.response_id)
                turn = self._turn_of(rd.turn_id)
                if turn is not None:
                    turn.done.append(rd)
                    turn.done_at.append(at)

    def _turn_of(self, turn_id: int) -> Turn | None:
        return next((t for t in self.turns if t.turn_id == turn_id), None)

    async def talk(self, utterance: bytes, turns: int) -> None:
        for i in range(turns):
            turn = Turn(i + 1, time.monotonic())
            self.turns.append(turn)
            for k in range(0, len(utterance), self.step):
                await self._tick(utterance[k : k + self.step])
            turn.speech_end = time.monotonic()
            for _ in range(round(TAIL_S * 1000 / CHUNK_MS)):
                await self._tick(self.silence)
            while turn.final is None and time.monotonic() - turn.speech_end < PATIENCE_S:
                await self._tick(self.silence)
        self._read()


async def _hang_during_turn_2(stack: SecureStack, caller: LiveCaller, worker: int) -> tuple[float, float]:
    """SIGSTOP the session's worker ``HANG_AFTER_S`` into turn 2's reply, SIGCONT it ``HANG_S``
    later; returns when each happened."""
    await caller.replying[2].wait()
    await asyncio.sleep(HANG_AFTER_S)
    proc = stack.workers[worker]
    stack.stop(proc)
    stopped = time.monotonic()
    await asyncio.sleep(HANG_S)
    stack.cont(proc)
    return stopped, time.monotonic()


@pytest.mark.timeout(150)
async def test_a_worker_hung_mid_reply_leaves_the_conversation_at_real_time(tmp_path: Path) -> None:
    voice = np.concatenate([speech(i) for i in (0, 1, 2)])[: int(UTTERANCE_S * 16000)]
    utterance = encode(voice, PCM16K_MONO)
    with secure_stack(tmp_path, workers=2, replicas=1) as stack:
        async with stack.api_channel(0, principal="victim") as ch:
            conv = Conversation(ch).start(open_event())
            sid = (await conv.wait_kind("opened", within=10)).opened.session_id
            caller = LiveCaller(conv)
            fault = asyncio.create_task(_hang_during_turn_2(stack, caller, stack.worker_for(sid)))
            await caller.talk(utterance, TURNS)
            stopped, _ = await fault
            conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
            await conv.wait_done(within=15)
        logs = stack.logs()

    t = caller.turns
    report = "\n".join(
        f"turn {x.index}: turn_id {x.turn_id} committed {x.committed_ms} ms, latency "
        f"{None if x.latency is None else round(x.latency * 1000)} ms, done "
        f"{[(session_pb2.ResponseStatus.Name(d.status), d.reason, d.restarting, d.audio_ms) for d in x.done]}"
        for x in t
    )
    assert conv.of("error") == [], report
    assert caller.audio_after_done == [], report
    assert "Traceback" not in "".join(logs.values())

    # Turn 1: the conversation as it is without a fault.
    baseline = t[0].latency
    assert t[0].final is not None and t[0].final.status == COMPLETED, report
    assert baseline is not None and t[0].committed_ms >= 0.9 * UTTERANCE_S * 1000, report

    # Turn 2: told within the stall timeout of the hang that its reply restarts, then the
    # restarted reply ends with a status (completed, or cut by the caller's own next turn).
    lost = t[1].done[0]
    assert (lost.status, lost.reason, lost.restarting) == (FAILED, "worker_unavailable", True), report
    assert t[1].done_at[0] - stopped <= STALL_S + 1.5, report
    assert t[1].final is not None and len(t[1].done) == 2, report
    assert t[1].final.status == COMPLETED or t[1].final.reason in ("barge_in", "worker_unavailable"), report

    # Every later turn: answered once, completely, nothing of the utterance lost, on time.
    for x in t[2:]:
        assert x.final is not None and x.final.status == COMPLETED and len(x.done) == 1, report
        assert x.committed_ms >= t[0].committed_ms - 3 * CHUNK_MS, report
        assert caller.audio_ms[x.final.response_id] >= x.committed_ms - CHUNK_MS, report
        assert x.latency is not None and x.latency <= baseline + LATENCY_SLACK_S, report
    print(report)
