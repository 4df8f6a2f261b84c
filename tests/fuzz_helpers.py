"""What the hostile-input checks share (``tests/test_session_fuzz.py``, ``tests/live_fuzz.py``): the
codes a refusal may carry, a healthy parrot session that keeps talking beside the attacks, and
the check of its turns by content (as ``tests/test_session_stack.py`` checks replies)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from duplex.audio import PCM16K_MONO
from duplex.errors import ErrorCode, WorkerErrorCode
from duplex.v1 import session_pb2
from tests.session_helpers import Conversation, open_event, similarity, speech, to_16k, utterance_pcm
from tests.test_session_stack import best_expected, worker_input

#: Codes a refusal of client input may carry: every stable code but ``internal`` (a bug).
KNOWN_CODES = frozenset(c.value for c in ErrorCode) - {ErrorCode.INTERNAL.value}
#: Codes of a worker's per-request errors (``WorkerError.code``).
WORKER_CODES = frozenset(c.value for c in WorkerErrorCode)
#: Call statuses that mean a bug on the server's side, never bad input.
BAD_STATUSES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

VOICES = [speech(i) for i in range(16)]


def story(events: list[session_pb2.ServerEvent]) -> str:
    """A stream's events in a line (for failure messages)."""
    out = []
    for e in events:
        kind = e.WhichOneof("event") or ""
        if kind == "input_ack":
            out.append(f"ack{e.input_ack.seq}@{e.input_ack.epoch}")
        elif kind == "audio_cancelled":
            ac = e.audio_cancelled
            out.append(f"cancelled{ac.cancelled_epoch}->{ac.epoch}:{ac.reason}")
        elif kind == "audio_delta":
            out.append(f"audio@{e.audio_delta.epoch}")
        elif kind == "error":
            out.append(f"error:{e.error.code}:{e.error.event_id[:12]}")
        else:
            out.append(kind)
    return " ".join(out)


@dataclass
class Turn:
    """One turn of the healthy session, kept to be checked at the end (scoring costs CPU that
    the servers should not wait on)."""

    status: int
    got: bytes
    sent: bytes
    committed_ms: int
    phase: int
    errors: list[str]
    seconds: float


@dataclass
class HealthyTalker:
    """A well-behaved client beside the attacks: one session, parrot turns one after another
    (speech, then enough silence, sent faster than real time, to end the turn and step the
    whole reply out), until stopped. Run ``run()`` as a task; ``failure`` says why it stopped
    early."""

    target: str
    speedup: float = 4.0
    """How much faster than real time it sends. Within what a frame-clocked worker consumes
    while it has time to catch up (up to 9x, less on a loaded machine): a reply is stepped by the
    silence queued after its RESPOND, and a client far ahead of real time gets no silence fed."""
    turns: list[Turn] = field(default_factory=list)
    failure: BaseException | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        try:
            async with grpc.aio.insecure_channel(self.target) as ch:
                conv = Conversation(ch).start(open_event())
                await conv.wait_kind("opened", within=30)
                i = 0
                while not self._stop.is_set():
                    await self._turn(conv, VOICES[i % len(VOICES)])
                    i += 1
                conv.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
                await conv.wait_done(30)
                if conv.error is not None:
                    raise conv.error
        except BaseException as exc:  # reported by the caller
            self.failure = exc

    async def _turn(self, conv: Conversation, voice: np.ndarray) -> None:
        t0 = time.monotonic()
        start = len(conv.events)
        phase = -(conv.sent_bytes // 2) % 512  # where the utterance sits in the worker's frame grid
        pcm = utterance_pcm(voice, PCM16K_MONO, tail_s=0.8)  # silence for turn detection
        await conv.stream(pcm, PCM16K_MONO, speedup=self.speedup)
        # The parrot answers one frame per input frame: silence steps the reply out until it is
        # done. (Sent ahead of real time, the server would feed none: this client's audio covers
        # more than the time that has passed. Silence sent before the response began, while its
        # RESPOND was on the way, steps no reply.)
        silence = b"\x00\x00" * 1600  # 100 ms
        for _ in range(int(len(voice) / 1600) + 100):
            if any(e.HasField("response_done") for e in conv.events[start:]):
                break
            conv.append(silence)
            pcm += silence
            await asyncio.sleep(0.1 / self.speedup)
        try:
            done = (await conv.wait_kind("response_done", start=start, within=60)).response_done
        except TimeoutError:
            tail = story(conv.events[start:])[-1500:]
            raise AssertionError(f"no response_done within 60 s of a turn's end; the turn: {tail}") from None
        got = b"".join(
            e.audio_delta.pcm
            for e in conv.events[start:]
            if e.HasField("audio_delta") and e.audio_delta.response_id == done.response_id
        )
        committed = [e.committed.audio_ms for e in conv.events[start:] if e.HasField("committed")]
        errors = [e.error.code for e in conv.events[start:] if e.HasField("error")]
        turn = Turn(
            done.status, got, pcm, committed[-1] if committed else 0, phase, errors, time.monotonic() - t0
        )
        self.turns.append(turn)


def turn_problems(turns: list[Turn], *, min_turns: int, max_scored: int = 8) -> tuple[list[str], float]:
    """What is wrong with the healthy session's turns (nothing: ``[]``), and the lowest content
    score. Every turn must complete without an error, its reply as long as the committed
    utterance; the content of at most ``max_scored`` turns spread over the run is compared with
    the parrot's reply to what the worker heard (similarity > 0.8)."""
    problems = []
    if len(turns) < min_turns:
        problems.append(f"the healthy session completed {len(turns)} turns, want at least {min_turns}")
    scored = set(range(0, len(turns), max(1, len(turns) // max_scored))) | {len(turns) - 1}
    worst = 1.0
    for i, t in enumerate(turns):
        if t.status != session_pb2.RESPONSE_STATUS_COMPLETED or t.errors:
            problems.append(f"healthy turn {i}: status {t.status}, errors {t.errors}")
            continue
        got = to_16k(t.got, PCM16K_MONO)
        n = round(t.committed_ms * 16 / 512) * 512  # the committed utterance, whole frames
        if not (n > 0 and 0.8 * n < len(got) < 1.2 * n + 16000):
            problems.append(f"healthy turn {i}: reply of {len(got)} samples for {n} committed")
            continue
        if i not in scored:
            continue
        heard = worker_input(t.sent, PCM16K_MONO)
        score = similarity(got, best_expected(n, got, heard, PCM16K_MONO, phase=t.phase))
        worst = min(worst, score)
        if score <= 0.8:
            problems.append(f"healthy turn {i}: reply is not the parrot's (similarity {score:.2f})")
    return problems, worst
