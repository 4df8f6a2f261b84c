"""A fault-and-load run of the real stack on loopback: N sessions talking for T seconds while
processes die and hang under them.

    python -m tests.fault_load --sessions 16 --seconds 30 [--json] [--no-faults]

What it starts (every process by its own pid, all stopped in every case): three parrot workers
(``duplex worker``, ``--orphan-grace-s 2``) and two session-service replicas (``duplex
session``, both listing all three workers, ``--worker-stall-timeout-s 1``, one shared
``DUPLEX_RESUME_SECRETS`` so each accepts the other's resume tokens).

What the callers do: session ``i`` opens on replica ``i % 2`` with server turn detection
(auto respond, barge-in off: nothing in this run cancels a response, so epochs move only by
failover and resume) and, until T has elapsed, speaks fixture ``speech_{i % 16}`` (distinct
espeak phrases) followed by 1 s of silence in real time (20 ms s16le appends), keeps streaming
real-time silence while it waits for the reply (at most ``REPLY_TIMEOUT_S`` after the turn was
spoken), pauses 300 ms (silence) and speaks again. After T nobody starts a turn; outstanding
turns get at most ``GRACE_S`` more; then every session is closed cleanly.

The client is written on the raw ``Converse`` stub, as a backend in any language would be (see
docs/grpc-guide.md), so that it knows exactly which appends were acknowledged: an ``input_ack``
acknowledges every append of the current numbering run up to its ``seq``. When a call breaks
without a ``closed`` event (the replica died), the caller resumes the session on the other
replica with its latest resume token (from ``opened``, ``go_away``, and the ``resume_token`` of
``response_started`` / ``response_done`` where the proto has one), numbers appends from 1 again
when the epoch changed, re-sends the appends that were never acknowledged, then whatever it
recorded meanwhile (a caller keeps talking through the outage), and carries on. Acknowledged
appends are never re-sent.

Faults (``--no-faults`` runs without them): at 0.25 T SIGKILL of the worker holding the most
sessions; at 0.45 T SIGSTOP of the busiest remaining worker, SIGCONT 5 s later; at 0.7 T SIGKILL
of replica 0 (its callers resume on replica 1).

What counts (the summary; ``--json`` prints the same as one JSON object):

- turns spoken: utterances whose audio (and trailing silence) was all written to a call;
- turns answered: turns with a ``response_done`` COMPLETED whose response's audio (its
  ``audio_delta`` PCM, concatenated) matches the utterance and is complete (at least
  ``COMPLETE`` of the utterance's speech span long);
- wrong-session replies (must be 0): replies (any status, at least 0.3 s of audio) that match
  another session's utterance clearly better than their own;
- lost acknowledged turns (must be 0): spoken turns whose appends were all acknowledged and that
  were not answered by the end;
- sessions resumed; worker state left after all close (must be 0): the surviving workers'
  ``duplex_worker_active_requests`` (sessions holding model state), polled until 0 or 10 s;
- fail-closed steps under valid traffic (must be 0): ``duplex_sparse_fail_closed_total`` summed
  over every process (a killed one as scraped just before its fault, the others at the end);
- turns lagging after a fault (must be 0): each answered turn's end of speech -> first reply
  audio is reported, before the first fault (the baseline) and after each fault by how many
  turns after it a session's turn is (``turn_latencies``); from the second turn a session
  starts after a fault on (one with no fault between its start and its reply), a turn more than
  ``LAG_S`` over the baseline's 90th percentile lags: the conversation did not get back to real
  time;
- also: turns failed (a ``response_done`` FAILED), turns still waiting at the very end, error
  codes, broken-call statuses, resumes, appends re-sent, and when each fault happened.

Matching a reply to an utterance: the parrot answers utterance ``x`` with ``parrot_reply(x', 4)``
where ``x'`` is the span its VAD committed, cut on the worker's 512-sample frame grid (the span
and so the reply are of the exact same length). Its phase vocoder makes the *waveform* depend on
the sample phase of that cut: shifting the span by 4 samples drops
``tests.session_helpers.similarity`` against the reply of the unshifted span from 1.0 to about 0.6,
and against ``parrot_reply(fixture, 4)`` the real replies score 0.3-0.9. The phase depends on all
that came before (20 ms appends against 32 ms frames, silence the server fed, a resume starting a
new frame grid), and the exact span on the VAD's state. So replies are compared by the same measure
-- the peak normalized cross-correlation over all lags, normalized by the full norms -- taken over
log-magnitude spectrograms (``features``; lags in frames): that does not care about the cut's phase.
The reference of a phrase is ``parrot_reply`` of its speech span plus 64 ms (``Matcher``). Measured
on 68 real replies of the 16 phrases: 0.76-0.91 against the own phrase, at most 0.44 against any
other; offline, replies of spans with 32 ms doubled or dropped score 0.73 or more. A reply matches
its phrase when it scores at least ``MATCH`` (0.6) and ``MARGIN`` (0.2) more than against any other
phrase; it is complete when it is at least ``COMPLETE`` (0.85) of the phrase's speech span long
(real replies: 0.93-1.27; a reply of 70% of the span: at most 0.80).

More than 16 sessions: session ``i`` and ``i + 16`` speak the same phrase and cannot be told apart
by content; wrong-session replies are counted among sessions with different phrases only (a
misrouted reply lands on a session with another phrase 15 times out of 16 at N = 64).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np

from duplex import spawn
from duplex.audio import PCM16K_MONO, decode, encode, write_wav
from duplex.client import turn_detection
from duplex.serving import CHANNEL_OPTIONS
from duplex.v1 import session_pb2, session_pb2_grpc
from tests.procs import REPO, pid_alive
from tests.session_helpers import PARROT, session_args, speech, worker_args
from worker_service.models.parrot import parrot_reply

#: Distinct phrases (tests/fixtures/speech_00.wav .. speech_15.wav).
PHRASES = 16
PITCH = 4.0  # the parrot's default
CHUNK_S = 0.020
TRAIL_S = 1.0
PAUSE_S = 0.3
REPLY_TIMEOUT_S = 8.0
#: Events (but audio and acks) each caller keeps for the report of a lost turn.
TIMELINE_EVENTS = 200
GRACE_S = 15.0
RESUME_WINDOW_S = 20.0
STOP_S = 5.0
"""SIGSTOP lasts this long."""
LAG_S = 1.0
"""A turn after a fault whose first reply audio comes this much later than the baseline's 90th
percentile lags (``turn_latencies``)."""
#: Matching (see the module docstring).
MATCH = 0.6
MARGIN = 0.2
COMPLETE = 0.85
MIN_JUDGED_S = 0.3
FAIL_CLOSED = "duplex_sparse_fail_closed_total"
WORKER_STATE = "duplex_worker_active_requests"

COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
FAILED = session_pb2.RESPONSE_STATUS_FAILED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
_STATUS: dict[int, str] = {COMPLETED: "completed", FAILED: "failed", CANCELLED: "cancelled"}


def _has_token(message: Any) -> bool:
    return "resume_token" in message.DESCRIPTOR.fields_by_name


#: Whether this proto carries fresh resume tokens on responses (newer servers do).
TOKEN_ON_STARTED = _has_token(session_pb2.ResponseStarted)
TOKEN_ON_DONE = _has_token(session_pb2.ResponseDone)


def _token_of(message: Any) -> str:
    return str(getattr(message, "resume_token", ""))


# ---- processes ----------------------------------------------------------------------------------


@dataclass
class Proc:
    """One ``python -m duplex`` child: its role, pid, addresses and log file."""

    name: str
    popen: subprocess.Popen[str]
    log: Path
    grpc: str = ""
    metrics: str = ""
    last_metrics: str = ""
    """/metrics as last scraped (a killed process: just before its fault)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None and pid_alive(self.pid)

    def scrape(self) -> str:
        if self.metrics and self.alive:
            try:
                with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as resp:
                    self.last_metrics = resp.read().decode()
            except OSError:
                pass
        return self.last_metrics


