"""Hostile client event sequences against a live stack (the hostile-load issue): a hypothesis
state machine drives Converse streams of an in-process session service in front of a real
(in-process) parrot worker with valid and malformed events in any order, while a healthy
session beside them keeps completing parrot turns.

Every step: opens (good and bad), second opens, resumes (live, closed, forged), updates (good,
NaN, too deep, other formats), appends (good speech/noise/silence, odd-length, zero-length,
oversized, beyond the message limit, a wrong declared format, NaN/Inf in f32, repeated seqs),
user turns (speech then silence, or commit and response_create) whose replies stream on during
the next steps, interruptions (barge_in, response_cancel, speaking over a reply), clear,
playback_ack, function_call_output, close, half-close, a dropped stream, empty events, events
before the open, several streams of one client at once. After each step the stream is synced
(an empty event's ``invalid_event`` answer comes back once every earlier event was handled), then
the invariants are checked on everything received so far:

- no call ends with INTERNAL or UNKNOWN (or a status without a stable code), and no ``error``
  event carries ``internal`` or a code that is not a ``duplex.errors.ErrorCode``;
- no audio of an epoch the client has seen cancelled (``audio_cancelled``) arrives after it, on
  that stream or on a later one of the same session;
- ``input_ack`` seqs never go backwards within an epoch.

After each machine the sessions it made are gone (dropped streams after the short detached
grace): the replica holds only the healthy session, and so does the worker. At the end the
healthy session's turns were all completed and correct (by content, as
``tests/test_session_stack.py`` checks them), and nothing is held anywhere.

The servers run in an event loop on a thread of their own (``_Portal``); the machine's rules
are synchronous and call into it. ``pytest -s`` prints what the run covered; ``FUZZ_EXAMPLES=200``
runs longer (25 machines of 30 steps by default: about 15 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import struct
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
import numpy as np
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat, encode, resample
from duplex.errors import ErrorCode
from duplex.v1 import common_pb2, session_pb2
from session_service.session.emitter import echoed_event_id
from session_service.session.settings import MAX_EXTRA_BODY_DEPTH
from tests.fuzz_helpers import BAD_STATUSES, KNOWN_CODES, VOICES, HealthyTalker, story, turn_problems
from tests.session_helpers import Conversation, InProcessStack, in_process_stack, open_event, sample

T = TypeVar("T")

MAX_APPEND = 256 * 1024
#: Formats the fuzzed sessions speak (conversion both ways is on the path).
FORMATS = [
    PCM16K_MONO,
    PcmFormat(F32LE, 16000, 1),
    PcmFormat(S16LE, 48000, 2),
    PcmFormat(F32LE, 8000, 1),
    PcmFormat(F32LE, 44100, 2),
]
DETACHED_GRACE_S = 0.1


class _Portal:
    """An event loop on its own thread: the stack and every client live there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(cancel_the_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class _World:
    """The stack, the healthy session and the loop they run in, for the whole test."""

    def __init__(self) -> None:
        self.portal = _Portal()
        self._exits = contextlib.AsyncExitStack()
        self.stack: InProcessStack = self.portal.call(self._start(), timeout=120)

    async def _start(self) -> InProcessStack:
        stack = await self._exits.enter_async_context(
            in_process_stack(runner={"detached_grace_s": DETACHED_GRACE_S, "idle_timeout_s": 60})
        )
        self.healthy = HealthyTalker(stack.target)
        self._healthy_task = asyncio.create_task(self.healthy.run())
        return stack

    async def stop_healthy(self) -> None:
        self.healthy.stop()
        await asyncio.wait_for(self._healthy_task, 90)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return self.portal.call(coro, timeout)

    def held(self) -> tuple[int, int, float]:
        """Sessions held: by the replica, by the worker, and the replica's gauge."""
        return (
            len(self.stack.session.registry),
            self.stack.workers[0].fences.live_sessions,
            sample("duplex_session_active_sessions"),
        )

    async def wait_held(self, n: int, within: float = 10.0) -> None:
        try:
            async with asyncio.timeout(within):
                while self.held() != (n, n, float(n)):  # noqa: ASYNC110 (polled state)
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"held (replica, worker, gauge) = {self.held()}, want {n} each") from None

    def close(self) -> None:
        try:
            self.portal.call(self._exits.aclose(), timeout=60)
        finally:
            self.portal.close()


