"""The live fuzz (``make fuzz``): hostile clients against REAL processes, one parrot worker and one
session service on loopback, while a healthy client keeps talking.

    python -m tests.live_fuzz                    # the CI run: 30 s of attacks (about 45 s in all)
    python -m tests.live_fuzz --seconds 600      # longer (``make fuzz FUZZ_SECONDS=600``)
    python -m tests.live_fuzz --attacks worker   # one kind of attack; --keep-logs DIR keeps the logs

The processes start as ``tests/procs.py`` starts them (free ports, stderr captured to files), with
short graces so that everything a client abandons comes back within seconds: the session
service with ``--detached-grace-s 2 --idle-timeout-s 10`` (and ``--max-session-buffer-bytes``
1 MiB, so a client that stops reading is cut off within seconds), the worker with
``--orphan-grace-s 2 --attach-lease-s 2``. They are stopped by pid at the end.

Attacks, each in a loop of its own until the time is up (all at once):

- ``before_open``: 1-9 events (appends, commits, empty events, 100 KB ids) before any open;
- ``bad_open``: unsupported rates, channels and encodings (0, 1, 7999, 2^32-1, ...), NaN and
  infinities in ``extra_body`` (top level, nested, in lists), nesting past the limit and past
  what protobuf parses, huge strings (model, instructions, keys, values, resume tokens, session
  ids), a message past the size limit, forged resumes;
- ``bad_pcm``: sessions in extreme formats (8 kHz to 48 kHz, mono and stereo, s16 and f32) sent
  odd-length, zero-length and oversized chunks, NaN/Inf (and 1e30) in f32, declared formats that
  differ or are unsupported, a repeated seq, a message past the size limit;
- ``bad_events``: in an open session, updates with NaN, deep nesting, 300 KB instructions and
  formats out of range, response_create with NaN, cancels of unknown responses, huge
  playback_ack and function_call_output, empty events and 200 KB event ids, second opens;
- ``rapid``: open then close at once, open then drop before the answer, open then half-close;
- ``resumes``: a live session resumed by three streams at once, then dropped and resumed within
  the grace, then closed and resumed (``session_closed``);
- ``idle``: a session left open and silent on a live stream until the idle timeout closes it;
- ``lanes``: ConverseMany calls whose messages mix unusable lane names, events for lanes never
  opened, bad opens (from ``bad_open``) beside good ones, and junk in the open lanes; then a
  half-close (every lane must close) or a cancel;
- ``abandoned``: streams that open and are dropped without close (``--abandoned``: 1000 per
  30 s, paced over the run), and streams dropped before they send anything;
- ``never_reading``: sessions whose client never reads what comes back (a reply upsampled to
  f32 stereo, or ``updated`` answers carrying 4 KB instructions) and then drops the stream;
- ``worker``: direct calls to the worker: Describe, Attach with empty, over-long and odd ids,
  epochs 0 and 2^64-1, a takeover at 2^64-1, stale epochs, another owner; Run streams without
  an owner, with an over-long one, with an owner that changes, with junk submissions (unknown
  kinds, over-long ids, NaN, nested and too deep params, odd-length PCM, seq and epoch
  2^64-1) and releases of sessions that do not exist; sessions attached and left (the lease and
  the orphan grace release them); an owner that never reads its Run stream, then drops it.

Invariants, checked at the end (the exit status is 1 and the reasons are printed if any fails):

1. no traceback in either server's stderr;
2. no call ends with INTERNAL or UNKNOWN, every refusal (call status or ``error`` event, worker
   ``WorkerError`` included) carries a known stable code (a status without one only for gRPC's
   own size and call limits: RESOURCE_EXHAUSTED), and the session service counted no
   ``internal`` error;
3. the healthy client's session completed at least one turn per 10 s of the run, every turn
   correct: completed, the reply as long as the committed utterance, the content (of up to
   eight turns) the parrot's reply to what the worker heard, compared as
   ``tests/test_session_stack.py`` does;
4. every gauge (``duplex_session_active_sessions``, ``duplex_session_worker_sessions``,
   ``duplex_worker_active_requests``) is back to 0 within the graces once the attacks stop and
   the healthy session closes;
5. the RSS of both processes is back near its baseline (measured once the healthy session has
   had its first turn, before any attack): at most ``RSS_SLACK_MIB`` (48 MiB) above it. Freed
   memory is not all returned to the system (CPython's arenas, glibc's heap and gRPC's buffers
   keep their high-water mark), so "near" is a bound, not equality: on the 2-core development
   machine the session service kept 15-26 MiB and the worker 12-18 MiB after 30 s and after
   120 s of load alike (a leak grows with the run). A leak of 50 KiB per abandoned stream (1000
   in CI) would exceed the bound; the peak is printed beside it for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import struct
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import struct_pb2

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat, encode, resample
from duplex.errors import from_rpc_error
from duplex.v1 import common_pb2, session_pb2, session_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.fuzz_helpers import BAD_STATUSES, KNOWN_CODES, VOICES, WORKER_CODES, HealthyTalker, turn_problems
from tests.procs import ServiceProcess, start_service
from tests.session_helpers import (
    metric_sum,
    metric_value,
    metrics_text,
    session_args,
    wait_metric,
    worker_args,
)

#: How far above its baseline a process's RSS may stay after the load (see the module docstring).
RSS_SLACK_MIB = 48
DETACHED_GRACE_S = 2.0
IDLE_TIMEOUT_S = 10.0
ORPHAN_GRACE_S = 2.0
ATTACH_LEASE_S = 2.0
#: How long the gauges may take to come back once the attacks stop: the graces plus room.
SETTLE_S = DETACHED_GRACE_S + ORPHAN_GRACE_S + ATTACH_LEASE_S + 15.0
MAX_APPEND = 256 * 1024

EXTREME_FORMATS = [
    PcmFormat(S16LE, 8000, 1),
    PcmFormat(F32LE, 48000, 2),
    PcmFormat(S16LE, 11025, 2),
    PcmFormat(F32LE, 44100, 1),
    PcmFormat(F32LE, 8000, 2),
    PcmFormat(S16LE, 48000, 2),
]


def ev(event_id: str = "", **kw: Any) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(event_id=event_id, **kw)


def fmt_proto(encoding: int, rate: int, channels: int) -> common_pb2.AudioFormat:
    return common_pb2.AudioFormat(encoding=encoding, sample_rate_hz=rate, channels=channels)  # type: ignore[arg-type]


def open_ev(
    fmt: PcmFormat | common_pb2.AudioFormat = PCM16K_MONO,
    *,
    out: PcmFormat | None = None,
    auto: bool = True,
    extra: dict[str, Any] | None = None,
) -> session_pb2.ClientEvent:
    cfg = session_pb2.SessionConfig(
        input_format=fmt.to_proto() if isinstance(fmt, PcmFormat) else fmt,
        turn_detection=session_pb2.TurnDetection(auto_respond=auto, barge_in=True),
    )
    if out is not None:
        cfg.output_format.CopyFrom(out.to_proto())
    e = ev("open", open=session_pb2.SessionOpen(model="parrot", config=cfg))
    if extra is not None:
        e.open.extra_body.update(extra)
    return e


def deep(levels: int, into: struct_pb2.Struct) -> None:
    """``into`` becomes ``{"a": {"a": ... 1}}``, ``levels`` deep (built in place: past protobuf's
    parse depth a copy would fail)."""
    cur = into
    for _ in range(levels - 1):
        cur = cur.get_or_create_struct("a")
    cur.update({"a": 1})


def pcm_of(x: np.ndarray, fmt: PcmFormat) -> bytes:
    return encode(resample(x, 16000, fmt.sample_rate_hz), fmt)


def f32_with(value: float, n: int = 320) -> bytes:
    return struct.pack(f"<{n}f", *([0.1] * (n - 1) + [value]))


def has_error_info(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call carries the server's rich status (a duplex ``ErrorInfo``)."""
    return any(key == "grpc-status-details-bin" for key, _ in exc.trailing_metadata() or ())


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@dataclass
class Outcome:
    """What one call came to: its events and how it ended."""

    events: list[session_pb2.ServerEvent] = field(default_factory=list)
    status: grpc.StatusCode | None = None
    code: str = ""


