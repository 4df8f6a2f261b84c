"""The cascade (a model served in stages: ASR -> responder -> TTS, each on its own worker), as served.

    python -m benchmarks.cascade [--sessions 1,2,4,8] [--asr-workers 2] [--turns 3] [--json PATH]
    python -m benchmarks.cascade --pipeline chat [...]   # a language model stage in the middle

For each session count N of ``--sessions``, a local stack (``LocalStack(pipeline="cascade")``:
``--asr-workers`` speech recognition workers, one responder and one TTS worker, each with one
torch thread, the session service), warmed by N sessions opened and closed, and N clients, each
streaming ``examples/coffee.wav`` then the silence of a listening user, at real time, ``--turns``
times (the reply plays meanwhile); conversations are not in step: each starts 1/N of a turn after
the last. Measured:

- **end of the user's speech -> first reply audio**, split by stage: the turn's end (speech end to
  ``committed``: the VAD's silence and its detection, and the recognizer's transcript, which comes
  with it), then each later stage's share (``duplex_session_stage_latency_seconds``: the
  responder, from the transcript to its first whole sentence; the TTS stage, from that sentence
  to the first audio), and the total the client saw (median and p90 over every turn);
- **each stage's CPU per session-second**: each worker process's CPU time (``/proc``) over the
  window, and the session service's, divided by the session-seconds streamed;
- **sessions held in real time**: the largest N at which every turn was answered, no worker tick
  missed its deadline more than ``--late-pct`` percent of the time (``duplex_worker_ticks_late_total``
  of each stage's worker) and the first audio came within ``--max-first-audio-s`` at p90.
Admission is off (``--max-tick-load 0``) so the measure shows where real time breaks, not where
the worker would have refused.

``--pipeline chat`` measures the chat pipeline the same way (ASR -> chat -> TTS), its chat stage
streaming from the tests' scripted OpenAI-compatible server (``tests.chat_server``), which answers
at once ("You said: ..."): the chat stage's share is then its own cost, the server's time to the
first token (``duplex_worker_llm_first_token_seconds``) given beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from benchmarks._sys import CpuMeter, NoMeasurement, fail, ints, write_result
from duplex.audio import PCM16K_MONO
from duplex.client import event_kind, load_wav_as
from duplex.stack import PIPELINES, LocalStack, example_path
from duplex.v1 import session_pb2, session_pb2_grpc

CHUNK_S = 0.032
"""One append: a worker frame."""
LISTEN_S = 7.0
"""The silence after each utterance (the user listens to the reply)."""


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``labels`` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


@dataclass
class Turns:
    """What one client saw: per turn, speech end -> committed and -> first reply audio."""

    to_commit: list[float] = field(default_factory=list)
    to_audio: list[float] = field(default_factory=list)
    answered: int = 0
    failed: int = 0


def _speech_end_s(pcm: bytes) -> float:
    """Where the speech in the recording ends (its last sample above the noise floor)."""
    x = np.abs(np.frombuffer(pcm, "<i2").astype(np.float32)) / 32768.0
    loud = np.nonzero(x > 0.01)[0]
    return float(loud[-1] + 1) / PCM16K_MONO.sample_rate_hz if len(loud) else 0.0


async def _client(target: str, utterance: bytes, turns: int, seen: Turns, delay_s: float = 0.0) -> None:
    """After ``delay_s``, open, then ``turns`` times: the utterance and ``LISTEN_S`` of silence,
    in real time. Latencies are the turn's own (``committed.turn_id``, the response's turn)."""
    await asyncio.sleep(delay_s)
    speech_end = _speech_end_s(utterance)
    chunk = PCM16K_MONO.bytes_for_ms(CHUNK_S * 1000)
    one = utterance + bytes(PCM16K_MONO.bytes_for_ms(LISTEN_S * 1000))
    one = one[: len(one) // chunk * chunk]
    turn_s = len(one) / PCM16K_MONO.bytes_for_ms(1000)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = session_pb2_grpc.DuplexSessionStub(ch)
        out: asyncio.Queue[session_pb2.ClientEvent | None] = asyncio.Queue()
        cfg = session_pb2.SessionConfig(
            input_format=PCM16K_MONO.to_proto(), output_format=PCM16K_MONO.to_proto()
        )
        out.put_nowait(session_pb2.ClientEvent(open=session_pb2.SessionOpen(config=cfg)))

        async def requests() -> Any:
            while (ev := await out.get()) is not None:
                yield ev

        call = stub.Converse(requests())
        ends: list[float] = []  # wall time of each turn's speech end
        first_audio: set[str] = set()

        def since_end(turn_id: int) -> float | None:
            return time.monotonic() - ends[turn_id - 1] if 0 < turn_id <= len(ends) else None

        async def read() -> None:
            async for ev in call:
                kind = event_kind(ev)
                if kind == "committed" and (lag := since_end(ev.committed.turn_id)) is not None:
                    seen.to_commit.append(lag)
                elif kind == "audio_delta" and ev.audio_delta.response_id not in first_audio:
                    first_audio.add(ev.audio_delta.response_id)
                    if (lag := since_end(ev.audio_delta.turn_id)) is not None:
                        seen.to_audio.append(lag)
                elif kind == "response_done":
                    if ev.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED:
                        seen.answered += 1
                    else:
                        seen.failed += 1

        reader = asyncio.create_task(read())
        t0 = time.monotonic()
        seq = 0
        for turn in range(turns):
            ends.append(t0 + turn * turn_s + speech_end)
            for i in range(0, len(one), chunk):
                seq += 1
                out.put_nowait(
                    session_pb2.ClientEvent(
                        append=session_pb2.InputAudioAppend(seq=seq, pcm=one[i : i + chunk])
                    )
                )
                due = t0 + turn * turn_s + (i + chunk) / PCM16K_MONO.bytes_for_ms(1000)
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        out.put_nowait(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        out.put_nowait(None)
        await asyncio.wait_for(reader, 30)


async def _warm(target: str, sessions: int) -> None:
    """Open ``sessions`` sessions at once, give each a frame, close them (the first session of a
    fresh stack pays for the links' and models' first use)."""

    async def one() -> None:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = session_pb2_grpc.DuplexSessionStub(ch)
            cfg = session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto())
            call = stub.Converse(
                iter(
                    [
                        session_pb2.ClientEvent(open=session_pb2.SessionOpen(config=cfg)),
                        session_pb2.ClientEvent(
                            append=session_pb2.InputAudioAppend(
                                seq=1, pcm=bytes(PCM16K_MONO.bytes_for_ms(32))
                            )
                        ),
                        session_pb2.ClientEvent(close=session_pb2.SessionClose()),
                    ]
                )
            )
            async for _ in call:
                pass

    await asyncio.gather(*(one() for _ in range(sessions)))
    await asyncio.sleep(1.0)


def served(
    sessions: int,
    turns: int,
    device: str = "cpu",
    torch_threads: int = 1,
    asr_workers: int = 1,
    pipeline: str = "cascade",
) -> dict[str, Any]:
    """``sessions`` clients, ``turns`` turns each, through a fresh stack of ``pipeline``
    (``device``: the workers'; the recognizer and the synthesizer run on the CPU whatever it is)."""
    if pipeline == "chat":
        from tests.chat_helpers import ChatServer  # the scripted server (a dev install's)

        llm: ChatServer | None = ChatServer()
    else:
        llm = None
    try:
        return _served(sessions, turns, device, torch_threads, asr_workers, pipeline, llm)
    finally:
        if llm is not None:
            llm.stop()


def _served(
    sessions: int,
    turns: int,
    device: str,
    torch_threads: int,
    asr_workers: int,
    pipeline: str,
    llm: Any,
) -> dict[str, Any]:
    stages = PIPELINES[pipeline][1]
    utterance = load_wav_as(example_path("coffee.wav"), PCM16K_MONO)
    llm_args = ["--llm-url", llm.url, "--llm-model", "scripted", "--llm-concurrency", "64"] if llm else []
    with tempfile.TemporaryFile("w+") as log:
        stack = LocalStack(
            pipeline=pipeline,
            stage_args={"chat": llm_args} if llm else {},
            workers=1,
            stage_counts={"asr": asr_workers},
            device=device,
            worker_args=[
                *("--torch-threads", str(torch_threads), "--max-tick-load", "0"),
                *("--max-sessions", str(max(64, sessions))),
            ],
            session_args=["--max-sessions", str(max(64, 2 * sessions))],
            log=log,
            startup_timeout_s=180.0,
        )
        with stack:
            assert stack.session is not None
            workers = {w.name: w for stage in stages for w in stack.stage_workers(stage)}  # asr-0, ...
            asyncio.run(_warm(stack.target, sessions))
            before = {name: _scrape(w.metrics_url) for name, w in workers.items()}
            meter = CpuMeter({**{name: w.pid for name, w in workers.items()}, "session": stack.session.pid})
            seen = [Turns() for _ in range(sessions)]
            meter.start()

            cycle_s = len(utterance) / PCM16K_MONO.bytes_for_ms(1000) + LISTEN_S

            async def everyone() -> None:
                # Conversations are not in step: each starts a share of a turn after the last.
                await asyncio.gather(
                    *(
                        _client(stack.target, utterance, turns, t, i * cycle_s / sessions)
                        for i, t in enumerate(seen)
                    )
                )

            asyncio.run(everyone())
            pct = meter.stop()
            after = {name: _scrape(w.metrics_url) for name, w in workers.items()}
            session_metrics = _scrape(stack.session.metrics_url)
    to_commit = [x for t in seen for x in t.to_commit]
    to_audio = [x for t in seen for x in t.to_audio]
    if not to_audio:
        raise NoMeasurement(f"{sessions} sessions: no turn was answered")
    stream_s = (
        sessions
        * turns
        * len(utterance + bytes(PCM16K_MONO.bytes_for_ms(LISTEN_S * 1000)))
        / (PCM16K_MONO.bytes_for_ms(1000))
    )

    def stage_latency(stage: str) -> float | None:
        n = _metric(session_metrics, "duplex_session_stage_latency_seconds_count", f'stage="{stage}"')
        s = _metric(session_metrics, "duplex_session_stage_latency_seconds_sum", f'stage="{stage}"')
        return s / n if n else None

    def of(stage: str) -> list[str]:
        return [name for name in workers if name.rsplit("-", 1)[0] == stage]

    def grew(stage: str, metric: str) -> float:
        return sum(_metric(after[n], metric) - _metric(before[n], metric) for n in of(stage))

    def late_pct(stage: str) -> float | None:
        ticks = grew(stage, "duplex_worker_tick_duration_seconds_count")
        return 100 * grew(stage, "duplex_worker_ticks_late_total") / ticks if ticks else None

    cpu = {stage: sum(meter.seconds.get(n) or 0.0 for n in of(stage)) for stage in stages}
    cpu["session"] = meter.seconds.get("session") or 0.0
    first_token = grew("chat", "duplex_worker_llm_first_token_seconds_count")
    return {
        "pipeline": pipeline,
        "sessions": sessions,
        "asr_workers": asr_workers,
        "turns": sessions * turns,
        "answered": sum(t.answered for t in seen),
        "failed": sum(t.failed for t in seen),
        "speech_end_to_commit_s": _pcts(to_commit),
        "speech_end_to_first_audio_s": _pcts(to_audio),
        "stage_latency_mean_s": {stage: stage_latency(stage) for stage in stages[1:]},
        "llm_first_token_mean_s": grew("chat", "duplex_worker_llm_first_token_seconds_sum") / first_token
        if first_token
        else None,
        "cpu_s_per_session_s": {name: sec / stream_s for name, sec in cpu.items()},
        "ticks_late_pct": {stage: late_pct(stage) for stage in stages},
        "other_cpu_pct": pct.get("other"),
    }


def _pcts(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "n": float(len(ordered)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", choices=("cascade", "chat"), default="cascade")
    p.add_argument("--device", default="cpu", help="the workers' device (VAD; the rest runs on the CPU)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument(
        "--asr-workers",
        type=int,
        default=2,
        help="workers of the speech recognition stage (its decoder holds the GIL: a worker uses a core at "
        "most; the other stages take little)",
    )
    p.add_argument("--sessions", default="1,2,4,8", help="session counts, each through a fresh stack")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--late-pct", type=float, default=5.0, help="most ticks late at real time, per stage")
    p.add_argument(
        "--max-first-audio-s", type=float, default=2.0, help="p90 speech end -> first audio at real time"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    try:
        for n in ints(args.sessions):
            row = served(n, args.turns, args.device, args.torch_threads, args.asr_workers, args.pipeline)
            rows.append(row)
            lat = row["stage_latency_mean_s"]
            cpu = row["cpu_s_per_session_s"]
            late = row["ticks_late_pct"]
            print(
                f"{n:3d} sessions: {row['answered']}/{row['turns']} answered; speech end -> commit "
                f"{row['speech_end_to_commit_s']['median']:.3f} s, -> first audio "
                f"{row['speech_end_to_first_audio_s']['median']:.3f} s (p90 "
                f"{row['speech_end_to_first_audio_s']['p90']:.3f}); "
                + ", ".join(f"{k} {v or 0:.3f} s" for k, v in lat.items())
                + (
                    f" (the server's first token {row['llm_first_token_mean_s']:.3f} s)"
                    if row["llm_first_token_mean_s"] is not None
                    else ""
                )
                + "; CPU per session-second "
                + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
                + "; ticks late % "
                + ", ".join(f"{k} {v:.1f}" for k, v in late.items() if v is not None),
                flush=True,
            )
    except NoMeasurement as exc:
        return fail(str(exc))
    held = [
        r["sessions"]
        for r in rows
        if r["answered"] == r["turns"]
        and all(v is not None and v <= args.late_pct for v in r["ticks_late_pct"].values())
        and r["speech_end_to_first_audio_s"]["p90"] <= args.max_first_audio_s
    ]
    write_result(
        args.json,
        args.pipeline,
        {
            "rows": rows,
            "sessions_in_real_time": max(held, default=0),
            "late_pct_bound": args.late_pct,
            "max_first_audio_s": args.max_first_audio_s,
        },
    )
    print(
        f"{args.pipeline} sessions this machine holds in real time: {max(held, default=0)} "
        f"(of {ints(args.sessions)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
