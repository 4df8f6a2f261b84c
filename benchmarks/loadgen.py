"""The load generator: real-time sessions against a session service, in a process of its own.

    python -m benchmarks.loadgen --target HOST:PORT --sessions N [--append-ms 20] [--mode speech]

It is started by ``benchmarks._load`` (one or more of these processes), never by the session
service: its CPU is its own and is reported apart. It speaks the wire protocol with the plain
``grpc.aio`` stub (one ``Converse`` call per session, all on one channel), not through
``duplex.client``, so what it spends per message is as little as a client can.

Each session streams a **tape** at real-time pace: one append of ``--append-ms`` audio (s16le, 16
kHz mono) every ``--append-ms``, deadline-aligned (a late append is sent at once and the next keeps
its own deadline: real time, as a microphone with a buffer). Sessions are staggered evenly over one
append period, and each starts at its own place on the tape.

Modes:

* ``speech``: the tape is the espeak fixtures (``tests/fixtures/speech_NN.wav``), each followed by
  a pause of ``silence + its own length + margin`` (the server's turn detection ends the turn after
  ``silence`` ms, and the reply, as long as the utterance, plays during the rest). Server turn
  detection with barge-in on: a reply that is still playing when the next utterance starts is cut
  (``barge_in``), so a late reply is a lost turn.
* ``duplex``: the tape is the fixtures back to back (continuous speech); the client commits every
  ``--cycle`` worker frames and asks for a response as soon as none is active (manual turns, no
  barge-in), so nearly every input frame has a reply frame playing alongside it. For CPU per frame.

With ``--lanes`` the process holds all its sessions as lanes of ONE ``ConverseMany`` stream, as a
backend serving many callers would: each session keeps its own phase, and every ``--flush-ms`` one
message carries the events of every session whose append fell due since the last one.

Protocol with the orchestrator, JSON lines: this process prints ``{"event": "ready"}`` once every
session is open; it then reads one line ``{"start": T0, "window": [A, B], "end": E}`` (times on
``time.monotonic()``, which is system-wide on Linux), streams from T0 to E, measures what happens
in the window [A, B], closes its sessions, writes its result to ``--out`` and prints
``{"event": "done"}``.

What it measures (client-side receive times, ``time.monotonic()``):

* ack latency: from just before an append is written (with ``--lanes``: from its deadline, so the
  wait for the next flush counts) to the receipt of the ack covering it, for appends written in
  the window;
* lateness: how long after its deadline each append of the window was written (the generator's
  own schedule);
* turns (``committed`` events received in the window): first-audio latency from the ``committed``
  event to the response's first ``audio_delta``; whether a ``response_done`` COMPLETED with audio
  came by the end (``E``);
* per session: appends written and acknowledged in the window, and the appends unacknowledged at
  the window's end;
* reply frames received in the window; errors, closes and broken streams at any time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from duplex.audio import PCM16K_MONO, read_wav, to_mono
from duplex.serving import CHANNEL_OPTIONS
from duplex.v1 import session_pb2, session_pb2_grpc

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
RATE = 16000
SAMPLE_BYTES = 2
FRAME_SAMPLES = 512
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED


def fixture_utterances(directory: Path = FIXTURES) -> list[bytes]:
    """The espeak phrases ``speech_NN.wav`` (16 kHz mono s16le), as s16le bytes, in name order."""
    out = []
    for path in sorted(directory.glob("speech_[0-9][0-9].wav")):
        x, rate = read_wav(path)
        if rate != RATE or x.shape[1] != 1:
            continue
        x = to_mono(x)
        out.append((np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes())
    if not out:
        raise FileNotFoundError(f"no speech_NN.wav fixtures in {directory}")
    return out


def pause_ms(utterance_bytes: int, *, silence_ms: int, margin_ms: int) -> int:
    """The pause after an utterance: turn detection's silence, the reply (as long as the
    utterance), and a margin for the reply to be late without being cut by the next utterance."""
    return silence_ms + utterance_bytes * 1000 // (RATE * SAMPLE_BYTES) + margin_ms


def build_tape(
    utterances: list[bytes], *, mode: str, append_bytes: int, silence_ms: int = 500, margin_ms: int = 1000
) -> bytes:
    """The audio every session loops: ``speech`` mode puts a pause after each utterance,
    ``duplex`` mode plays them back to back. Its length is a whole number of appends (silence
    pads the end), so appends never straddle the loop point."""
    parts: list[bytes] = []
    for u in utterances:
        parts.append(u)
        if mode == "speech":
            parts.append(
                bytes(pause_ms(len(u), silence_ms=silence_ms, margin_ms=margin_ms) * RATE // 1000 * 2)
            )
    tape = b"".join(parts)
    rest = len(tape) % append_bytes
    if rest:
        tape += bytes(append_bytes - rest)
    return tape


def append_bytes_for(append_ms: int) -> int:
    samples = RATE * append_ms // 1000
    if samples * 1000 != RATE * append_ms:
        raise ValueError(f"{append_ms} ms is not a whole number of samples at {RATE} Hz")
    return samples * SAMPLE_BYTES


@dataclass(slots=True)
class Turn:
    committed: float
    """When the ``committed`` event was received."""
    first_audio: float | None = None
    status: session_pb2.ResponseStatus.ValueType | None = None
    reason: str = ""
    audio_ms: int = 0


@dataclass
class Window:
    start: float
    a: float
    b: float
    end: float


@dataclass
class SessionLoad:
    """One session: its call, its schedule, and what it saw."""

    index: int
    call: Any
    tape_offset: int
    phase_s: float
    sent: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Send time of each append, by seq (index 0 unused)."""
    last_seq: int = 0
    acked_upto: int = 0
    ack_lat_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reply_turn: Turn | None = None
    reply_bytes_window: int = 0
    errors: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    cancelled: int = 0
    failure: str = ""
    sent_in_window: int = 0
    acked_in_window: int = 0
    unacked_at_b: int = 0
    # duplex mode
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    want_response: bool = False
    since_commit_bytes: int = 0
    lane: str = ""
    """Its lane on the generator's one ConverseMany stream (``--lanes``)."""