class Fuzz:
    def __init__(self, session: ServiceProcess, worker: ServiceProcess, args: argparse.Namespace) -> None:
        self.session = session
        self.worker = worker
        self.args = args
        self.seconds: float = args.seconds
        self.attacks: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        self.problems: list[str] = []
        self.rss: dict[str, dict[str, int]] = {"session": {}, "worker": {}}
        self.gauges: dict[str, float] = {}
        self.slow_consumers = 0.0
        self.healthy: HealthyTalker | None = None
        self.turns_during = 0
        self.worst_score = 0.0
        self.settle_s = 0.0
        self._deadline = 0.0
        self._rng = np.random.default_rng(args.seed)

    # ---- bookkeeping -------------------------------------------------------------------------

    def problem(self, what: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(what)

    def note_status(self, where: str, exc: grpc.aio.AioRpcError) -> str:
        """Record how a call ended; a status that is a bug, or carries no stable code where one
        is owed, is a problem. Returns the code ("" for gRPC's own refusals)."""
        code = exc.code()
        if code == grpc.StatusCode.CANCELLED:
            return ""  # our own cancel
        if not has_error_info(exc):
            # Only gRPC's own limits refuse without a duplex code: a message past the size
            # limit (RESOURCE_EXHAUSTED, documented).
            self.seen[f"{where} {code.name} (gRPC, no ErrorInfo)"] += 1
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.problem(
                    f"{where}: the call ended with {code.name} and no stable code: {exc.details()!r}"
                )
            return ""
        err = from_rpc_error(exc)
        self.note_end(where, "the call", code, err.code, exc.details() or "")
        return err.code

    def note_end(self, where: str, what: str, status: grpc.StatusCode, code: str, message: str) -> None:
        """Record how ``what`` (a call, a lane) ended with a duplex ``code``: a status that is a
        bug, or a code not in the contract, is a problem."""
        self.seen[f"{where} {status.name}/{code}"] += 1
        if status in BAD_STATUSES:
            self.problem(f"{where}: {what} ended with {status.name}: {message!r}")
        elif status != grpc.StatusCode.OK and code not in KNOWN_CODES:
            self.problem(f"{where}: {what} ended with {status.name} and unknown code {code!r}")

    def note_events(self, where: str, events: list[session_pb2.ServerEvent]) -> None:
        for e in events:
            if e.HasField("error"):
                self.seen[f"{where} error {e.error.code}"] += 1
                if e.error.code not in KNOWN_CODES:
                    self.problem(f"{where}: error event with code {e.error.code!r}: {e.error.message!r}")

    def running(self) -> bool:
        return time.monotonic() < self._deadline

    # ---- one call to the session service ----------------------------------------------------

    async def converse(
        self,
        channel: grpc.aio.Channel,
        events: list[session_pb2.ClientEvent],
        where: str,
        *,
        close: bool = True,
        half_close: bool = True,
        deadline_s: float = 20.0,
    ) -> Outcome:
        """Write ``events`` (then ``close``, then half-close unless not ``half_close``), read the
        call to its end."""
        out = Outcome()
        call = session_pb2_grpc.DuplexSessionStub(channel).Converse(timeout=deadline_s)

        async def write() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                for e in events:
                    await call.write(e)
                if close:
                    await call.write(ev("bye", close=session_pb2.SessionClose()))
                if half_close:
                    await call.done_writing()

        writer = asyncio.create_task(write())
        try:
            async for e in call:
                out.events.append(e)
        except grpc.aio.AioRpcError as exc:
            out.status = exc.code()
            out.code = self.note_status(where, exc)
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        self.note_events(where, out.events)
        return out

    # ---- attacks -----------------------------------------------------------------------------

    async def before_open(self, ch: grpc.aio.Channel) -> None:
        n = int(self._rng.integers(1, 10))
        junk = [
            ev("a", append=session_pb2.InputAudioAppend(seq=1, pcm=b"\x00\x01" * 320)),
            ev("c", commit=session_pb2.InputAudioCommit()),
            ev(""),
            ev("x" * 100_000, barge_in=session_pb2.BargeIn()),
            ev("u", update=session_pb2.SessionUpdate()),
            ev("p", playback_ack=session_pb2.PlaybackAck(played_ms=2**64 - 1)),
        ]
        events = [junk[i % len(junk)] for i in range(n)]
        opens = n < 9 and bool(self._rng.integers(2))
        out = await self.converse(ch, [*events, open_ev()] if opens else events, "before_open", close=opens)
        refused = [e for e in out.events if e.error.code == "session_not_open"]
        if n > 8 and out.code != "session_not_open":
            self.problem(f"before_open: {n} events before an open ended with {out.status} {out.code!r}")
        elif n <= 8 and len(refused) != n:
            self.problem(f"before_open: {len(refused)} session_not_open for {n} events")
        self.attacks["before_open"] += 1

    def bad_opens(self) -> list[tuple[str, session_pb2.ClientEvent]]:
        out: list[tuple[str, session_pb2.ClientEvent]] = []
        for enc, rate, chans in [
            (S16LE, 0, 1),
            (S16LE, 1, 1),
            (S16LE, 7999, 1),
            (F32LE, 48001, 2),
            (F32LE, 2**32 - 1, 2),
            (S16LE, 16000, 0),
            (S16LE, 16000, 3),
            (F32LE, 16000, 2**32 - 1),
            (99, 16000, 1),
            (0, 16000, 1),
        ]:
            out.append((f"format {enc}/{rate}/{chans}", open_ev(fmt_proto(enc, rate, chans))))
        for name, extra in [
            ("nan", {"pitch_semitones": math.nan}),
            ("inf", {"silence_ms": math.inf}),
            ("-inf in a list", {"x": [1, [2, -math.inf]]}),
            ("nan nested", {"o": {"p": {"q": math.nan}}}),
            ("huge key", {"k" * 15_000: 1}),
            ("huge value", {"pitch_semitones": "v" * 200_000}),
            ("private", {"_worker_params": {"a": 1}}),
            ("model", {"model": ["parrot"] * 1000}),
        ]:
            out.append((f"extra_body {name}", open_ev(extra=extra)))
        for levels in (17, 40, 60):
            e = open_ev()
            deep(levels, e.open.extra_body)
            out.append((f"extra_body {levels} deep", e))
        huge = open_ev()
        huge.open.model = "m" * 200_000
        out.append(("model 200 KB", huge))
        instr = open_ev()
        instr.open.config.instructions = "\x00\u202e" * 100_000
        out.append(("instructions 300 KB", instr))
        past = open_ev()
        past.open.config.instructions = "i" * 400_000
        out.append(("message past the limit", past))
        modal = open_ev()
        modal.open.config.modalities.extend(["audio"] * 10_000)
        out.append(("modalities", modal))
        for name, sid, token in [
            ("junk token", "sess_x", "A" * 300),
            ("huge token", "sess_x", "Z" * 300_000),
            ("non-ascii token", "sess_x", "\u00e9\x00" * 1000),
            ("huge session id", "s" * 300_000, "t"),
            ("empty", "", ""),
        ]:
            out.append(
                (f"resume {name}", ev(resume=session_pb2.SessionResume(session_id=sid, resume_token=token)))
            )
        return out

    async def lanes(self, ch: grpc.aio.Channel) -> None:
        """One ConverseMany call mixing good and bad lanes in every message: unusable lane names,
        events for lanes never opened, bad opens beside good ones, junk in open lanes, a lane
        name reused; then a half-close (every lane closes) or a cancel (every lane is left for
        a resume). Every bad open must end its lane with a stable code, every good one open."""
        bad = self.bad_opens()
        good = [f"g{i}" for i in range(int(self._rng.integers(1, 4)))]
        batches: list[list[tuple[str, session_pb2.ClientEvent]]] = [
            [(name, open_ev()) for name in good]
            + [
                ("", open_ev()),
                ("n\n", open_ev()),
                ("x" * 65, open_ev()),
                ("never", ev("c", commit=session_pb2.InputAudioCommit())),
            ]
        ]
        bad_lanes = {}
        for i in self._rng.choice(len(bad), size=3, replace=False):
            name, e = bad[int(i)]
            if e.ByteSize() > 200_000 or "deep" in name:
                continue  # one message of them all must stay under the receive limit and parse
            bad_lanes[f"b{i}"] = name
            batches[0].append((f"b{i}", e))
        for name in good:
            batches.append(
                [
                    (name, ev("a", append=session_pb2.InputAudioAppend(seq=1, pcm=b"\x00\x01" * 320))),
                    (name, ev("")),
                    (name, ev("o", open=session_pb2.SessionOpen())),
                    (name, ev("s", append=session_pb2.InputAudioAppend(seq=1, pcm=b"\x00" * 3))),
                ]
            )
        cancel = bool(self._rng.integers(2))
        call = session_pb2_grpc.DuplexSessionStub(ch).ConverseMany(timeout=20)
        events: dict[str, list[session_pb2.ServerEvent]] = {}
        ended: dict[str, session_pb2.LaneEnded] = {}

        async def write() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                for b in batches:
                    batch = session_pb2.ClientBatch()
                    for lane, e in b:
                        batch.events.add(lane=lane, event=e)
                    await call.write(batch)
                await asyncio.sleep(0.3)
                if cancel:
                    call.cancel()
                else:
                    await call.done_writing()

        writer = asyncio.create_task(write())
        try:
            async for batch in call:
                for out in batch.outputs:
                    if out.HasField("ended"):
                        ended[out.lane] = out.ended
                    else:
                        events.setdefault(out.lane, []).append(out.event)
        except grpc.aio.AioRpcError as exc:
            self.note_status("lanes", exc)
        except asyncio.CancelledError:
            if not (cancel and call.cancelled()):
                raise  # a cancel of our own ends the reading so; anything else stops the attack
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        for evs in events.values():
            self.note_events("lanes", evs)
        for lane, end in ended.items():
            status = next(c for c in grpc.StatusCode if c.value[0] == end.status)
            self.note_end("lanes", f"lane {lane!r}", status, end.code, end.message)
        for lane, name in bad_lanes.items():
            if any(e.HasField("opened") for e in events.get(lane, [])):
                self.problem(f"lanes: bad open {name} opened")
        for lane in good:
            if not any(e.HasField("opened") for e in events.get(lane, [])) and not cancel:
                self.problem(f"lanes: good lane {lane} did not open ({ended.get(lane)})")
        self.attacks["lanes"] += 1

    async def bad_open(self, ch: grpc.aio.Channel) -> None:
        for name, e in self.bad_opens():
            if not self.running():
                return
            out = await self.converse(ch, [e], "bad_open", close=False)
            if out.status is None or any(x.HasField("opened") for x in out.events):
                kinds = [x.WhichOneof("event") for x in out.events]
                self.problem(f"bad_open {name}: not refused ({out.status}, {kinds})")
            self.attacks["bad_open"] += 1

    async def bad_pcm(self, ch: grpc.aio.Channel) -> None:
        fmt = EXTREME_FORMATS[int(self._rng.integers(len(EXTREME_FORMATS)))]
        fb = fmt.frame_bytes
        good = pcm_of(VOICES[0][:3200], fmt)
        other = next(f for f in EXTREME_FORMATS if f != fmt)
        appends: list[tuple[bytes, common_pb2.AudioFormat | None]] = [
            (good, None),
            (b"\x01" * (fb * 100 + 1), None),  # odd length
            (b"", None),  # zero length
            (b"\x00" * ((MAX_APPEND // fb + 1) * fb), None),  # chunk_too_large
            (good, other.to_proto()),  # a declared format that is not the session's
            (good, fmt_proto(99, 16000, 1)),
            (good, fmt_proto(S16LE, 0, 0)),
            (good, fmt_proto(F32LE, 2**32 - 1, 2**32 - 1)),
            (f32_with(math.nan, fb * 40 // 4), None),
            (f32_with(math.inf, fb * 40 // 4), None),
            (f32_with(-math.inf, fb * 40 // 4), None),
            (f32_with(1e30, fb * 40 // 4), None),  # finite, out of range: clipped
            (good, None),
        ]
        events = [open_ev(fmt, out=other)]
        seq = 0
        for i, (pcm, declared) in enumerate(appends):
            seq += 1
            ap = session_pb2.InputAudioAppend(seq=seq, pcm=pcm)
            if declared is not None:
                ap.format.CopyFrom(declared)
            events.append(ev(f"b{i}", append=ap))
        events.append(ev("dup", append=session_pb2.InputAudioAppend(seq=1, pcm=good)))  # seq_out_of_order
        events.append(ev("commit", commit=session_pb2.InputAudioCommit()))
        out = await self.converse(ch, events, "bad_pcm")
        if out.status is not None or not out.events or out.events[-1].WhichOneof("event") != "closed":
            self.problem(f"bad_pcm {fmt}: the session did not go on to its close ({out.status} {out.code})")
        # Past the message limit: gRPC ends the call (RESOURCE_EXHAUSTED) before any handler sees it.
        big = ev("big", append=session_pb2.InputAudioAppend(seq=1, pcm=b"\x00" * 400 * 1024))
        out = await self.converse(ch, [open_ev(fmt), big], "bad_pcm", close=False)
        if out.status != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.problem(f"bad_pcm: a 400 KiB message ended with {out.status} {out.code!r}")
        self.attacks["bad_pcm"] += 2

    async def bad_events(self, ch: grpc.aio.Channel) -> None:
        def update(**kw: Any) -> session_pb2.ClientEvent:
            return ev("up", update=session_pb2.SessionUpdate(**kw))

        events = [open_ev(PCM16K_MONO)]
        for extra in (
            {"silence_ms": math.nan},
            {"pitch_semitones": [math.inf]},
            {"model": "other"},
            {"x": None},
        ):
            u = update()
            u.update.extra_body.update(extra)
            events.append(u)
        d = update()
        deep(20, d.update.extra_body)
        events.append(d)
        d = update()
        deep(45, d.update.extra_body)  # past protobuf's parse depth: unreadable, the session goes on
        events.append(d)
        events += [
            update(config=session_pb2.SessionConfig(instructions="x" * 300_000)),
            update(config=session_pb2.SessionConfig(modalities=["text"])),
            update(config=session_pb2.SessionConfig(input_format=fmt_proto(F32LE, 96000, 2))),
            update(config=session_pb2.SessionConfig(output_format=fmt_proto(S16LE, 2**32 - 1, 1))),
            update(
                config=session_pb2.SessionConfig(
                    turn_detection=session_pb2.TurnDetection(silence_ms=2**32 - 1)
                )
            ),
            update(config=session_pb2.SessionConfig(idle_timeout_s=2**32 - 1)),
            ev("rc", response_create=session_pb2.ResponseCreate()),
            ev("cancel", response_cancel=session_pb2.ResponseCancel(response_id="r" * 100_000)),
            ev("barge", barge_in=session_pb2.BargeIn()),
            ev(
                "ack", playback_ack=session_pb2.PlaybackAck(response_id="\x00" * 100_000, played_ms=2**64 - 1)
            ),
            ev(
                "fco",
                function_call_output=session_pb2.FunctionCallOutput(call_id="c" * 1000, output="{" * 300_000),
            ),
            ev(""),
            ev("e" * 200_000),
            ev("clear", clear=session_pb2.InputAudioClear()),
            ev("commit", commit=session_pb2.InputAudioCommit()),
            open_ev(),
            ev(resume=session_pb2.SessionResume(session_id="x", resume_token="y")),
        ]
        nan_rc = ev("rcnan", response_create=session_pb2.ResponseCreate())
        nan_rc.response_create.extra_body.update({"pitch_semitones": math.nan})
        events.append(nan_rc)
        out = await self.converse(ch, events, "bad_events")
        if out.status is not None or not out.events or out.events[-1].WhichOneof("event") != "closed":
            self.problem(f"bad_events: the session did not go on to its close ({out.status} {out.code})")
        self.attacks["bad_events"] += 1

    async def resumes(self, ch: grpc.aio.Channel) -> None:
        """A session resumed while its stream is live, by several streams at once, after its
        stream was dropped, and after it was closed (``session_closed``)."""
        stub = session_pb2_grpc.DuplexSessionStub(ch)
        first = stub.Converse(timeout=20)
        try:
            await first.write(open_ev())
            opened = await first.read()
            if opened is grpc.aio.EOF or not opened.HasField("opened"):
                self.problem(f"resumes: the open was answered with {opened}")
                return
            o = opened.opened
            resume = ev(
                resume=session_pb2.SessionResume(session_id=o.session_id, resume_token=o.resume_token)
            )
            calls = [stub.Converse(timeout=20) for _ in range(3)]  # at once: one wins, in turn
            for c in calls:
                await c.write(resume)
            outcomes = []
            for c in calls:
                try:
                    outcomes.append(await c.read())
                except grpc.aio.AioRpcError as exc:
                    self.note_status("resumes", exc)
            if not any(x is not grpc.aio.EOF and x.HasField("opened") for x in outcomes):
                self.problem(f"resumes: no resume of a live session was opened: {outcomes}")
            for c in calls:
                c.cancel()  # dropped: the session waits the detached grace
            first.cancel()
            again = await self.converse(ch, [resume], "resumes", close=True)
            if again.status is not None:
                self.problem(f"resumes: a resume within the grace ended with {again.status} {again.code}")
            # Closed by that close: its token is dead.
            dead = await self.converse(ch, [resume], "resumes", close=False)
            if dead.code != "session_closed":
                self.problem(f"resumes: a resume of a closed session ended with {dead.status} {dead.code!r}")
        except grpc.aio.AioRpcError as exc:
            self.note_status("resumes", exc)
        finally:
            first.cancel()
        self.attacks["resumes"] += 1

    async def idle(self, ch: grpc.aio.Channel) -> None:
        """A session opened and left idle on a live stream: the idle timeout (10 s) closes it."""
        if self._deadline - time.monotonic() < IDLE_TIMEOUT_S + 3:
            await asyncio.sleep(1)
            return
        out = await self.converse(ch, [open_ev()], "idle", close=False, half_close=False)
        reasons = [e.closed.reason for e in out.events if e.HasField("closed")]
        if out.status is not None or reasons != ["idle_timeout"]:
            self.problem(f"idle: an idle session ended with {out.status} {out.code!r}, closed {reasons}")
        self.attacks["idle"] += 1

    async def rapid(self, ch: grpc.aio.Channel) -> None:
        stub = session_pb2_grpc.DuplexSessionStub(ch)
        how = ("close", "drop", "half_close")[int(self._rng.integers(3))]
        call = stub.Converse(timeout=20)
        try:
            await call.write(open_ev())
            if how == "close":
                await call.write(ev(close=session_pb2.SessionClose()))
                await call.done_writing()
            elif how == "half_close":
                await call.done_writing()
            else:
                call.cancel()
                self.attacks["rapid"] += 1
                return
            events = [e async for e in call]
            self.note_events("rapid", events)
        except grpc.aio.AioRpcError as exc:
            self.note_status("rapid", exc)
        self.attacks["rapid"] += 1

    async def abandon_one(self, ch: grpc.aio.Channel, opens: bool) -> None:
        call = session_pb2_grpc.DuplexSessionStub(ch).Converse(timeout=20)
        try:
            if opens:
                await call.write(open_ev())
                first = await call.read()
                if first is not grpc.aio.EOF:
                    self.note_events("abandoned", [first])
            else:
                await call.wait_for_connection()
        except grpc.aio.AioRpcError as exc:
            self.note_status("abandoned", exc)
        finally:
            call.cancel()
        self.attacks["abandoned" if opens else "abandoned_unopened"] += 1

    async def abandoned(self) -> None:
        """``--abandoned`` streams dropped without close, paced over the run, in batches."""
        total, batch = self.args.abandoned, 25
        gap = max(0.05, self.seconds * 0.8 / max(1, total / batch))
        async with grpc.aio.insecure_channel(self.session.grpc) as ch:
            done = 0
            while done < total and self.running():
                n = min(batch, total - done)
                await asyncio.gather(*(self.abandon_one(ch, opens=i % 5 != 0) for i in range(n)))
                done += n
                await asyncio.sleep(gap)

    async def never_reading(self) -> None:
        """Sessions that never read what comes back: a reply (upsampled to f32 stereo, 12 times
        the model's bytes), or ``updated`` answers that carry 4 KB instructions back. Their
        client transport takes no more than its 64 KiB window (a gRPC client otherwise grows the
        window with its bandwidth-delay estimate and buffers megabytes itself): the rest piles up
        on the server until the session is cut off (``slow_consumer``) or the client drops the
        stream."""
        echo = bool(self._rng.integers(2))
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(self.session.grpc, options=options) as ch:
            call = session_pb2_grpc.DuplexSessionStub(ch).Converse(timeout=30)
            out = PcmFormat(F32LE, 48000, 2)
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                async with asyncio.timeout(8):
                    await call.write(open_ev(PCM16K_MONO, out=out, extra={"silence_ms": 2000}))
                    if echo:
                        # Each update is answered with ``updated``, its 4 KB instructions in it
                        # (an error echoes at most 256 characters of an event id): 600 KB.
                        big = session_pb2.SessionConfig(instructions="x" * 4000)
                        for _ in range(150):
                            await call.write(ev(update=session_pb2.SessionUpdate(config=big)))
                    else:
                        # A long utterance (its pauses do not end the turn), then silence to
                        # step its reply out.
                        voice = np.concatenate(VOICES[:6])[: 16000 * 12]
                        pcm = pcm_of(np.concatenate([voice, np.zeros(16000 * 15, np.float32)]), PCM16K_MONO)
                        step = PCM16K_MONO.bytes_for_ms(100)
                        for seq, i in enumerate(range(0, len(pcm), step), start=1):
                            ap = session_pb2.InputAudioAppend(seq=seq, pcm=pcm[i : i + step])
                            await call.write(ev(append=ap))
                            await asyncio.sleep(0.005)
                    await asyncio.sleep(4)
            call.cancel()
        self.attacks["never_reading_echo" if echo else "never_reading_reply"] += 1

    async def worker_calls(self) -> None:
        async with grpc.aio.insecure_channel(self.worker.grpc) as ch:
            stub = worker_pb2_grpc.DuplexWorkerStub(ch)
            await self._unary(stub.Describe(worker_pb2.DescribeRequest(), timeout=5), "worker Describe")
            tag = uuid.uuid4().hex[:8]
            owner = f"fuzz-owner-{tag}"
            sid = f"fuzz-{tag}"
            for name, req in [
                ("empty ids", worker_pb2.AttachRequest()),
                ("empty owner", worker_pb2.AttachRequest(session_id=sid)),
                ("long id", worker_pb2.AttachRequest(session_id="s" * 129, owner=owner, epoch=1)),
                ("huge owner", worker_pb2.AttachRequest(session_id=sid + "h", owner="o" * 100_000, epoch=1)),
                ("odd owner", worker_pb2.AttachRequest(session_id=sid + "o", owner="a/b\x00\n", epoch=1)),
                ("epoch 0", worker_pb2.AttachRequest(session_id=sid + "z", owner=owner, epoch=0)),
                ("epoch max", worker_pb2.AttachRequest(session_id=sid + "m", owner=owner, epoch=2**64 - 1)),
                (
                    "takeover max",
                    worker_pb2.AttachRequest(
                        session_id=sid + "m", owner=owner + "x", epoch=2**64 - 1, takeover=True
                    ),
                ),
                ("attach", worker_pb2.AttachRequest(session_id=sid, owner=owner, epoch=5)),
                ("stale", worker_pb2.AttachRequest(session_id=sid, owner=owner, epoch=4)),
                ("other owner", worker_pb2.AttachRequest(session_id=sid, owner=owner + "y", epoch=5)),
                ("left", worker_pb2.AttachRequest(session_id=sid + "left", owner=owner + "-gone", epoch=1)),
            ]:
                await self._unary(stub.Attach(req, timeout=5), f"worker Attach ({name})")
            # Run streams: no owner, an over-long owner, an owner that changes.
            for name, cmds in [
                ("no owner", [worker_pb2.WorkerCommand()]),
                ("huge owner", [worker_pb2.WorkerCommand(owner="o" * 100_000)]),
                (
                    "owner changes",
                    [worker_pb2.WorkerCommand(owner=owner + "c"), worker_pb2.WorkerCommand(owner="other")],
                ),
            ]:
                await self._run_stream(stub, cmds, f"worker Run ({name})", wait=1.0)
            await self._run_stream(stub, self._junk_commands(owner, sid), "worker Run (junk)", wait=1.5)
            # APPENDs in columns: bad entries (each refused alone), then columns that do not line
            # up (each ends its stream).
            for name, cols in self._junk_columns(sid):
                cmds = [worker_pb2.WorkerCommand(owner=owner), worker_pb2.WorkerCommand(appends=cols)]
                await self._run_stream(stub, cmds, f"worker Run (columns: {name})", wait=1.0)
        await self.worker_never_reading(tag)
        self.attacks["worker"] += 1

    async def worker_never_reading(self, tag: str) -> None:
        """An owner whose Run stream gets steps for its sessions and never reads them (its
        transport's window stays at 64 KiB), then drops the stream."""
        owner, sid = f"fuzz-deaf-{tag}", f"fuzz-deaf-{tag}"
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(self.worker.grpc, options=options) as ch:
            stub = worker_pb2_grpc.DuplexWorkerStub(ch)
            await self._unary(
                stub.Attach(worker_pb2.AttachRequest(session_id=sid, owner=owner, epoch=1)),
                "worker Attach (deaf)",
            )
            # Noise (speech to the VAD), COMMIT and RESPOND, then silence that steps about 300 KB
            # of reply out.
            fence = common_pb2.Fence(session_id=sid, epoch=1)
            reply = common_pb2.Fence(session_id=sid, epoch=1, turn_id=1)
            kind = worker_pb2.SubmissionKind

            def appends(x: np.ndarray, first: int) -> list[worker_pb2.Submission]:
                pcm = pcm_of(x, PCM16K_MONO)
                pcm = pcm[: len(pcm) // 8192 * 8192]  # whole frames, 8 a submission
                return [
                    worker_pb2.Submission(
                        request_id=sid,
                        fence=reply if first > 1 else fence,
                        kind=kind.SUBMISSION_KIND_APPEND,
                        seq=first + i,
                        pcm=pcm[i * 8192 : (i + 1) * 8192],
                    )
                    for i in range(len(pcm) // 8192)
                ]

            subs = appends((self._rng.standard_normal(16000 * 2) * 0.3).astype(np.float32), 1)
            subs += [
                worker_pb2.Submission(request_id=sid, fence=fence, kind=kind.SUBMISSION_KIND_COMMIT),
                worker_pb2.Submission(request_id=sid, fence=reply, kind=kind.SUBMISSION_KIND_RESPOND),
            ]
            subs += appends(np.zeros(16000 * 10, np.float32), len(subs) + 1)

            async def commands() -> AsyncIterator[worker_pb2.WorkerCommand]:
                yield worker_pb2.WorkerCommand(owner=owner, submit=subs)
                await asyncio.sleep(30)

            call = stub.Run(commands(), timeout=30)
            await asyncio.sleep(2.0)  # the worker steps the session and writes to nobody
            call.cancel()
        self.attacks["worker_never_reading"] += 1

    def _junk_commands(self, owner: str, sid: str) -> list[worker_pb2.WorkerCommand]:
        def sub(rid: str, session: str, kind: int, **kw: Any) -> worker_pb2.Submission:
            epoch = kw.pop("epoch", 5)
            return worker_pb2.Submission(
                request_id=rid,
                fence=common_pb2.Fence(session_id=session, epoch=epoch),
                kind=kind,
                **kw,  # type: ignore[arg-type]
            )

        append = worker_pb2.SUBMISSION_KIND_APPEND
        frame = pcm_of(VOICES[1][:512], PCM16K_MONO)
        nan_params = sub("r", sid, append, seq=1, pcm=frame)
        nan_params.params.update({"silence_ms": math.nan})
        nested = sub("r", sid, append, seq=1, pcm=frame)
        nested.params.update({"silence_ms": {"a": [1, {"b": None}]}, "pitch_semitones": "high"})
        deep_params = sub("r", sid, append, seq=1, pcm=frame)
        deep(25, deep_params.params)
        cmds = [
            # Real work first (the session holds model state until the orphan grace frees it).
            worker_pb2.WorkerCommand(owner=owner, submit=[sub("r", sid, append, seq=1, pcm=frame * 3)]),
            worker_pb2.WorkerCommand(
                submit=[
                    sub("r", sid, 99),
                    sub("", sid, append, seq=1, pcm=frame),
                    sub("r" * 200, sid, append, seq=1, pcm=frame),
                    sub("r", "s" * 200, append, seq=1, pcm=frame),
                    sub("r", sid, append, seq=1, pcm=b"\x01\x02\x03"),
                    sub("r", sid, append, seq=1, pcm=b""),
                    sub("r", "nobody", append, seq=1, pcm=frame),
                    nan_params,
                    nested,
                    deep_params,
                    sub("r", sid, worker_pb2.SUBMISSION_KIND_RESPOND),
                    sub("r", sid, worker_pb2.SUBMISSION_KIND_COMMIT),
                    sub("r", sid, append, seq=2**64 - 1, pcm=frame, epoch=2**64 - 1),
                ],
                abort=[
                    worker_pb2.Abort(request_id="a" * 300, fence=common_pb2.Fence(session_id="x" * 300)),
                    worker_pb2.Abort(
                        request_id="r", fence=common_pb2.Fence(session_id="nobody", epoch=2**64 - 1)
                    ),
                ],
                release=[
                    worker_pb2.Release(request_id="r", fence=common_pb2.Fence(session_id="nobody", epoch=3)),
                    worker_pb2.Release(
                        request_id="r", fence=common_pb2.Fence(session_id="y" * 500), closed=True
                    ),
                ],
            ),
        ]
        return cmds

    @staticmethod
    def _junk_columns(sid: str) -> list[tuple[str, worker_pb2.AppendColumns]]:
        frame = pcm_of(VOICES[1][:512], PCM16K_MONO)
        top = 2**64 - 1
        entries = [  # (request id, session id, epoch, seq, frames)
            ("r", sid, 5, 1, 1),
            ("", sid, 5, 1, 1),
            ("r" * 200, sid, 5, 1, 1),
            ("r", "s" * 200, 5, 1, 1),
            ("r", "nobody", 5, 1, 1),
            ("r", sid, top, top, 1),
            ("r", sid, 5, 1, 0),
        ]
        bad = worker_pb2.AppendColumns(
            request_id=[e[0] for e in entries],
            session_id=[e[1] for e in entries],
            epoch=[e[2] for e in entries],
            turn_id=[0] * len(entries),
            seq=[e[3] for e in entries],
            frames=[e[4] for e in entries],
            pcm=frame * sum(e[4] for e in entries),
            replay=[True] * len(entries),
        )
        uneven = worker_pb2.AppendColumns()
        uneven.CopyFrom(bad)
        uneven.seq.append(2)
        short = worker_pb2.AppendColumns()
        short.CopyFrom(bad)
        short.pcm = frame[:-1]
        huge = worker_pb2.AppendColumns()
        huge.CopyFrom(bad)
        huge.frames[0] = 2**32 - 1
        misaligned = worker_pb2.AppendColumns()
        misaligned.CopyFrom(bad)
        misaligned.replay.append(False)
        return [
            ("bad entries", bad),
            ("uneven", uneven),
            ("short pcm", short),
            ("huge frames", huge),
            ("misaligned replay", misaligned),
        ]

    async def _unary(self, call: Awaitable[Any], where: str) -> None:
        try:
            await call
            self.seen[f"{where} OK"] += 1
        except grpc.aio.AioRpcError as exc:
            self.note_status(where, exc)

    async def _run_stream(
        self,
        stub: worker_pb2_grpc.DuplexWorkerStub,
        cmds: list[worker_pb2.WorkerCommand],
        where: str,
        *,
        wait: float,
    ) -> None:
        async def commands() -> AsyncIterator[worker_pb2.WorkerCommand]:
            for c in cmds:
                yield c
            await asyncio.sleep(wait)  # then half-close

        call = stub.Run(commands(), timeout=wait + 10)
        try:
            async for msg in call:
                for u in msg.updates:
                    if u.error.code:
                        self.seen[f"worker error {u.error.code}"] += 1
                        if u.error.code not in WORKER_CODES:
                            self.problem(f"{where}: WorkerError code {u.error.code!r}")
            self.seen[f"{where} OK"] += 1
        except grpc.aio.AioRpcError as exc:
            self.note_status(where, exc)

    # ---- the run -----------------------------------------------------------------------------

    async def loop(self, name: str, attack: Callable[[grpc.aio.Channel], Awaitable[None]]) -> None:
        async with grpc.aio.insecure_channel(self.session.grpc) as ch:
            while self.running():
                try:
                    await attack(ch)
                except Exception as exc:  # the fuzz's own bug, or a server that went away
                    self.problem(f"{name}: {type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)
                await asyncio.sleep(0.02)

    async def loop_plain(self, name: str, attack: Callable[[], Awaitable[None]], gap: float) -> None:
        while self.running():
            try:
                await attack()
            except Exception as exc:
                self.problem(f"{name}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(gap)

    def sample_rss(self, key: str) -> None:
        for name, proc in (("session", self.session), ("worker", self.worker)):
            kib = rss_kib(proc.pid)
            cur = self.rss[name]
            cur[key] = kib
            cur["peak"] = max(cur.get("peak", 0), kib)

    async def rss_sampler(self) -> None:
        while True:
            self.sample_rss("last")
            await asyncio.sleep(0.25)

    def read_gauges(self) -> dict[str, float]:
        s = metrics_text(self.session.metrics)
        w = metrics_text(self.worker.metrics)
        return {
            "duplex_session_active_sessions": metric_value(s, "duplex_session_active_sessions") or 0.0,
            "duplex_session_lanes": metric_value(s, "duplex_session_lanes") or 0.0,
            "duplex_session_streams": metric_value(s, "duplex_session_streams") or 0.0,
            "duplex_session_worker_sessions": metric_sum(s, "duplex_session_worker_sessions"),
            "duplex_worker_active_requests": metric_value(w, "duplex_worker_active_requests") or 0.0,
        }

    async def run(self) -> None:
        healthy = self.healthy = HealthyTalker(self.session.grpc)
        talker = asyncio.create_task(healthy.run())
        # The baseline: both processes warm (a session opened, a turn answered), nothing else.
        async with asyncio.timeout(60):
            while not healthy.turns and healthy.failure is None:  # noqa: ASYNC110 (polled state)
                await asyncio.sleep(0.05)
        self.sample_rss("baseline")
        sampler = asyncio.create_task(self.rss_sampler())
        turns_before = len(healthy.turns)
        self._deadline = time.monotonic() + self.seconds
        attacks = {
            "before_open": lambda: self.loop("before_open", self.before_open),
            "bad_open": lambda: self.loop("bad_open", self.bad_open),
            "bad_pcm": lambda: self.loop("bad_pcm", self.bad_pcm),
            "bad_events": lambda: self.loop("bad_events", self.bad_events),
            "rapid": lambda: self.loop("rapid", self.rapid),
            "resumes": lambda: self.loop("resumes", self.resumes),
            "idle": lambda: self.loop("idle", self.idle),
            "abandoned": self.abandoned,
            "never_reading": lambda: self.loop_plain("never_reading", self.never_reading, 0.5),
            "lanes": lambda: self.loop("lanes", self.lanes),
            "worker": lambda: self.loop_plain("worker", self.worker_calls, 0.2),
        }
        chosen = self.args.attacks.split(",") if self.args.attacks else list(attacks)
        tasks = [asyncio.create_task(attacks[name]()) for name in chosen]
        for name, outcome in zip(chosen, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
            if isinstance(outcome, BaseException):
                self.problem(f"{name}: the attack stopped: {type(outcome).__name__}: {outcome}")
            if not any(k.startswith(name) for k in self.attacks):
                self.problem(f"{name}: not one round of the attack completed")
        self.turns_during = len(healthy.turns) - turns_before
        healthy.stop()
        await asyncio.wait_for(talker, 90)
        if healthy.failure is not None:
            self.problem(f"the healthy session failed: {healthy.failure!r}")
        # Everything the attacks left comes back within the graces.
        t0 = time.monotonic()
        while True:
            self.gauges = self.read_gauges()
            if not any(self.gauges.values()) or time.monotonic() - t0 > SETTLE_S:
                break
            await asyncio.sleep(0.25)
        self.settle_s = time.monotonic() - t0
        for name, value in self.gauges.items():
            if value:
                self.problem(f"{name} is {value:g} {SETTLE_S:g} s after the load, want 0")
        s = metrics_text(self.session.metrics)
        self.slow_consumers = metric_value(s, "duplex_session_errors_total", 'code="slow_consumer"') or 0.0
        internal = metric_value(s, "duplex_session_errors_total", 'code="internal"') or 0.0
        if internal:
            self.problem(f"the session service counted {internal:g} internal errors")
        await asyncio.sleep(1.0)
        sampler.cancel()
        self.sample_rss("after")
        for name, r in self.rss.items():
            if r["after"] > r["baseline"] + RSS_SLACK_MIB * 1024:
                self.problem(
                    f"{name} RSS {r['after'] // 1024} MiB after the load, baseline "
                    f"{r['baseline'] // 1024} MiB (allowed: +{RSS_SLACK_MIB} MiB)"
                )
        problems, self.worst_score = turn_problems(healthy.turns, min_turns=max(1, int(self.seconds // 10)))
        for p in problems:
            self.problem(p)


TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.M)


def check_log(name: str, path: Path, problems: list[str]) -> int:
    text = path.read_text(errors="replace")
    found = TRACEBACK.findall(text)
    if found:
        at = TRACEBACK.search(text)
        assert at is not None
        excerpt = text[at.start() : at.start() + 1500]
        problems.append(f"{len(found)} traceback(s) in the {name}'s log; the first:\n{excerpt}")
    return len(found)


def summary(fz: Fuzz, logs: dict[str, int], elapsed: float) -> str:
    lines = [f"live fuzz: {fz.seconds:g} s of attacks, {elapsed:.0f} s in all"]
    lines.append("attacks: " + ", ".join(f"{k} {v}" for k, v in sorted(fz.attacks.items())))
    lines.append("codes seen:")
    for key, n in sorted(fz.seen.items()):
        lines.append(f"  {n:6d}  {key}")
    for name, r in fz.rss.items():
        mib = {k: v / 1024 for k, v in r.items()}
        lines.append(
            f"RSS {name}: baseline {mib.get('baseline', 0):.0f} MiB, peak {mib.get('peak', 0):.0f} MiB, "
            f"after {mib.get('after', 0):.0f} MiB (bound: baseline + {RSS_SLACK_MIB} MiB)"
        )
    lines.append(
        "gauges after the load: "
        + ", ".join(f"{k} {v:g}" for k, v in fz.gauges.items())
        + f" (settled in {fz.settle_s:.1f} s)"
    )
    lines.append(f"slow consumers cut off: {fz.slow_consumers:g}")
    if fz.healthy is not None:
        secs = [t.seconds for t in fz.healthy.turns]
        lines.append(
            f"healthy session: {len(secs)} turns ({fz.turns_during} during the attacks), longest "
            f"{max(secs, default=0):.1f} s, lowest content similarity (of those scored) {fz.worst_score:.2f}"
        )
    lines.append("tracebacks in the logs: " + ", ".join(f"{k} {v}" for k, v in logs.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.live_fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="how long the attacks run (default 30)")
    p.add_argument(
        "--abandoned",
        type=int,
        default=None,
        help="streams opened and dropped, paced over the run (default: 1000 per 30 s, at least 1000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attacks",
        default="",
        help="only these attacks, comma-separated (before_open, bad_open, bad_pcm, bad_events, rapid, "
        "resumes, idle, abandoned, never_reading, worker; default: all)",
    )
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the servers' logs here")
    args = p.parse_args(argv)
    if args.abandoned is None:
        args.abandoned = max(1000, round(1000 * args.seconds / 30))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="duplex-fuzz-") as tmp:
        logs = {name: Path(tmp) / f"{name}.log" for name in ("worker", "session")}
        started: list[ServiceProcess] = []
        fz: Fuzz | None = None
        failure = ""
        try:
            with open(logs["worker"], "w") as wlog, open(logs["session"], "w") as slog:
                worker = start_service(
                    worker_args(
                        "--orphan-grace-s", str(ORPHAN_GRACE_S), "--attach-lease-s", str(ATTACH_LEASE_S)
                    ),
                    stderr=wlog.fileno(),
                )
                started.append(worker)
                session = start_service(
                    session_args(
                        [worker.grpc],
                        "--detached-grace-s",
                        str(DETACHED_GRACE_S),
                        "--idle-timeout-s",
                        str(IDLE_TIMEOUT_S),
                        # A client that stops reading is cut off past 1 MiB (4 MiB by default):
                        # reachable in seconds by the never-reading clients.
                        "--max-session-buffer-bytes",
                        str(1024 * 1024),
                        "--replica-id",
                        f"fuzz-replica-{uuid.uuid4().hex[:8]}",
                    ),
                    stderr=slog.fileno(),
                )
                started.append(session)
                wait_metric(session.metrics, "duplex_session_workers_healthy", 1.0, timeout=30)
                fz = Fuzz(session, worker, args)
                asyncio.run(fz.run())
        except Exception as exc:
            failure = f"the fuzz itself failed: {type(exc).__name__}: {exc}"
        finally:
            for proc in reversed(started):
                proc.terminate(timeout=15)
        problems = list(fz.problems) if fz is not None else []
        if failure:
            problems.append(failure)
        counts = {name: check_log(name, path, problems) for name, path in logs.items()}
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for path in logs.values():
                (args.keep_logs / path.name).write_text(path.read_text(errors="replace"))
    if fz is not None:
        print(summary(fz, counts, time.monotonic() - t0))
    if problems:
        print(f"\nFAILED: {len(problems)} problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"- {problem}", file=sys.stderr)
        return 1
    print("\nOK: every invariant held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