# ---- a fuzzed stream --------------------------------------------------------------------------


@dataclass
class _Session:
    """What the client knows of a session it opened (for resumes and the cancelled-audio check)."""

    session_id: str
    token: str
    epoch: int
    seq: int = 0
    """The last append seq the client sent (restarted at every ``audio_cancelled`` it read)."""
    closed: bool = False
    """Closed for good by a ``closed`` event the client saw (its token is dead)."""


@dataclass
class _Stream:
    conv: Conversation
    name: str
    session: _Session | None = None
    fmt: PcmFormat = PCM16K_MONO
    auto: bool = False
    """Whether the session's server turn detection is on."""
    refused: int = 0
    """Events refused before an open (``session_not_open``)."""
    seen: int = 0
    """Events already looked at by ``observe``."""
    expect_end: bool = False
    """The model knows the call is over, or about to be."""

    @property
    def done(self) -> bool:
        return self.conv._done.is_set()

    @property
    def opened(self) -> bool:
        return self.session is not None


def _deep(levels: int, into: struct_pb2.Struct) -> struct_pb2.Struct:
    cur = into
    for _ in range(levels - 1):
        cur = cur.get_or_create_struct("a")
    cur.update({"a": 1})
    return into


def _fmt(encoding: int, rate: int, channels: int) -> common_pb2.AudioFormat:
    return common_pb2.AudioFormat(encoding=encoding, sample_rate_hz=rate, channels=channels)  # type: ignore[arg-type]


def _bad_open(kind: str) -> tuple[session_pb2.ClientEvent, str]:
    """A bad open and the code its call ends with."""
    ev = open_event()
    cfg = ev.open.config
    code = {
        "nan": ErrorCode.INVALID_RUNTIME_CONFIG,
        "inf": ErrorCode.INVALID_RUNTIME_CONFIG,
        "deep": ErrorCode.INVALID_RUNTIME_CONFIG,
        "unparsable": ErrorCode.INVALID_EVENT,
        "unknown_key": ErrorCode.INVALID_RUNTIME_CONFIG,
        "private_key": ErrorCode.PRIVATE_RUNTIME_KEY,
        "huge_model": ErrorCode.MODEL_MISMATCH,
        "text_modality": ErrorCode.INVALID_CONFIG,
        "no_input_format": ErrorCode.INVALID_CONFIG,
        "odd_rate": ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        "three_channels": ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        "no_encoding": ErrorCode.UNSUPPORTED_AUDIO_FORMAT,
        "long_instructions": ErrorCode.INVALID_CONFIG,
        "silence_range": ErrorCode.INVALID_CONFIG,
    }[kind]
    match kind:
        case "nan":
            ev.open.extra_body.update({"pitch_semitones": math.nan})
        case "inf":
            ev.open.extra_body.update({"silence_ms": [1, -math.inf]})
        case "deep":
            _deep(MAX_EXTRA_BODY_DEPTH + 1, ev.open.extra_body)
        case "unparsable":
            _deep(40, ev.open.extra_body)
        case "unknown_key":
            ev.open.extra_body.update({"k" * 5000: "v" * 5000})
        case "private_key":
            ev.open.extra_body.update({"threshold": 0.1})
        case "huge_model":
            ev.open.model = "\u202e\x00m" * 30_000
        case "text_modality":
            cfg.modalities.append("text")
        case "no_input_format":
            cfg.ClearField("input_format")
        case "odd_rate":
            cfg.input_format.sample_rate_hz = 12345
        case "three_channels":
            cfg.input_format.channels = 3
        case "no_encoding":
            cfg.input_format.encoding = 0  # type: ignore[assignment]
        case "long_instructions":
            cfg.instructions = "\x01" * 20_000
        case "silence_range":
            cfg.turn_detection.silence_ms = 2**32 - 1
    return ev, code


BAD_OPENS = [
    "nan",
    "inf",
    "deep",
    "unparsable",
    "unknown_key",
    "private_key",
    "huge_model",
    "text_modality",
    "no_input_format",
    "odd_rate",
    "three_channels",
    "no_encoding",
    "long_instructions",
    "silence_range",
]