def _event_in(events: list[session_pb2.ClientEvent]) -> session_pb2.ClientEvent:
    """A new event, appended to ``events`` (a session's own stream writes them one by one)."""
    ev = session_pb2.ClientEvent()
    events.append(ev)
    return ev


def _lane_event(batch: session_pb2.ClientBatch, lane: str) -> session_pb2.ClientEvent:
    """A new event of ``lane``, made inside ``batch``."""
    return batch.events.add(lane=lane).event


class Generator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.append_bytes = append_bytes_for(args.append_ms)
        self.append_s = args.append_ms / 1000.0
        utterances = fixture_utterances()
        self.tape = build_tape(
            utterances,
            mode=args.mode,
            append_bytes=self.append_bytes,
            silence_ms=args.silence_ms,
            margin_ms=args.margin_ms,
        )
        self.sessions: list[SessionLoad] = []
        self.window: Window | None = None
        self.frames_per_cycle = args.cycle
        self.lane_call: Any = None
        """``--lanes``: the one ConverseMany call of all sessions."""

    # ---- opening ---------------------------------------------------------------------------

    async def open_all(self, stub: Any) -> None:
        args = self.args
        rng = random.Random(args.seed + args.first_index)
        appends_on_tape = len(self.tape) // self.append_bytes
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> SessionLoad:
            index = args.first_index + i
            async with sem:
                call = stub.Converse()
                await call.write(self._open_event())
                ev = await asyncio.wait_for(call.read(), args.open_timeout_s)
                if ev is grpc.aio.EOF or ev.WhichOneof("event") != "opened":
                    code = await call.code() if ev is grpc.aio.EOF else None
                    raise RuntimeError(f"session {index} did not open: {ev if code is None else code}")
            return self._session(index, call, rng, appends_on_tape)

        if args.lanes:
            await self._open_lanes(stub, rng, appends_on_tape)
            return
        self.sessions = list(await asyncio.gather(*(one(i) for i in range(args.sessions))))

    async def _open_lanes(self, stub: Any, rng: random.Random, appends_on_tape: int) -> None:
        """``--lanes``: every session a lane of ONE ConverseMany stream, opened in one message."""
        args = self.args
        call = self.lane_call = stub.ConverseMany()
        batch = session_pb2.ClientBatch()
        for i in range(args.sessions):
            index = args.first_index + i
            s = self._session(index, call, rng, appends_on_tape, lane=str(index))
            self.sessions.append(s)
            batch.events.add(lane=s.lane, event=self._open_event())
        await call.write(batch)
        waiting = {s.lane for s in self.sessions}
        async with asyncio.timeout(args.open_timeout_s):
            while waiting:
                got = await call.read()
                if got is grpc.aio.EOF:
                    raise RuntimeError(f"the stream ended: {await call.code()}")
                for out in got.outputs:
                    if out.HasField("ended"):
                        raise RuntimeError(f"lane {out.lane} did not open: {out.ended}")
                    if out.event.WhichOneof("event") == "opened":
                        waiting.discard(out.lane)

    def _session(
        self, index: int, call: Any, rng: random.Random, appends_on_tape: int, lane: str = ""
    ) -> SessionLoad:
        """Session ``index``: its own place on the tape, its phase in the append period."""
        s = SessionLoad(
            index=index,
            call=call,
            tape_offset=rng.randrange(appends_on_tape) * self.append_bytes,
            phase_s=(index / max(1, self.args.total)) * self.append_s,
            lane=lane,
        )
        s.idle.set()
        return s

    def _open_event(self) -> session_pb2.ClientEvent:
        args = self.args
        td = session_pb2.TurnDetection(
            auto_respond=args.mode == "speech", barge_in=args.mode == "speech", silence_ms=0
        )
        cfg = session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto(), turn_detection=td)
        return session_pb2.ClientEvent(
            open=session_pb2.SessionOpen(model=args.model, config=cfg, acks_on_output=not args.separate_acks)
        )

    # ---- streaming -------------------------------------------------------------------------

    def _tick(
        self, s: SessionLoad, w: Window, due: float, now: float, new: Callable[[], session_pb2.ClientEvent]
    ) -> None:
        """The events session ``s`` writes at its append due at ``due`` (written at ``now``), each
        made by ``new`` and filled in place (on lanes, inside the message: no copy of the audio):
        the append, and in duplex mode a commit every cycle and a response as soon as none is
        active. The append's send time and lateness are noted."""
        if w.a <= due < w.b:
            s.late_ms.append(1000.0 * (now - due))
            s.sent_in_window += 1
        seq = s.last_seq = s.last_seq + 1
        if seq < len(s.sent):
            # On lanes the audio waited for the flush since its deadline: its ack counts from there.
            s.sent[seq] = due if s.lane else now
        ab = self.append_bytes
        off = s.tape_offset
        append = new().append
        append.seq = seq
        append.pcm = self.tape[off : off + ab]
        s.tape_offset = off + ab if off + ab < len(self.tape) else 0
        if self.args.mode == "duplex":
            s.since_commit_bytes += ab
            if s.since_commit_bytes >= self.frames_per_cycle * FRAME_SAMPLES * SAMPLE_BYTES:
                s.since_commit_bytes = 0
                new().commit.SetInParent()
                s.want_response = True
            if s.want_response and s.idle.is_set():
                s.want_response = False
                s.idle.clear()
                new().response_create.SetInParent()

    def _appends(self, w: Window) -> int:
        return int((w.end - w.start) / self.append_s) + 2

    async def send(self, s: SessionLoad, w: Window) -> None:
        n = self._appends(w)
        s.sent = np.zeros(n + 1)
        due = w.start + s.phase_s
        write = s.call.write
        clock = time.monotonic
        while due < w.end and s.last_seq < n:
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            events: list[session_pb2.ClientEvent] = []
            self._tick(s, w, due, clock(), functools.partial(_event_in, events))
            for ev in events:
                await write(ev)
            due += self.append_s

    async def send_lanes(self, call: Any, w: Window) -> None:
        """``--lanes``: every ``--flush-ms``, ONE message with the events of every session whose
        append fell due since the last (each session keeps its own phase, so an append waits for
        the next flush: its ack latency counts that wait)."""
        n = self._appends(w)
        flush_s = (self.args.flush_ms or self.args.append_ms) / 1000.0
        due = {s.lane: w.start + s.phase_s for s in self.sessions}
        for s in self.sessions:
            s.sent = np.zeros(n + 1)
        at = w.start + min(s.phase_s for s in self.sessions)
        clock = time.monotonic
        while at < w.end:
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            now = clock()
            batch = session_pb2.ClientBatch()
            for s in self.sessions:
                d = due[s.lane]
                while d <= now and d < w.end and s.last_seq < n:
                    self._tick(s, w, d, now, functools.partial(_lane_event, batch, s.lane))
                    d += self.append_s
                due[s.lane] = d
            if batch.events:
                await call.write(batch)
            at += flush_s

    def on_event(self, s: SessionLoad, ev: session_pb2.ServerEvent, now: float, w: Window) -> None:
        kind = ev.WhichOneof("event")
        ack = ev.input_ack if kind == "input_ack" else ev.carried_ack if ev.HasField("carried_ack") else None
        if ack is not None:
            seq = ack.seq
            sent = s.sent
            for k in range(s.acked_upto + 1, min(seq, len(sent) - 1) + 1):
                t = sent[k]
                if w.a <= t < w.b:
                    s.ack_lat_ms.append(1000.0 * (now - t))
                    s.acked_in_window += 1
            if seq > s.acked_upto:
                s.acked_upto = seq
        if kind == "audio_delta":
            turn = s.reply_turn
            if turn is not None and turn.first_audio is None:
                turn.first_audio = now
            if w.a <= now < w.b:
                s.reply_bytes_window += len(ev.audio_delta.pcm)
        elif kind == "committed":
            s.turns.append(Turn(committed=now))
        elif kind == "response_started":
            s.reply_turn = s.turns[-1] if s.turns else None
        elif kind == "response_done":
            turn = s.reply_turn
            if turn is not None:
                turn.status = ev.response_done.status
                turn.reason = ev.response_done.reason
                turn.audio_ms = ev.response_done.audio_ms
            s.reply_turn = None
            s.idle.set()
        elif kind == "audio_cancelled":
            s.cancelled += 1
        elif kind == "error":
            s.errors.append(ev.error.code)
        elif kind == "closed":
            s.closed.append(ev.closed.reason)

    async def read(self, s: SessionLoad, w: Window) -> None:
        clock = time.monotonic
        read = s.call.read
        eof = grpc.aio.EOF
        try:
            while True:
                ev = await read()
                if ev is eof:
                    break
                self.on_event(s, ev, clock(), w)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                s.failure = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            s.failure = repr(exc)

    async def read_lanes(self, call: Any, w: Window) -> None:
        """``--lanes``: the stream's messages, each output handed to its session."""
        by_lane = {s.lane: s for s in self.sessions}
        clock = time.monotonic
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                now = clock()
                for out in batch.outputs:
                    s = by_lane.get(out.lane)
                    if s is None:
                        continue
                    if out.HasField("ended"):
                        if out.ended.status:
                            s.failure = f"lane ended: {out.ended.code}: {out.ended.message}"
                        continue
                    self.on_event(s, out.event, now, w)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                for s in self.sessions:
                    s.failure = s.failure or f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for s in self.sessions:
                s.failure = s.failure or repr(exc)

    async def snapshot_at_b(self, w: Window) -> None:
        await asyncio.sleep(max(0.0, w.b - time.monotonic()))
        for s in self.sessions:
            s.unacked_at_b = s.last_seq - s.acked_upto

    async def run(self, w: Window) -> None:
        self.window = w
        if self.lane_call is not None:
            await self._run_lanes(self.lane_call, w)
            return
        readers = [asyncio.create_task(self.read(s, w)) for s in self.sessions]
        senders = [asyncio.create_task(self.send(s, w)) for s in self.sessions]
        snap = asyncio.create_task(self.snapshot_at_b(w))
        done = await asyncio.gather(*senders, return_exceptions=True)
        for s, res in zip(self.sessions, done, strict=True):
            if isinstance(res, BaseException) and not s.failure:
                s.failure = f"sending failed: {res!r}"
        await snap

        # Close: the server answers ``closed`` and ends each stream.
        async def close(s: SessionLoad) -> None:
            with contextlib.suppress(Exception):
                await s.call.write(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
                await s.call.done_writing()

        await asyncio.gather(*(close(s) for s in self.sessions))
        _, pending = await asyncio.wait(readers, timeout=10.0)
        for t in pending:
            t.cancel()
        for s in self.sessions:
            with contextlib.suppress(Exception):
                s.call.cancel()

    async def _run_lanes(self, call: Any, w: Window) -> None:
        reader = asyncio.create_task(self.read_lanes(call, w))
        snap = asyncio.create_task(self.snapshot_at_b(w))
        try:
            await self.send_lanes(call, w)
        except Exception as exc:
            for s in self.sessions:
                s.failure = s.failure or f"sending failed: {exc!r}"
        await snap
        with contextlib.suppress(Exception):
            await call.done_writing()  # a half-close closes every lane's session
        _, pending = await asyncio.wait([reader], timeout=10.0)
        for t in pending:
            t.cancel()
        with contextlib.suppress(Exception):
            call.cancel()

    # ---- results ---------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        w = self.window
        assert w is not None
        ack: list[float] = []
        late: list[float] = []
        first_audio: list[float] = []
        turns = answered = 0
        unanswered: dict[str, int] = {}
        per_session = []
        errors: dict[str, int] = {}
        closed: dict[str, int] = {}
        failures = []
        reply_bytes = 0
        for s in self.sessions:
            ack += s.ack_lat_ms
            late += s.late_ms
            reply_bytes += s.reply_bytes_window
            for code in s.errors:
                errors[code] = errors.get(code, 0) + 1
            for reason in s.closed:
                if reason != "client_close":
                    closed[reason] = closed.get(reason, 0) + 1
            if s.failure:
                failures.append(f"session {s.index}: {s.failure}")
            for t in s.turns:
                if not w.a <= t.committed < w.b:
                    continue
                turns += 1
                if t.status == COMPLETED and t.audio_ms > 0:
                    answered += 1
                    if t.first_audio is not None:
                        first_audio.append(1000.0 * (t.first_audio - t.committed))
                else:
                    why = (
                        "no response_done by the end"
                        if t.status is None
                        else f"{session_pb2.ResponseStatus.Name(t.status)} {t.reason}".strip()
                    )
                    unanswered[why] = unanswered.get(why, 0) + 1
            per_session.append(
                {
                    "index": s.index,
                    "sent": s.sent_in_window,
                    "acked": s.acked_in_window,
                    "unacked_at_end": s.unacked_at_b,
                }
            )
        return {
            "sessions": len(self.sessions),
            "append_ms": self.args.append_ms,
            "mode": self.args.mode,
            "window_s": w.b - w.a,
            "ack_ms": ack,
            "late_ms": late,
            "first_audio_ms": first_audio,
            "turns": turns,
            "answered": answered,
            "unanswered": unanswered,
            "reply_frames": reply_bytes / (FRAME_SAMPLES * SAMPLE_BYTES),
            "per_session": per_session,
            "errors": errors,
            "closed": closed,
            "failures": failures[:20],
            "failed_sessions": len(failures),
            "cancelled": sum(s.cancelled for s in self.sessions),
        }


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main_async(args: argparse.Namespace, gen: Generator) -> int:
    async with grpc.aio.insecure_channel(args.target, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), 15.0)
        stub = session_pb2_grpc.DuplexSessionStub(channel)
        try:
            await gen.open_all(stub)
        except Exception as exc:
            _say({"event": "error", "reason": f"opening sessions failed: {exc!r}"})
            return 2
        _say({"event": "ready", "sessions": len(gen.sessions)})
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if not line.strip():
            return 2
        go = json.loads(line)
        w = Window(start=go["start"], a=go["window"][0], b=go["window"][1], end=go["end"])
        await gen.run(w)
    return 0