def _spawn(name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> Proc:
    log = log_dir / f"{name}.log"
    with open(log, "w") as err:
        # No preexec_fn: Python between fork and exec in this threaded, gRPC-using parent can
        # crash the child (duplex.spawn).
        popen = spawn.popen(
            [sys.executable, "-m", "duplex", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            parent_death_signal=signal.SIGKILL,
        )
    return Proc(name, popen, log)


def _await_listening(procs: Sequence[Proc], timeout: float) -> None:
    """Read each child's stdout until its JSON "listening" line (all at once)."""
    waiting = {p.popen.stdout: p for p in procs if p.popen.stdout is not None}
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(p.name for p in waiting.values())
            raise TimeoutError(f"{names} did not announce themselves within {timeout:g}s")
        ready, _, _ = select.select(list(waiting), [], [], min(left, 0.5))
        for stream in ready:
            p = waiting[stream]
            line = stream.readline() if stream is not None else ""
            if not line:
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {p.log}")
                continue
            with contextlib.suppress(json.JSONDecodeError):
                msg = json.loads(line)
                if isinstance(msg, dict) and msg.get("event") == "listening":
                    p.grpc, p.metrics = msg["grpc"], msg["metrics"]
                    del waiting[stream]
        for stream, p in list(waiting.items()):
            if p.popen.poll() is not None and stream not in ready:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {p.log}")


def stop_all(procs: Sequence[Proc], timeout: float = 5.0) -> None:
    """SIGCONT (a stopped one cannot act on SIGTERM) and SIGTERM to every child still running,
    by its pid; SIGKILL to those still there after ``timeout``; reap all."""
    running = [p for p in procs if p.popen.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(10)
    for p in procs:
        if p.popen.stdout is not None:
            p.popen.stdout.close()


def metric_total(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples called ``name`` (whose label text contains ``labels``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and labels in line.split(" ")[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


def worker_sessions(text: str) -> dict[str, float]:
    """``duplex_session_worker_sessions`` of a replica, by worker address."""
    out: dict[str, float] = {}
    for m in re.finditer(r'^duplex_session_worker_sessions\{worker="([^"]+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


# ---- matching replies -------------------------------------------------------------------------

_WIN, _HOP, _FMAX = 1024, 256, 4000.0


def features(x: np.ndarray) -> np.ndarray:
    """Log-magnitude spectrogram (1024-sample Hann windows every 256 samples, 16 Hz - 4 kHz),
    frames by bins, its mean removed."""
    x = np.asarray(x, np.float64).reshape(-1)
    if len(x) < _WIN:
        x = np.pad(x, (0, _WIN - len(x)))
    k = 1 + (len(x) - _WIN) // _HOP
    idx = np.arange(_WIN)[None, :] + _HOP * np.arange(k)[:, None]
    bins = int(_FMAX * _WIN / 16000)
    mag = np.abs(np.fft.rfft(x[idx] * np.hanning(_WIN), axis=1))[:, 1 : bins + 1]
    f: np.ndarray = np.log1p(mag * 100.0)
    f -= f.mean()
    return f


def spectral_similarity(a: np.ndarray, refs: Sequence[np.ndarray]) -> np.ndarray:
    """Peak normalized cross-correlation over frame lags of ``features`` ``a`` with each of
    ``refs`` (1.0: the same spectrogram up to a shift), normalized by the full norms so that a
    reply missing part of its utterance scores lower."""
    return _Bank(refs).scores(a)


class _Bank:
    """Reference spectrograms, their FFTs along time kept for each FFT size used."""

    def __init__(self, refs: Sequence[np.ndarray]) -> None:
        self.refs = list(refs)
        self.norms = np.array([np.linalg.norm(r) for r in self.refs])
        self._ffts: dict[int, np.ndarray] = {}

    def _fft(self, n: int) -> np.ndarray:
        if n not in self._ffts:
            bins = self.refs[0].shape[1]
            stacked = np.zeros((len(self.refs), n, bins))
            for i, r in enumerate(self.refs):
                stacked[i, : min(n, len(r))] = r[:n]
            self._ffts[n] = np.conj(np.fft.rfft(stacked, axis=1))
        return self._ffts[n]

    def scores(self, a: np.ndarray) -> np.ndarray:
        na = np.linalg.norm(a)
        longest = max(len(r) for r in self.refs)
        n = 1 << (len(a) + longest - 1).bit_length()
        fa = np.fft.rfft(a, n, axis=0)
        corr = np.fft.irfft(np.einsum("fb,rfb->rf", fa, self._fft(n)), n, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out: np.ndarray = np.nan_to_num(corr.max(axis=1) / (na * self.norms))
        return out


def speech_span(x: np.ndarray) -> tuple[int, int]:
    """Start and end (samples) of the 32 ms frames from the first to the last one louder than 5%
    of the loudest one's RMS: about what the parrot's VAD commits of the fixture."""
    frames = len(x) // 512
    rms = np.sqrt(np.mean(np.square(x[: frames * 512].reshape(frames, 512)), axis=1))
    loud = np.flatnonzero(rms > 0.05 * rms.max())
    return (int(loud[0]) * 512, int(loud[-1] + 1) * 512) if len(loud) else (0, len(x))


class Matcher:
    """The expected reply of every phrase, as features: ``parrot_reply`` of its speech span and
    the next 64 ms (what the VAD commits varies with where the worker's frames fall; measured on
    real replies, this reference scores 0.76 or more for the own phrase and 0.44 or less for any
    other). Scores a reply against all of them."""

    def __init__(self) -> None:
        self.voices = [speech(i) for i in range(PHRASES)]
        spans = [speech_span(v) for v in self.voices]
        self.replies = [
            parrot_reply(np.pad(v, (0, 1024))[a : b + 1024], PITCH)
            for v, (a, b) in zip(self.voices, spans, strict=True)
        ]
        self.spans = [b - a for a, b in spans]
        self._bank = _Bank([features(r) for r in self.replies])

    def scores(self, reply: np.ndarray, *, prefix: bool) -> np.ndarray:
        """Against each phrase's expected reply (``prefix``: against as much of its start as
        ``reply`` is long, for a reply cut short)."""
        if not prefix:
            return self._bank.scores(features(reply))
        n = len(reply) + 1024
        return spectral_similarity(features(reply), [features(r[:n]) for r in self.replies])


# ---- the callers --------------------------------------------------------------------------------


@dataclass
class Chunk:
    """One 20 ms append: its PCM, the turn it belongs to (None: silence between turns), and the
    seq it was last written under (None: not written on the current call)."""

    pcm: bytes
    turn: int | None
    seq: int | None = None
    written: int = 0


@dataclass
class Response:
    response_id: str
    turn_id: int
    epoch: int
    turn: int | None
    started: float
    pcm: bytearray = field(default_factory=bytearray)
    status: int = 0
    reason: str = ""
    done: float | None = None
    first_audio: float | None = None


@dataclass
class Turn:
    index: int
    started: float
    chunks: int = 0
    written: int = 0
    acked: int = 0
    spoken: float | None = None
    turn_ids: list[int] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    replied: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight_at_end: bool = False


def _describe(ev: session_pb2.ServerEvent) -> str:
    """An event in one line: its kind and its fields (bytes and tokens left out)."""
    kind = ev.WhichOneof("event") or "?"
    body = getattr(ev, kind)
    fields = []
    for field_desc, value in body.ListFields():
        if field_desc.name in ("pcm", "resume_token", "capabilities", "config"):
            continue
        fields.append(f"{field_desc.name}={value}".replace("\n", " ").strip())
    return f"{kind}({', '.join(fields)})"


@dataclass
class Target:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: Any  # DuplexSessionAsyncStub (only in the generated .pyi)


class Caller:
    """One session: speaks its phrase turn after turn, resumes on the other replica when its
    call breaks, and records every event it gets."""

    def __init__(
        self, index: int, voice: np.ndarray, targets: list[Target], clock: Callable[[], float]
    ) -> None:
        self.index = index
        self.phrase = index % PHRASES
        self.targets = targets
        self.home = index % len(targets)
        self.at = self.home
        self.now = clock
        step = int(CHUNK_S * 16000)
        utterance = encode(np.concatenate([voice, np.zeros(int(TRAIL_S * 16000), np.float32)]), PCM16K_MONO)
        self.utterance = [utterance[i : i + 2 * step] for i in range(0, len(utterance), 2 * step)]
        self.silence = bytes(2 * step)
        self.session_id = ""
        self.token = ""
        self.epoch = 0
        self.seq = 0
        self.call: Any = None
        self.unsent: deque[Chunk] = deque()
        self.inflight: deque[Chunk] = deque()
        self.connected = asyncio.Event()
        self.lock = asyncio.Lock()
        self.turns: list[Turn] = []
        self.current: int | None = None
        self.responses: dict[str, Response] = {}
        self.turn_of_id: dict[int, int] = {}
        self.closing = False
        self.closed_reason: str | None = None
        self.go_away = False
        self.ended = asyncio.Event()
        self.failure = ""
        self.resumes: list[dict[str, Any]] = []
        self.resent = 0
        self.late_s = 0.0
        """Audio time this caller could not send in real time (it fell behind by more than 0.2 s)."""
        self.errors: Counter[str] = Counter()
        self.broken_calls: Counter[str] = Counter()
        self.anomalies: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_id = 0
        self.timeline: deque[tuple[float, str]] = deque(maxlen=TIMELINE_EVENTS)
        """The latest events of this session but audio and acks, with when they came: what a
        lost turn's entry in the report shows."""

    def _event_id(self) -> str:
        self._next_id += 1
        return f"s{self.index}-{self._next_id}"

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the call --------------------------------------------------------------------------

    async def _start(self, target: Target, first: session_pb2.ClientEvent) -> tuple[Any, Any]:
        call = target.stub.Converse()
        try:
            async with asyncio.timeout(10):
                await call.write(first)
                ev = await call.read()
        except BaseException:
            call.cancel()
            raise
        if ev is grpc.aio.EOF:
            code = await call.code()
            raise ConnectionError(f"call ended before opened: {code.name}")
        if ev.WhichOneof("event") != "opened":
            call.cancel()
            raise ConnectionError(f"expected opened, got {ev.WhichOneof('event')}")
        return call, ev

    async def open(self) -> None:
        target = self.targets[self.home]
        config = session_pb2.SessionConfig(
            input_format=PCM16K_MONO.to_proto(),
            turn_detection=turn_detection(auto_respond=True, barge_in=False),
        )
        first = session_pb2.ClientEvent(
            event_id=self._event_id(),
            # Acked once consumed (carried on output), as DuplexClient does: acknowledged input has
            # reached the model, so a replica's crash cannot lose it, and a resume re-sends the rest.
            open=session_pb2.SessionOpen(model="parrot", config=config, acks_on_output=True),
        )
        call, ev = await self._start(target, first)
        self.session_id = ev.opened.session_id
        self.epoch = ev.opened.epoch
        self.token = ev.opened.resume_token
        self._attach(call)

    def _attach(self, call: Any) -> None:
        self.call = call
        self.connected.set()
        self._spawn(self._read(call))

    async def _read(self, call: Any) -> None:
        status = "EOF"
        try:
            while True:
                ev = await call.read()
                if ev is grpc.aio.EOF:
                    status = (await call.code()).name
                    break
                self._on_event(ev)
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
        except asyncio.CancelledError:
            return
        if call is not self.call:
            return
        self.connected.clear()
        if self.closing or (self.closed_reason is not None and self.closed_reason != "draining"):
            self.ended.set()
            return
        self.broken_calls[status] += 1
        await self._resume()

    async def _resume(self) -> None:
        """Resume on the other replica (then alternately), re-send what was never acknowledged."""
        began = self.now()
        lost_at = self.at
        attempt = 0
        delay = 0.1
        while self.now() - began < RESUME_WINDOW_S and not self.closing:
            at = (lost_at + 1 + attempt) % len(self.targets)
            attempt += 1
            first = session_pb2.ClientEvent(
                event_id=self._event_id(),
                resume=session_pb2.SessionResume(
                    session_id=self.session_id, resume_token=self.token, acks_on_output=True
                ),
            )
            try:
                call, ev = await self._start(self.targets[at], first)
            except (grpc.aio.AioRpcError, ConnectionError, TimeoutError) as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                self.errors[f"resume:{code}"] += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            opened = ev.opened
            async with self.lock:
                if opened.epoch != self.epoch:
                    self.seq = 0
                self.epoch = opened.epoch
                self.token = opened.resume_token or self.token
                self.at = at
                self.closed_reason = None
                self.go_away = False
                # Unacknowledged appends go again, before anything recorded meanwhile.
                for ch in self.inflight:
                    ch.seq = None
                self.resent += len(self.inflight)
                self.unsent.extendleft(reversed(self.inflight))
                self.inflight.clear()
                self.resumes.append(
                    {
                        "t": round(began, 3),
                        "took_s": round(self.now() - began, 3),
                        "to": self.targets[at].name,
                    }
                )
                self._attach(call)
            await self._flush()
            return
        if not self.closing:
            self.failure = f"no resume within {RESUME_WINDOW_S:g}s"
        self.ended.set()

    # ---- sending ---------------------------------------------------------------------------

    async def _emit(self, pcm: bytes, turn: int | None) -> None:
        self.unsent.append(Chunk(pcm, turn))
        if turn is not None:
            self.turns[turn].chunks += 1
        await self._flush()

    async def _flush(self) -> None:
        """Write what is unsent, in order, while the call is up."""
        async with self.lock:
            while self.unsent and self.connected.is_set():
                ch = self.unsent.popleft()
                self.seq += 1
                ch.seq = self.seq
                self.inflight.append(ch)  # before the write: its ack may come first
                ev = session_pb2.ClientEvent(
                    event_id=self._event_id(),
                    append=session_pb2.InputAudioAppend(seq=ch.seq, pcm=ch.pcm),
                )
                try:
                    await self.call.write(ev)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    self.inflight.pop()
                    ch.seq = None
                    self.seq -= 1
                    self.unsent.appendleft(ch)
                    self.connected.clear()  # the reader sees the call end and resumes
                    return
                ch.written += 1
                if ch.turn is not None and ch.written == 1:
                    self.turns[ch.turn].written += 1

    def _acked(self, seq: int) -> None:
        while self.inflight and self.inflight[0].seq is not None and self.inflight[0].seq <= seq:
            ch = self.inflight.popleft()
            if ch.turn is not None:
                self.turns[ch.turn].acked += 1

    # ---- receiving -------------------------------------------------------------------------

    def _on_event(self, ev: session_pb2.ServerEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind not in ("audio_delta", "input_ack"):
            self.timeline.append((self.now(), _describe(ev)))
        ack = ev.input_ack if kind == "input_ack" else ev.carried_ack if ev.HasField("carried_ack") else None
        if ack is not None:
            if ack.epoch != self.epoch:
                self.anomalies["input_ack of an epoch the client was not told of"] += 1
            self._acked(ack.seq)
        if kind == "committed":
            if self.current is not None:
                self.turn_of_id[ev.committed.turn_id] = self.current
                self.turns[self.current].turn_ids.append(ev.committed.turn_id)
        elif kind == "response_started":
            rs = ev.response_started
            turn = self.turn_of_id.get(rs.turn_id)
            if turn is None or self.current is None or turn < self.current - 1:
                turn = self.current
            if TOKEN_ON_STARTED and _token_of(rs):
                self.token = _token_of(rs)
            if rs.response_id in self.responses:
                self.anomalies["response_started twice"] += 1
            self.responses[rs.response_id] = Response(rs.response_id, rs.turn_id, rs.epoch, turn, self.now())
            if turn is not None:
                self.turns[turn].responses.append(rs.response_id)
        elif kind == "audio_delta":
            ad = ev.audio_delta
            r = self.responses.get(ad.response_id)
            if r is None:
                self.anomalies["audio of a response never started"] += 1
            elif r.done is not None:
                self.anomalies["audio after response_done"] += 1
            else:
                if ad.turn_id != r.turn_id or ad.epoch != r.epoch:
                    self.anomalies["audio with another turn or epoch than its response"] += 1
                if r.first_audio is None:
                    r.first_audio = self.now()
                r.pcm += ad.pcm
        elif kind == "response_done":
            rd = ev.response_done
            if TOKEN_ON_DONE and _token_of(rd):
                self.token = _token_of(rd)
            r = self.responses.get(rd.response_id)
            if r is None:
                self.anomalies["response_done of a response never started"] += 1
                return
            r.status, r.reason, r.done = rd.status, rd.reason, self.now()
            if rd.status == COMPLETED and r.turn is not None:
                self.turns[r.turn].replied.set()
        elif kind == "error":
            self.errors[ev.error.code] += 1
        elif kind == "closed":
            self.closed_reason = ev.closed.reason
        elif kind == "go_away":
            self.go_away = True
            self.token = ev.go_away.resume_token or self.token
        elif kind == "opened":
            self.epoch = ev.opened.epoch
            self.token = ev.opened.resume_token or self.token
        elif kind == "audio_cancelled":
            self.anomalies["audio_cancelled (nothing here cancels)"] += 1

    # ---- the conversation ------------------------------------------------------------------

    async def converse(self, speak_until: float, hard_end: float) -> None:
        """Turns until ``speak_until``; a turn's reply is awaited until ``hard_end`` at most."""
        loop = asyncio.get_running_loop()
        due = loop.time()

        async def tick(pcm: bytes, turn: int | None) -> None:
            nonlocal due
            due += CHUNK_S
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.2:  # fell behind (CPU): real time goes on, no burst
                self.late_s += -delay
                due = loop.time()
            await self._emit(pcm, turn)

        while self.now() < speak_until and not self.ended.is_set():
            turn = Turn(len(self.turns), self.now())
            self.turns.append(turn)
            self.current = turn.index
            for pcm in self.utterance:
                await tick(pcm, turn.index)
            turn.spoken = self.now()
            wait_until = min(turn.spoken + REPLY_TIMEOUT_S, hard_end)
            while not turn.replied.is_set() and self.now() < wait_until and not self.ended.is_set():
                await tick(self.silence, None)
            if not turn.replied.is_set():
                turn.in_flight_at_end = self.now() >= hard_end
            pause_until = self.now() + PAUSE_S
            while self.now() < pause_until and not self.ended.is_set():
                await tick(self.silence, None)

    async def close(self, within: float = 5.0) -> None:
        self.closing = True
        try:
            async with asyncio.timeout(within):
                if not self.ended.is_set():
                    await self.connected.wait()
                    async with self.lock:
                        await self.call.write(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
                        await self.call.done_writing()
                await self.ended.wait()
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            self.errors[f"close:{type(exc).__name__}"] += 1
        if self.closed_reason != "client_close":
            self.anomalies[f"ended without closed(client_close): {self.closed_reason}"] += 1
        if self.call is not None:
            self.call.cancel()
        for task in list(self._tasks):
            task.cancel()


# ---- faults ------------------------------------------------------------------------------------


@dataclass
class Stack:
    workers: list[Proc]
    replicas: list[Proc]

    def all(self) -> list[Proc]:
        return [*self.replicas, *self.workers]


def _placement(stack: Stack) -> dict[str, dict[str, int]]:
    """Sessions each live replica has placed on each worker (by worker name), now."""
    names = {w.grpc: w.name for w in stack.workers}
    out: dict[str, dict[str, int]] = {}
    for r in stack.replicas:
        if r.alive:
            placed = worker_sessions(r.scrape())
            out[r.name] = {names.get(a, a): int(n) for a, n in sorted(placed.items()) if n}
    return out


def _busiest(placement: dict[str, dict[str, int]], candidates: list[Proc]) -> Proc:
    """The candidate worker on which the replicas place the most sessions."""
    load: Counter[str] = Counter()
    for placed in placement.values():
        load.update(placed)
    return max(candidates, key=lambda w: (load[w.name], -candidates.index(w)))


async def run_faults(stack: Stack, t0: float, seconds: float, log: list[dict[str, Any]]) -> None:
    """The three faults of the module docstring, at their fractions of ``seconds`` after ``t0``;
    each is logged with when it happened and where the replicas had placed their sessions."""

    def now() -> float:
        return time.monotonic() - t0

    async def at(fraction: float) -> None:
        await asyncio.sleep(max(0.0, fraction * seconds - now()))

    def record(
        what: str, proc: Proc, placement: dict[str, dict[str, int]] | None = None, **extra: Any
    ) -> None:
        entry = {"t": round(now(), 3), "fault": what, "process": proc.name, "pid": proc.pid, **extra}
        if placement is not None:
            entry["placement"] = placement
        log.append(entry)

    await at(0.25)
    placement = await asyncio.to_thread(_placement, stack)
    victim = _busiest(placement, list(stack.workers))
    await asyncio.to_thread(victim.scrape)
    os.kill(victim.pid, signal.SIGKILL)
    await asyncio.to_thread(victim.popen.wait, 10)
    record("SIGKILL worker", victim, placement, gone=not pid_alive(victim.pid))

    await at(0.45)
    placement = await asyncio.to_thread(_placement, stack)
    hung = _busiest(placement, [w for w in stack.workers if w is not victim])
    await asyncio.to_thread(hung.scrape)
    os.kill(hung.pid, signal.SIGSTOP)
    record("SIGSTOP worker", hung, placement)
    await asyncio.sleep(STOP_S)
    os.kill(hung.pid, signal.SIGCONT)
    record("SIGCONT worker", hung)

    await at(0.7)
    placement = await asyncio.to_thread(_placement, stack)
    replica = stack.replicas[0]
    await asyncio.to_thread(replica.scrape)
    os.kill(replica.pid, signal.SIGKILL)
    await asyncio.to_thread(replica.popen.wait, 10)
    record("SIGKILL session replica", replica, placement, gone=not pid_alive(replica.pid))


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class Options:
    sessions: int = 16
    seconds: float = 30.0
    faults: bool = True
    device: str = "cpu"
    log_dir: Path | None = None
    startup_timeout_s: float = 90.0
    keep_audio: bool = False
    """Write every reply's audio to the log directory (otherwise only those that did not count)."""


def start_stack(opts: Options, log_dir: Path) -> tuple[Stack, list[Proc]]:
    """Three workers, then two replicas in front of them; returns the stack and every process
    started (to stop, even when starting failed)."""
    started: list[Proc] = []
    try:
        for i in range(3):
            started.append(
                _spawn(f"worker{i}", worker_args("--orphan-grace-s", "2", device=opts.device), log_dir, {})
            )
        workers = list(started)
        _await_listening(workers, opts.startup_timeout_s)
        env = {"DUPLEX_RESUME_SECRETS": f"soak:{secrets.token_hex(32)}"}
        addresses = [w.grpc for w in workers]
        extra = ("--worker-stall-timeout-s", "1.0", "--drain-grace-s", "2")
        for i in range(2):
            started.append(
                _spawn(f"session{i}", session_args(addresses, *extra, plugin=PARROT), log_dir, env)
            )
        replicas = started[3:]
        _await_listening(replicas, opts.startup_timeout_s)
        deadline = time.monotonic() + 30
        for r in replicas:
            while metric_total(r.scrape(), "duplex_session_workers_healthy") < 3:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{r.name} did not find all 3 workers healthy; see {r.log}")
                time.sleep(0.1)
        return Stack(workers, replicas), started
    except BaseException:
        stop_all(started)
        raise


async def _drive(opts: Options, stack: Stack, voices: list[np.ndarray]) -> dict[str, Any]:
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    targets = []
    for r in stack.replicas:
        channel = grpc.aio.insecure_channel(r.grpc, options=CHANNEL_OPTIONS)
        targets.append(Target(r.name, r.grpc, channel, session_pb2_grpc.DuplexSessionStub(channel)))
    callers = [Caller(i, voices[i % PHRASES], targets, now) for i in range(opts.sessions)]
    fault_log: list[dict[str, Any]] = []
    faults: asyncio.Task[None] | None = None
    try:
        await asyncio.gather(*(c.open() for c in callers))
        t_open = now()
        speak_until = t_open + opts.seconds
        hard_end = speak_until + GRACE_S
        if opts.faults:
            faults = asyncio.create_task(run_faults(stack, t0 + t_open, opts.seconds, fault_log))

        async def one(c: Caller) -> None:
            await asyncio.sleep(c.index * min(1.0, 2.0 / opts.sessions))  # spread the turns out
            await c.converse(speak_until, hard_end)

        await asyncio.gather(*(one(c) for c in callers))
        if faults is not None:
            await faults
        t_spoken = now()
        await asyncio.gather(*(c.close() for c in callers))
        t_closed = now()
    finally:
        if faults is not None and not faults.done():
            faults.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await faults
        for c in callers:
            if c.call is not None:
                c.call.cancel()
        for t in targets:
            await t.channel.close()
    return {
        "callers": callers,
        "faults": fault_log,
        "timing": {"opened_s": t_open, "spoken_s": t_spoken, "closed_s": t_closed},
    }


def _worker_state(stack: Stack, within: float) -> dict[str, float]:
    """Sessions with model state on each surviving worker, polled until all are 0 or ``within``."""
    deadline = time.monotonic() + within
    while True:
        state = {w.name: metric_total(w.scrape(), WORKER_STATE) for w in stack.workers if w.alive}
        if sum(state.values()) == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


@dataclass
class Verdict:
    """What a reply is, judged by its content (see the module docstring)."""

    own: float | None = None
    """Its score against the phrase its session spoke (None: too short to judge)."""
    other: float = 0.0
    """Its best score against any other phrase ..."""
    other_phrase: int = -1
    """... and which phrase that is."""
    length: float = 0.0
    """Its length in the phrase's speech spans."""
    matches: bool = False
    """It is the reply to its own phrase."""
    answers: bool = False
    """It matches, completed, and is complete: the turn is answered."""
    wrong: bool = False
    """It is the reply to another phrase: another session's."""


def judge(matcher: Matcher, audio: np.ndarray, phrase: int, *, completed: bool) -> Verdict:
    """Judge reply ``audio`` (16 kHz mono) of a session that spoke ``phrase``; a reply that did
    not complete is compared with the beginnings of the expected replies."""
    if len(audio) < MIN_JUDGED_S * 16000:
        return Verdict()
    scores = matcher.scores(audio, prefix=not completed)
    own = float(scores[phrase])
    other_phrase = max((j for j in range(PHRASES) if j != phrase), key=lambda j: float(scores[j]))
    other = float(scores[other_phrase])
    length = len(audio) / matcher.spans[phrase]
    matches = own >= MATCH and own >= other + MARGIN
    return Verdict(
        own=own,
        other=other,
        other_phrase=other_phrase,
        length=length,
        matches=matches,
        answers=matches and completed and length >= COMPLETE,
        wrong=other >= MATCH and other >= own + MARGIN,
    )


def evaluate(
    callers: list[Caller], matcher: Matcher, keep: Path | None = None, *, keep_all: bool = False
) -> dict[str, Any]:
    """The counts of the module docstring, from what every caller recorded; the audio of each
    completed reply that did not count (and of each wrong-session one) is written to ``keep``."""
    counts: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    broken: Counter[str] = Counter()
    anomalies: Counter[str] = Counter()
    own_scores: list[float] = []
    by_phrase: dict[int, float] = {}
    other_scores: list[float] = []
    lengths: list[float] = []
    wrong: list[dict[str, Any]] = []
    lost: list[dict[str, Any]] = []
    answered: dict[tuple[int, int], str] = {}
    for c in callers:
        errors.update(c.errors)
        broken.update(c.broken_calls)
        anomalies.update(c.anomalies)
        if c.failure:
            anomalies[f"session gave up: {c.failure}"] += 1
        matches: dict[str, bool] = {}
        judged: dict[str, str] = {}
        for r in c.responses.values():
            statuses[_STATUS.get(r.status, "unfinished")] += 1
            audio = decode(bytes(r.pcm), PCM16K_MONO)[:, 0] if r.pcm else np.zeros(0, np.float32)
            v = judge(matcher, audio, c.phrase, completed=r.status == COMPLETED)
            matches[r.response_id] = v.answers
            if v.own is None:
                continue
            own_scores.append(v.own)
            other_scores.append(v.other)
            judged[r.response_id] = f" own={v.own:.2f} other={v.other:.2f} len={v.length:.2f}"
            if v.wrong:
                wrong.append(
                    {
                        "session": c.index,
                        "response_id": r.response_id,
                        "own": round(v.own, 3),
                        "other": round(v.other, 3),
                        "phrase": v.other_phrase,
                    }
                )
            if r.status == COMPLETED and v.matches:
                lengths.append(v.length)
                by_phrase[c.phrase] = round(min(v.own, by_phrase.get(c.phrase, 1.0)), 3)
            if keep is not None and (keep_all or v.wrong or (r.status == COMPLETED and not v.answers)):
                write_wav(keep / f"reply_s{c.index:02d}_p{c.phrase:02d}_{r.response_id}.wav", audio, 16000)
        for t in c.turns:
            if t.spoken is None or t.written < t.chunks:
                counts["turns_unspoken"] += 1
                continue
            counts["turns_spoken"] += 1
            failed = any(c.responses[rid].status == FAILED for rid in t.responses)
            counts["turns_failed"] += failed
            answer = next((rid for rid in t.responses if matches.get(rid, False)), None)
            if answer is not None:
                counts["turns_answered"] += 1
                answered[(c.index, t.index)] = answer
                continue
            counts["turns_unanswered"] += 1
            counts["turns_in_flight_at_end"] += t.in_flight_at_end
            if t.acked == t.chunks:
                counts["lost_acked_turns"] += 1
                lost.append(
                    {
                        "session": c.index,
                        "session_id": c.session_id,
                        "turn": t.index,
                        "started_at": round(t.started, 3),
                        "spoken_at": round(t.spoken, 3),
                        "turn_ids": t.turn_ids,
                        "responses": [
                            f"{_STATUS.get(c.responses[rid].status, 'unfinished')}"
                            f"{':' + c.responses[rid].reason if c.responses[rid].reason else ''}"
                            f"{judged.get(rid, '')}"
                            for rid in t.responses
                        ],
                        "events": [
                            f"{at:.3f} {text}"
                            for at, text in c.timeline
                            if t.started - 1.0 <= at <= (t.spoken or t.started) + REPLY_TIMEOUT_S
                        ],
                    }
                )
            else:
                counts["turns_unacked_unanswered"] += 1
    return {
        "counts": counts,
        "answered": answered,
        "responses": dict(statuses),
        "errors": dict(errors),
        "broken_calls": dict(broken),
        "anomalies": dict(anomalies),
        "wrong": wrong,
        "lost": lost,
        "scores": {
            "own_min_answered": round(min((s for s in own_scores if s >= MATCH), default=0.0), 3),
            "other_max": round(max(other_scores, default=0.0), 3),
            "reply_length_vs_speech_min": round(min(lengths, default=0.0), 3),
            "reply_length_vs_speech_max": round(max(lengths, default=0.0), 3),
            "own_min_by_phrase": dict(sorted(by_phrase.items())),
        },
    }


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def turn_latencies(
    callers: list[Caller], answered: dict[tuple[int, int], str], faults: list[dict[str, Any]], t_open: float
) -> dict[str, Any]:
    """End of speech -> first reply audio of every answered turn, before the first fault (the
    baseline) and after each fault, by how many turns after it a session's turn is (1: the first
    it started after the fault ended). A turn lags when it is at least the second one a session
    started after a fault, nothing else happened between its start and its first audio, and its
    latency is more than ``LAG_S`` over the baseline's 90th percentile: the conversation did not
    get back to real time. ``answered``: (session, turn) -> the response that answered it."""
    # Fault times on the callers' clock; a hang lasts until its SIGCONT.
    events = [(f["t"] + t_open, f["fault"]) for f in faults]
    ends: list[tuple[float, float, str]] = []
    for at, what in events:
        if what == "SIGCONT worker":
            continue
        end = (
            next((t for t, w in events if w == "SIGCONT worker" and t >= at), at) if "SIGSTOP" in what else at
        )
        ends.append((at, end, what))
    first_fault = min((at for at, _, _ in ends), default=float("inf"))
    baseline: list[float] = []
    latency: dict[tuple[int, int], tuple[float, float, float]] = {}
    for c in callers:
        for t in c.turns:
            rid = answered.get((c.index, t.index))
            r = c.responses.get(rid) if rid is not None else None
            if r is None or r.first_audio is None or t.spoken is None:
                continue
            end_of_speech = t.spoken - TRAIL_S
            latency[(c.index, t.index)] = (t.started, r.first_audio, r.first_audio - end_of_speech)
            if r.first_audio < first_fault:
                baseline.append(r.first_audio - end_of_speech)
    base_p90 = _percentile(baseline, 90)
    after: list[dict[str, Any]] = []
    lagging: list[dict[str, Any]] = []
    for at, end, what in ends:
        by_k: dict[int, list[float]] = {}
        for c in callers:
            k = 0
            for t in c.turns:
                if t.started < end or (c.index, t.index) not in latency:
                    continue
                k += 1
                started, first_audio, lat = latency[(c.index, t.index)]
                by_k.setdefault(k, []).append(lat)
                quiet = not any(started <= a <= first_audio for a, _, _ in ends)
                if k >= 2 and quiet and baseline and lat > base_p90 + LAG_S:
                    lagging.append(
                        {"session": c.index, "turn": t.index, "after": what, "latency_ms": round(lat * 1000)}
                    )
        after.append(
            {
                "fault": what,
                "t": round(at - t_open, 3),
                "turns": {
                    k: {
                        "n": len(v),
                        "median_ms": round(_percentile(v, 50) * 1000),
                        "max_ms": round(max(v) * 1000),
                    }
                    for k, v in sorted(by_k.items())
                    if k <= 3
                },
            }
        )
    return {
        "baseline": {
            "n": len(baseline),
            "median_ms": round(_percentile(baseline, 50) * 1000),
            "p90_ms": round(base_p90 * 1000),
        },
        "after_faults": after,
        "lagging_turns": len(lagging),
        "lagging": lagging[:20],
    }


def run(opts: Options) -> dict[str, Any]:
    """Start the stack, drive it, stop it; the report (see ``summary``)."""
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="fault-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    matcher = Matcher()
    began = time.monotonic()
    stack, started = start_stack(opts, log_dir)
    startup_s = time.monotonic() - began
    try:
        driven = asyncio.run(_drive(opts, stack, matcher.voices))
        began = time.monotonic()
        state = _worker_state(stack, within=10.0)
        state_s = time.monotonic() - began
        for p in stack.all():
            p.scrape()
        fail_closed = {p.name: metric_total(p.last_metrics, FAIL_CLOSED) for p in stack.all()}
    finally:
        began = time.monotonic()
        stop_all(started)
        stop_s = time.monotonic() - began
    callers: list[Caller] = driven["callers"]
    began = time.monotonic()
    result = evaluate(callers, matcher, keep=log_dir, keep_all=opts.keep_audio)
    evaluate_s = time.monotonic() - began
    counts = result.pop("counts")
    latencies = turn_latencies(
        callers, result.pop("answered"), driven["faults"], driven["timing"]["opened_s"]
    )
    resumed = [c for c in callers if c.resumes]
    return {
        "sessions": opts.sessions,
        "seconds": opts.seconds,
        "faults_injected": opts.faults,
        "turns_spoken": counts["turns_spoken"],
        "turns_answered": counts["turns_answered"],
        "wrong_session_replies": len(result["wrong"]),
        "lost_acked_turns": counts["lost_acked_turns"],
        "sessions_resumed": len(resumed),
        "worker_state_left": sum(state.values()),
        "fail_closed_steps": sum(fail_closed.values()),
        "turns_failed": counts["turns_failed"],
        "turns_unanswered": counts["turns_unanswered"],
        "turns_unacked_unanswered": counts["turns_unacked_unanswered"],
        "turns_in_flight_at_end": counts["turns_in_flight_at_end"],
        "turns_unspoken": counts["turns_unspoken"],
        "resumes": sum(len(c.resumes) for c in callers),
        "resume_s_max": max((r["took_s"] for c in callers for r in c.resumes), default=0.0),
        "appends_resent": sum(c.resent for c in callers),
        "late_s": round(sum(c.late_s for c in callers), 1),
        "responses": result["responses"],
        "error_codes": result["errors"],
        "broken_calls": result["broken_calls"],
        "anomalies": result["anomalies"],
        "faults": driven["faults"],
        "killed_gone": all(f.get("gone", True) for f in driven["faults"]),
        "worker_state": state,
        "fail_closed": fail_closed,
        "scores": result["scores"],
        "latency": latencies,
        "lagging_turns": latencies["lagging_turns"],
        "wrong": result["wrong"],
        "lost": result["lost"][:20],
        "timing": {
            "startup_s": round(startup_s, 1),
            **{k: round(v, 1) for k, v in driven["timing"].items()},
            "worker_state_s": round(state_s, 1),
            "stop_s": round(stop_s, 1),
            "evaluate_s": round(evaluate_s, 1),
        },
        "logs": str(log_dir),
    }


def summary(report: dict[str, Any], out: IO[str]) -> None:
    r = report

    def line(label: str, value: object, note: str = "") -> None:
        print(f"  {label:<44} {value!s:>8}  {note}", file=out)

    mode = "with faults" if r["faults_injected"] else "no faults"
    print(f"fault-and-load: {r['sessions']} sessions, {r['seconds']:g} s, {mode}", file=out)
    line("turns spoken", r["turns_spoken"])
    line("turns answered (complete, matching reply)", r["turns_answered"])
    line("replies to the wrong session", r["wrong_session_replies"], "(must be 0)")
    line("turns whose acknowledged input was lost", r["lost_acked_turns"], "(must be 0)")
    line(
        "sessions resumed", r["sessions_resumed"], f"({r['resumes']} resumes, slowest {r['resume_s_max']} s)"
    )
    line("worker state left after all close", r["worker_state_left"], "(must be 0)")
    line("fail-closed steps under valid traffic", r["fail_closed_steps"], "(must be 0)")
    line("turns failed (response_done FAILED)", r["turns_failed"])
    line(
        "turns unanswered",
        r["turns_unanswered"],
        f"({r['turns_in_flight_at_end']} still in flight at the end)",
    )
    line("  of them not fully acknowledged", r["turns_unacked_unanswered"])
    line("appends re-sent after a resume", r["appends_resent"])
    line("seconds of audio the callers fell behind", r["late_s"], "(over all sessions; 0: real time kept)")
    print(f"  responses: {r['responses']}", file=out)
    print(f"  error codes: {r['error_codes'] or '-'}", file=out)
    print(f"  broken calls: {r['broken_calls'] or '-'}", file=out)
    if r["anomalies"]:
        print(f"  anomalies: {r['anomalies']}", file=out)
    for f in r["faults"]:
        where = f"; sessions placed: {f['placement']}" if "placement" in f else ""
        print(f"  t={f['t']:7.3f} s  {f['fault']} {f['process']} (pid {f['pid']}){where}", file=out)
    lat = r["latency"]
    line(
        "turns lagging after a fault",
        r["lagging_turns"],
        f"(must be 0; end of speech -> first audio, baseline median {lat['baseline']['median_ms']} ms, "
        f"p90 {lat['baseline']['p90_ms']} ms, {lat['baseline']['n']} turns)",
    )
    for a in lat["after_faults"]:
        turns = ", ".join(
            f"turn {k}: median {v['median_ms']} ms, max {v['max_ms']} ms ({v['n']})"
            for k, v in a["turns"].items()
        )
        print(f"  after {a['fault']} at t={a['t']} s: {turns or '-'}", file=out)
    for lag in lat["lagging"]:
        print(f"  LAGGING: {lag}", file=out)
    print(f"  scores: {r['scores']}", file=out)
    for w in r["wrong"]:
        print(f"  WRONG SESSION: {w}", file=out)
    for lost in r["lost"]:
        events = lost.get("events", [])
        print(f"  lost: { {k: v for k, v in lost.items() if k != 'events'} }", file=out)
        for event in events:
            print(f"      {event}", file=out)
    print(f"  timing: {r['timing']}; logs in {r['logs']}", file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fault_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--no-faults", action="store_true", help="load only (checks the harness itself)")
    p.add_argument("--device", default="cpu", help="the workers' --device")
    p.add_argument("--log-dir", type=Path, default=None, help="the processes' logs (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--keep-audio", action="store_true", help="write every reply's audio to the log directory")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.seconds <= 0:
        p.error("--sessions and --seconds must be positive")
    # A SIGTERM to us stops the children too (the finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(
        Options(
            sessions=args.sessions,
            seconds=args.seconds,
            faults=not args.no_faults,
            device=args.device,
            log_dir=args.log_dir,
            keep_audio=args.keep_audio,
        )
    )
    if args.json:
        print(json.dumps(report))
    else:
        summary(report, sys.stdout)
    bad = report["wrong_session_replies"] or report["lost_acked_turns"] or report["worker_state_left"]
    bad = bad or report["fail_closed_steps"] or report["turns_answered"] < report["turns_spoken"]
    bad = bad or report["lagging_turns"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