BAD_UPDATES = ["nan", "inf", "deep", "unparsable", "text_modality", "odd_rate", "model", "long", "silence"]
GOOD_UPDATES = ["instructions", "pitch", "format", "turn_manual", "turn_auto", "idle", "empty"]
BAD_APPENDS = [
    "odd",
    "zero",
    "oversized",
    "oversized_message",
    "mismatch",
    "unsupported_encoding",
    "unsupported_shape",
    "nan",
    "inf",
    "repeat_seq",
]


def _audio(kind: str, ms: int, fmt: PcmFormat, rng: np.random.Generator) -> bytes:
    n16 = max(1, 16 * ms)
    if kind == "speech":
        voice = VOICES[int(rng.integers(len(VOICES)))]
        at = int(rng.integers(max(1, len(voice) - n16)))
        x = voice[at : at + n16]
    elif kind == "noise":
        x = (rng.standard_normal(n16) * 0.3).astype(np.float32)
    else:
        x = np.zeros(n16, np.float32)
    pcm = encode(resample(x, 16000, fmt.sample_rate_hz), fmt)
    cut = (MAX_APPEND // fmt.frame_bytes) * fmt.frame_bytes
    return pcm[:cut] or b"\x00" * fmt.frame_bytes


class FuzzMachine(RuleBasedStateMachine):
    """One client at a time drives streams of its own; see the module docstring."""

    world: ClassVar[_World]
    runs: ClassVar[int] = 0
    steps: ClassVar[int] = 0
    seen: ClassVar[Counter[str]] = Counter()
    """Codes and event kinds the machines received (what the run covered)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[_Stream] = []
        self.sessions: list[_Session] = []
        self.cur: _Stream | None = None
        self.n = 0
        self.rng = np.random.default_rng(0)
        self.channel = self.world.call(self._channel())

    async def _channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.world.stack.target)

    # ---- plumbing --------------------------------------------------------------------------

    def _eid(self, what: str) -> str:
        self.n += 1
        return f"{what}{self.n}"

    def _live(self) -> bool:
        # On the model's state only (hypothesis replays a case: a precondition must not depend on
        # timing). A stream that ended unexpectedly is sent to in vain; the invariants say why.
        return self.cur is not None and not self.cur.expect_end

    def _opened(self) -> bool:
        return self._live() and self.cur is not None and self.cur.opened

    def _run(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        FuzzMachine.steps += 1
        self.world.call(fn())

    async def _until(
        self,
        s: _Stream,
        pred: Callable[[session_pb2.ServerEvent], bool],
        within: float = 10,
        start: int = 0,
    ) -> bool:
        """Whether an event matching ``pred`` arrived before the stream ended."""
        try:
            await s.conv.wait_for(pred, within=within, start=start)
        except AssertionError:
            if s.done:
                return False
            raise
        return True

    async def _send(self, s: _Stream, ev: session_pb2.ClientEvent, *, unparsable: bool = False) -> None:
        """Send ``ev`` and wait until the server has handled it (``unparsable``: it cannot be
        parsed, which ends a call that has not opened)."""
        if not ev.event_id:
            ev.event_id = self._eid("e")
        s.conv.send(ev)
        if s.opened:
            await self._sync(s)
        elif unparsable:
            s.expect_end = True
            await s.conv.wait_done()
            assert s.conv.error is not None and s.conv.error.code == ErrorCode.INVALID_EVENT, s.conv.error
        elif ev.WhichOneof("event") in ("open", "resume"):
            await self._until(s, lambda e: e.HasField("opened"))
            self._observe(s)
        else:
            s.refused += 1
            if s.refused > 8:  # the servicer ends a stream that never opens
                s.expect_end = True
                await s.conv.wait_done()
                assert s.conv.error is not None and s.conv.error.code == ErrorCode.SESSION_NOT_OPEN, (
                    s.conv.status,
                    s.conv.error,
                )
            else:
                eid = ev.event_id
                got = await self._until(s, lambda e: e.error.event_id == echoed_event_id(eid))
                assert got, (s.conv.status, s.conv.error)
                last = [e for e in s.conv.events if e.error.event_id == echoed_event_id(eid)][-1]
                assert last.error.code == ErrorCode.SESSION_NOT_OPEN, last

    async def _speak(self, s: _Stream, x: np.ndarray) -> None:
        """Append ``x`` (16 kHz mono float) in 100 ms chunks of the session's format, numbered as
        a client numbers them (a barge-in meanwhile restarts seq)."""
        sess = s.session
        assert sess is not None
        pcm = encode(resample(x, 16000, s.fmt.sample_rate_hz), s.fmt)
        step = s.fmt.bytes_for_ms(100)
        for i in range(0, len(pcm), step):
            self._observe(s)
            sess.seq += 1
            ap = session_pb2.InputAudioAppend(seq=sess.seq, pcm=pcm[i : i + step])
            s.conv.send(session_pb2.ClientEvent(append=ap))
            await asyncio.sleep(0.002)

    async def _sync(self, s: _Stream) -> None:
        """Every event sent so far is handled: an empty event's invalid_event answer is back."""
        eid = self._eid("sync")
        s.conv.send(session_pb2.ClientEvent(event_id=eid))
        await self._until(s, lambda e: e.error.event_id == echoed_event_id(eid))
        self._observe(s)

    def _observe(self, s: _Stream) -> None:
        """Follow the session as a client does: ids, tokens, epochs, seq restarts."""
        for ev in s.conv.events[s.seen :]:
            kind = ev.WhichOneof("event")
            if kind == "opened":
                o = ev.opened
                known = next((x for x in self.sessions if x.session_id == o.session_id), None)
                if known is None:
                    known = _Session(o.session_id, o.resume_token, o.epoch)
                    self.sessions.append(known)
                elif known.epoch != o.epoch:
                    known.seq = 0
                known.token, known.epoch = o.resume_token, o.epoch
                s.session = known
                s.fmt = PcmFormat.from_proto(o.config.input_format)
                s.auto = o.config.turn_detection.auto_respond
            elif s.session is None:
                continue
            elif kind == "audio_cancelled":
                ac = ev.audio_cancelled
                s.session.epoch, s.session.seq = ac.epoch, 0
            elif kind == "updated":
                s.fmt = PcmFormat.from_proto(ev.updated.config.input_format)
                s.auto = ev.updated.config.turn_detection.auto_respond
            elif kind == "go_away":
                s.session.token = ev.go_away.resume_token
            elif kind == "closed":
                s.session.closed = ev.closed.reason not in ("resumed_elsewhere", "draining", "fenced")
        s.seen = len(s.conv.events)

    def _stream(self) -> _Stream:
        assert self.cur is not None
        return self.cur

    # ---- streams ---------------------------------------------------------------------------

    @rule(
        first=st.sampled_from(["open", "open", "open", "nothing"]),
        fmt=st.sampled_from(FORMATS),
        auto=st.booleans(),
    )
    def new_stream(self, first: str, fmt: PcmFormat, auto: bool) -> None:
        """A new Converse call (an earlier one, if any, is left as it is: open, idle, or done),
        mostly opening a session at once."""

        async def go() -> None:
            s = _Stream(Conversation(self.channel).start(), name=f"s{len(self.streams)}")
            self.streams.append(s)
            self.cur = s
            if first == "open":
                ev = open_event(
                    fmt, turn_detection=session_pb2.TurnDetection(auto_respond=auto, barge_in=True)
                )
                await self._send(s, ev)
                assert s.opened, (s.conv.status, s.conv.error)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(fmt=st.sampled_from(FORMATS), auto=st.booleans(), pitch=st.sampled_from([None, -12, 0, 7.5]))
    def open(self, fmt: PcmFormat, auto: bool, pitch: float | None) -> None:
        s = self._stream()
        td = session_pb2.TurnDetection(auto_respond=auto, barge_in=True)
        ev = open_event(
            fmt, turn_detection=td, extra_body={"pitch_semitones": pitch} if pitch is not None else None
        )
        ev.event_id = self._eid("open")
        was_open = s.opened

        async def go() -> None:
            await self._send(s, ev)
            if was_open:
                echo = echoed_event_id(ev.event_id)
                assert [e.error.code for e in s.conv.events if e.error.event_id == echo] == [
                    ErrorCode.ALREADY_OPEN
                ]
            else:
                assert s.opened, (s.conv.status, s.conv.error)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(kind=st.sampled_from(BAD_OPENS))
    def bad_open(self, kind: str) -> None:
        s = self._stream()
        ev, code = _bad_open(kind)
        ev.event_id = self._eid(f"bad_open_{kind}_")

        async def go() -> None:
            if s.opened:
                await self._send(s, ev)
                echo = echoed_event_id(ev.event_id)
                codes = [e.error.code for e in s.conv.events if e.error.event_id == echo]
                # A message that does not parse has no event_id the server could read.
                assert codes == ([] if kind == "unparsable" else [ErrorCode.ALREADY_OPEN]), codes
                return
            s.expect_end = True
            s.conv.send(ev)
            await s.conv.wait_done()
            assert s.conv.status == grpc.StatusCode.INVALID_ARGUMENT, (kind, s.conv.status, s.conv.error)
            assert s.conv.error is not None and s.conv.error.code == code, (kind, s.conv.error)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(which=st.sampled_from(["known", "junk", "swapped", "huge", "empty", "non_ascii"]), data=st.data())
    def resume(self, which: str, data: st.DataObject) -> None:
        s = self._stream()
        known = data.draw(st.sampled_from(self.sessions)) if self.sessions else None
        sid, token = (known.session_id, known.token) if known is not None else ("sess_x", "t")
        if which == "junk":
            token = "A" * 300
        elif which == "swapped":
            if len(self.sessions) > 1:
                other = data.draw(st.sampled_from([x for x in self.sessions if x is not known]))
                token = other.token
            else:
                which = "known"
        elif which == "huge":
            token = "Z" * 9000
        elif which == "empty":
            sid, token = "", ""
        elif which == "non_ascii":
            token = "\u00e9\x00" * 100
        ev = session_pb2.ClientEvent(resume=session_pb2.SessionResume(session_id=sid, resume_token=token))
        was_open = s.opened

        async def go() -> None:
            if was_open:
                await self._send(s, ev)
                return
            s.conv.send(ev)
            opened = await self._until(s, lambda e: e.HasField("opened"))
            if opened:
                self._observe(s)
                assert which == "known" and s.session is known, (which, s.session)
                return
            s.expect_end = True
            err = s.conv.error
            assert err is not None, s.conv.status
            if which != "known" or known is None:
                assert err.code in (ErrorCode.INVALID_RESUME_TOKEN, ErrorCode.UNKNOWN_SESSION), err
            elif known.closed:
                assert err.code == ErrorCode.SESSION_CLOSED, err

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(how=st.sampled_from(["close", "half_close", "drop"]))
    def end_stream(self, how: str) -> None:
        s = self._stream()

        async def go() -> None:
            if how == "close" and not s.opened:  # refused like any event before an open
                await self._send(s, session_pb2.ClientEvent(close=session_pb2.SessionClose()))
                return
            s.expect_end = True
            if how == "close":
                s.conv.send(
                    session_pb2.ClientEvent(event_id=self._eid("close"), close=session_pb2.SessionClose())
                )
            elif how == "half_close":
                s.conv.half_close()
            else:
                s.conv.cancel()
            await s.conv.wait_done()
            self._observe(s)
            if s.opened and how != "drop":
                assert s.conv.kinds()[-1:] == ["closed"], s.conv.kinds()[-3:]

        self._run(go)

    # ---- events of an open session (also sent before an open: refused) ------------------------

    @precondition(lambda self: self._live())
    @rule(kind=st.sampled_from(["silence", "noise", "speech"]), ms=st.sampled_from([20, 32, 100, 500, 1500]))
    def append(self, kind: str, ms: int) -> None:
        s = self._stream()

        async def go() -> None:
            sess = s.session
            seq = (sess.seq + 1) if sess is not None else 1
            ev = session_pb2.ClientEvent(
                append=session_pb2.InputAudioAppend(seq=seq, pcm=_audio(kind, ms, s.fmt, self.rng))
            )
            if sess is not None:
                sess.seq = seq
            await self._send(s, ev)

        self._run(go)

    @precondition(lambda self: self._opened())
    @rule(how=st.sampled_from(["auto", "manual"]), ms=st.sampled_from([300, 800, 1500]))
    def speak(self, how: str, ms: int) -> None:
        """A user turn: speech, then silence (server turn detection) or commit and
        response_create; the reply then streams during the steps that follow."""
        s = self._stream()

        async def go() -> None:
            start = len(s.conv.events)
            voice = VOICES[int(self.rng.integers(len(VOICES)))][: 16 * ms]
            await self._speak(s, np.concatenate([voice, np.zeros(16 * 100, np.float32)]))
            if how == "manual":
                s.conv.send(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
                s.conv.send(session_pb2.ClientEvent(response_create=session_pb2.ResponseCreate()))
            else:  # the model's turn detection (if the session has it on) ends the turn
                await self._speak(s, np.zeros(16 * 700, np.float32))
                if s.auto:
                    with contextlib.suppress(TimeoutError):
                        await self._until(s, lambda e: e.HasField("committed"), within=0.5, start=start)
            # A little more input: the parrot replies one frame per input frame, so the reply
            # has begun; later appends (or the silence the server feeds) carry it on.
            await self._speak(s, np.zeros(16 * 200, np.float32))
            await self._sync(s)

        self._run(go)

    @precondition(lambda self: self._opened())
    @rule(how=st.sampled_from(["barge_in", "response_cancel", "speech"]))
    def interrupt(self, how: str) -> None:
        """Interrupt whatever reply is streaming: by event, or by speaking over it (the
        server's own barge-in, which the client learns of only from ``audio_cancelled``)."""
        s = self._stream()

        async def go() -> None:
            if how == "speech":
                await self._speak(s, VOICES[int(self.rng.integers(len(VOICES)))][: 16 * 400])
                await self._sync(s)
                return
            ev = session_pb2.ClientEvent(event_id=self._eid(how))
            getattr(ev, how).SetInParent()
            await self._send(s, ev)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(kind=st.sampled_from(BAD_APPENDS))
    def bad_append(self, kind: str) -> None:
        s = self._stream()

        async def go() -> None:
            fmt = s.fmt
            sess = s.session
            seq = (sess.seq + 1) if sess is not None else 1
            ap = session_pb2.InputAudioAppend(seq=seq, pcm=b"\x00" * fmt.frame_bytes * 160)
            expect: tuple[str, ...] = ()
            big = False
            if kind == "odd":
                ap.pcm = b"\x01" * (fmt.frame_bytes * 100 + 1)
                expect = (ErrorCode.INVALID_PCM_LENGTH,)
            elif kind == "zero":
                ap.pcm = b""
                expect = (ErrorCode.INVALID_PCM_LENGTH,)
            elif kind.startswith("oversized"):
                big = kind == "oversized_message"
                size = 400 * 1024 if big else (MAX_APPEND // fmt.frame_bytes + 1) * fmt.frame_bytes
                ap.pcm = b"\x00" * size
                expect = (ErrorCode.CHUNK_TOO_LARGE,)
            elif kind == "mismatch":
                other = next(f for f in FORMATS if f != fmt)
                ap.format.CopyFrom(other.to_proto())
                expect = (ErrorCode.AUDIO_FORMAT_MISMATCH,)
            elif kind.startswith("unsupported"):
                ap.format.CopyFrom(_fmt(99, 16000, 1) if kind.endswith("encoding") else _fmt(S16LE, 7, 9))
                expect = (ErrorCode.UNSUPPORTED_AUDIO_FORMAT,)
            elif kind in ("nan", "inf"):
                x = math.nan if kind == "nan" else -math.inf
                n = fmt.frame_bytes * 160 // 4
                ap.pcm = struct.pack(f"<{n}f", *([0.1] * (n - 1) + [x]))
                if fmt.encoding == F32LE:
                    expect = (ErrorCode.INVALID_EVENT,)
                elif sess is not None:
                    sess.seq = seq  # fine bytes for s16: a good append
            elif kind == "repeat_seq":
                ap.seq = max(1, seq - 1)
                if sess is not None and sess.seq >= 1:
                    expect = (ErrorCode.SEQ_OUT_OF_ORDER,)
                elif sess is not None:
                    sess.seq = 1
            ev = session_pb2.ClientEvent(event_id=self._eid(f"bad_{kind}_"), append=ap)
            if big:  # beyond the message limit: gRPC itself ends the call (RESOURCE_EXHAUSTED)
                s.expect_end = True
                s.conv.send(ev)
                await s.conv.wait_done()
                assert s.conv.status == grpc.StatusCode.RESOURCE_EXHAUSTED, (s.conv.status, s.conv.error)
                return
            await self._send(s, ev)
            if s.opened and expect:
                echo = echoed_event_id(ev.event_id)
                codes = [e.error.code for e in s.conv.events if e.error.event_id == echo]
                # A bad append may also be refused for the input being abandoned (an earlier
                # write to the worker failed), never for anything else.
                assert len(codes) == 1 and codes[0] in expect, (kind, codes, expect)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(
        kind=st.sampled_from(
            [
                "commit",
                "clear",
                "response_create",
                "response_create_nan",
                "response_create_pitch",
                "response_cancel",
                "response_cancel_other",
                "barge_in",
                "playback_ack",
                "function_call_output",
                "empty",
                "huge_event_id",
            ]
        )
    )
    def control(self, kind: str) -> None:
        s = self._stream()
        ev = session_pb2.ClientEvent()
        match kind:
            case "commit":
                ev.commit.SetInParent()
            case "clear":
                ev.clear.SetInParent()
            case "response_create":
                ev.response_create.SetInParent()
            case "response_create_nan":
                ev.response_create.extra_body.update({"pitch_semitones": [math.nan]})
            case "response_create_pitch":
                ev.response_create.extra_body.update({"pitch_semitones": -3})
            case "response_cancel":
                ev.response_cancel.SetInParent()
            case "response_cancel_other":
                ev.response_cancel.response_id = "resp_\u00e9" * 1000
            case "barge_in":
                ev.barge_in.SetInParent()
            case "playback_ack":
                ev.playback_ack.response_id = "r" * 10_000
                ev.playback_ack.played_ms = 2**64 - 1
            case "function_call_output":
                ev.function_call_output.call_id = "\x00" * 1000
                ev.function_call_output.output = "{" * 100_000
            case "empty":
                pass
            case "huge_event_id":
                ev.event_id = "\u202e" * 50_000
                ev.commit.SetInParent()

        async def go() -> None:
            await self._send(s, ev)

        self._run(go)

    @precondition(lambda self: self._live())
    @rule(kind=st.sampled_from(GOOD_UPDATES + BAD_UPDATES), fmt=st.sampled_from(FORMATS))
    def update(self, kind: str, fmt: PcmFormat) -> None:
        s = self._stream()
        ev = session_pb2.ClientEvent(event_id=self._eid(f"up_{kind}_"))
        up = ev.update  # built in place: past protobuf's parse depth a copy would fail
        up.SetInParent()
        cfg = up.config
        bad = kind in BAD_UPDATES
        match kind:
            case "instructions":
                cfg.instructions = "be brief \u00e9"
            case "pitch":
                up.extra_body.update({"pitch_semitones": 2})
            case "format":
                cfg.input_format.CopyFrom(fmt.to_proto())
                cfg.output_format.CopyFrom(fmt.to_proto())
            case "turn_manual":
                cfg.turn_detection.CopyFrom(session_pb2.TurnDetection(auto_respond=False, barge_in=False))
            case "turn_auto":
                cfg.turn_detection.CopyFrom(
                    session_pb2.TurnDetection(auto_respond=True, barge_in=True, silence_ms=300)
                )
            case "idle":
                cfg.idle_timeout_s = 2**32 - 1
            case "empty":
                pass
            case "nan":
                up.extra_body.update({"silence_ms": math.nan})
            case "inf":
                up.extra_body.update({"x": {"y": [math.inf]}})
            case "deep":
                _deep(MAX_EXTRA_BODY_DEPTH + 1, up.extra_body)
            case "unparsable":
                _deep(40, up.extra_body)
            case "text_modality":
                cfg.modalities.extend(["audio", "text"])
            case "odd_rate":
                cfg.input_format.CopyFrom(_fmt(F32LE, 96000, 2))
            case "model":
                up.extra_body.update({"model": "other"})
            case "long":
                cfg.instructions = "x" * 300_000
            case "silence":
                cfg.turn_detection.silence_ms = 50

        async def go() -> None:
            await self._send(s, ev, unparsable=kind == "unparsable")
            if s.opened:
                echo = echoed_event_id(ev.event_id)
                answers = [e for e in s.conv.events if e.error.event_id == echo or e.HasField("updated")]
                codes = [e.error.code for e in s.conv.events if e.error.event_id == echo]
                if kind == "unparsable":  # no event_id the server could read
                    assert not codes and s.conv.of("error")[-2].error.code == ErrorCode.INVALID_EVENT
                    return
                if bad:
                    assert len(codes) == 1, (kind, codes)
                elif kind != "instructions":  # instructions may be locked (context_locked)
                    assert not codes, (kind, codes)
                assert answers

        self._run(go)

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def nothing_internal_and_no_cancelled_audio(self) -> None:
        self.world.call(self._check())

    async def _check(self) -> None:
        cancelled: dict[str, int] = {}
        for s in self.streams:
            ctx = (s.name, s.conv.kinds()[-6:])
            assert s.conv.status not in BAD_STATUSES, (ctx, s.conv.status, s.conv.error)
            if s.conv.error is not None:
                assert s.conv.error.code in KNOWN_CODES, (ctx, s.conv.error)
            acks: dict[int, int] = {}
            sid = ""
            for ev in list(s.conv.events):
                kind = ev.WhichOneof("event")
                if kind == "opened":
                    sid = ev.opened.session_id
                elif kind == "error":
                    assert ev.error.code in KNOWN_CODES, (ctx, ev.error)
                elif kind == "audio_cancelled":
                    cancelled[sid] = max(cancelled.get(sid, 0), ev.audio_cancelled.cancelled_epoch)
                elif kind == "audio_delta":
                    assert ev.audio_delta.epoch > cancelled.get(sid, 0), (
                        f"{s.name}: audio of a cancelled epoch: {story(s.conv.events)}"
                    )
                elif kind == "input_ack":
                    a = ev.input_ack
                    assert a.seq >= acks.get(a.epoch, 0), (
                        f"{s.name}: input_ack went backwards: {story(s.conv.events)}"
                    )
                    acks[a.epoch] = a.seq

    def teardown(self) -> None:
        async def go() -> None:
            for s in self.streams:
                if not s.done:
                    s.conv.cancel()
            for s in self.streams:
                await s.conv.wait_done(10)
            await self._check()
            FuzzMachine.runs += 1
            for s in self.streams:
                FuzzMachine.seen.update(e.error.code for e in s.conv.events if e.HasField("error"))
                FuzzMachine.seen.update(f"ev:{k}" for k in s.conv.kinds() if k != "error")
                if s.conv.error is not None:
                    FuzzMachine.seen[f"status:{s.conv.error.code}"] += 1
            # Only the healthy session is left, on the replica and on the worker.
            await self.world.wait_held(1, within=10)
            await self.channel.close()

        self.world.call(go(), timeout=60)


def test_hostile_event_sequences_keep_every_invariant() -> None:
    world = _World()
    try:
        FuzzMachine.world = world
        run_state_machine_as_test(
            FuzzMachine,
            settings=settings(
                max_examples=int(os.environ.get("FUZZ_EXAMPLES", "25")),
                stateful_step_count=30,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        world.call(world.stop_healthy(), timeout=120)
        assert world.healthy.failure is None, repr(world.healthy.failure)
        # What was covered (shown with -s): the event kinds and codes the machines saw.
        print(
            f"\n{FuzzMachine.runs} machines, {FuzzMachine.steps} steps, healthy turns "
            f"{len(world.healthy.turns)}; seen: {dict(sorted(FuzzMachine.seen.items()))}"
        )
        problems, _ = turn_problems(world.healthy.turns, min_turns=3)
        assert not problems, problems
        world.call(world.wait_held(0))
        world.call(_wait(lambda: sample("duplex_worker_active_requests") == 0))
    finally:
        world.close()


async def _wait(pred: Callable[[], bool], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110 (polled state)
            await asyncio.sleep(0.02)