def finish(gen: Generator, out: str) -> None:
    Path(out).write_text(json.dumps(gen.result()))
    _say({"event": "done"})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--sessions", type=int, required=True, help="sessions of this process")
    p.add_argument("--total", type=int, default=0, help="sessions of all generator processes (stagger)")
    p.add_argument("--first-index", type=int, default=0, help="index of this process's first session")
    p.add_argument("--append-ms", type=int, default=20)
    p.add_argument("--mode", choices=("speech", "duplex"), default="speech")
    p.add_argument("--model", default="parrot")
    p.add_argument("--cycle", type=int, default=32, help="duplex mode: worker frames per turn")
    p.add_argument(
        "--silence-ms", type=int, default=500, help="the server's turn-end silence (parrot default)"
    )
    p.add_argument("--margin-ms", type=int, default=1000, help="speech mode: pause beyond silence + reply")
    p.add_argument(
        "--separate-acks",
        action="store_true",
        help="open without acks_on_output: every ack an input_ack event of its own, sent when the "
        "append is handed on (as a client that does not read carried_ack gets them)",
    )
    p.add_argument(
        "--lanes",
        action="store_true",
        help="all sessions of this process on ONE ConverseMany stream, their events sent together "
        "every --flush-ms",
    )
    p.add_argument(
        "--flush-ms",
        type=float,
        default=0.0,
        help="--lanes: how often the stream's pending events go out in one message (0 = every append period)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--open-timeout-s", type=float, default=30.0)
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.total:
        args.total = args.sessions
    gen = Generator(args)
    code = asyncio.run(main_async(args, gen))
    if code == 0:
        finish(gen, args.out)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
