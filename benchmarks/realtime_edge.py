"""The Realtime edge's cost and latency beside direct gRPC, on one local stack.

    python -m benchmarks.realtime_edge [--sessions 32] [--turns 2] [--json PATH]

One local stack (a parrot worker, a session service, the edge: ``duplex up --realtime-port``).
Two windows of the same load, one after the other: N sessions each speak ``examples/hello.wav``
``--turns`` times, in 20 ms appends of 24 kHz PCM16 paced at real time, each turn followed by
1.5 s of silence (server VAD ends the turn and the parrot answers), sessions started over the
first second.

- **direct**: Python clients (``duplex.client``) holding their sessions as lanes of ONE
  ``ConverseMany`` stream: what the edge itself does, so the difference is the edge's hop.
- **edge**: plain WebSocket clients (``websockets``, JSON events, no SDK: the client's own cost
  stays small) on the edge's ``/v1/realtime``.

Reported per window: end of speech -> first audio (the client's time from the ``committed``
event, ``input_audio_buffer.committed`` on the edge, to the first audio of the reply), p50/p99;
and each process's CPU (/proc utime + stime) per session-frame, a session-frame being 20 ms of
one session's input.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from typing import Any

import numpy as np
import websockets

from benchmarks._services import worker_flags
from benchmarks._sys import CpuMeter, NoMeasurement, fail, summary_ms, write_result
from duplex.audio import encode
from duplex.client import DuplexClient, event_kind, load_wav_as
from duplex.client_lanes import Lanes
from duplex.stack import LocalStack, example_path
from realtime_service.protocol import PCM24K

CHUNK_MS = 20
SILENCE_MS = 1500


def _turn_audio() -> tuple[bytes, bytes]:
    speech = load_wav_as(example_path("hello.wav"), PCM24K)
    silence = encode(np.zeros(PCM24K.sample_rate_hz * SILENCE_MS // 1000, np.float32), PCM24K)
    return speech, silence


def _chunks(pcm: bytes) -> list[bytes]:
    step = PCM24K.bytes_for_ms(CHUNK_MS)
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


async def _paced(chunks: list[bytes], send: Any, start: float) -> float:
    """Send ``chunks`` one per 20 ms from ``start`` (monotonic); returns when the last went."""
    for i, chunk in enumerate(chunks):
        delay = start + i * CHUNK_MS / 1000 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(chunk)
    return start + len(chunks) * CHUNK_MS / 1000


async def _direct_session(lanes: Lanes, turns: int, delay: float, out: list[float]) -> int:
    await asyncio.sleep(delay)
    session = await lanes.open_session(model="parrot", input_format=PCM24K, output_format=PCM24K)
    speech, silence = _turn_audio()
    chunks = _chunks(speech + silence)
    frames = 0
    committed: float | None = None

    async def read() -> None:
        nonlocal committed
        done = 0
        async for ev in session.events():
            kind = event_kind(ev)
            if kind == "committed":
                committed = time.monotonic()
            elif kind == "audio_delta" and committed is not None:
                out.append(1000 * (time.monotonic() - committed))
                committed = None
            elif kind == "response_done":
                done += 1
                if done == turns:
                    return

    reader = asyncio.create_task(read())
    start = time.monotonic()
    for _ in range(turns):
        start = await _paced(chunks, session.send_audio, start)
        frames += len(chunks)
    await asyncio.wait_for(reader, 30)
    await session.close()
    return frames


async def _edge_session(url: str, turns: int, delay: float, out: list[float]) -> int:
    await asyncio.sleep(delay)
    speech, silence = _turn_audio()
    chunks = _chunks(speech + silence)
    frames = 0
    async with websockets.connect(url, max_size=None) as ws:
        committed: float | None = None

        async def read() -> None:
            nonlocal committed
            done = 0
            async for message in ws:
                kind = json.loads(message)["type"]
                if kind == "input_audio_buffer.committed":
                    committed = time.monotonic()
                elif kind == "response.output_audio.delta" and committed is not None:
                    out.append(1000 * (time.monotonic() - committed))
                    committed = None
                elif kind == "response.done":
                    done += 1
                    if done == turns:
                        return

        async def send(chunk: bytes) -> None:
            audio = base64.b64encode(chunk).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))

        reader = asyncio.create_task(read())
        start = time.monotonic()
        for _ in range(turns):
            start = await _paced(chunks, send, start)
            frames += len(chunks)
        await asyncio.wait_for(reader, 30)
    return frames


async def _window(stack: LocalStack, mode: str, sessions: int, turns: int) -> dict[str, Any]:
    assert stack.session is not None and stack.realtime is not None
    meter = CpuMeter(
        {"session": stack.session.pid, "edge": stack.realtime.pid, "worker": stack.worker_children[0].pid}
    )
    first_audio: list[float] = []
    delays = [i / sessions for i in range(sessions)]
    meter.start()
    if mode == "direct":
        async with DuplexClient(stack.target) as client, Lanes(client) as lanes:
            frames = await asyncio.gather(*(_direct_session(lanes, turns, d, first_audio) for d in delays))
    else:
        url = f"{stack.realtime_url}/realtime?model=parrot"
        frames = await asyncio.gather(*(_edge_session(url, turns, d, first_audio) for d in delays))
    pct = meter.stop()
    session_frames = sum(frames)
    if len(first_audio) < sessions * turns // 2:
        raise NoMeasurement(f"{mode}: {len(first_audio)} replies of {sessions * turns} turns")
    cpu_us = {
        name: None if sec is None else round(1e6 * sec / session_frames, 1)
        for name, sec in meter.seconds.items()
    }
    return {
        "sessions": sessions,
        "turns": sessions * turns,
        "replies": len(first_audio),
        "session_frames": session_frames,
        "first_audio_ms": summary_ms(first_audio),
        "cpu_us_per_session_frame": cpu_us,
        "cpu_pct": {k: None if v is None else round(v, 1) for k, v in pct.items()},
        "wall_s": round(meter.wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.realtime_edge", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the worker's device")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", default=None, help="merge the result into this JSON file")
    args = p.parse_args(argv)
    # worker_flags' --device comes after LocalStack's own: the last one counts.
    flags = worker_flags(device=args.device, torch_threads=args.torch_threads)
    try:
        with LocalStack(realtime_port=0, log=sys.stderr, worker_args=flags) as stack:
            result = {
                mode: asyncio.run(_window(stack, mode, args.sessions, args.turns))
                for mode in ("direct", "edge")
            }
    except NoMeasurement as exc:
        return fail(str(exc))
    d, e = result["direct"], result["edge"]
    print(f"{args.sessions} sessions x {args.turns} turns, 20 ms appends of 24 kHz PCM16")
    for mode, r in result.items():
        fa, cpu = r["first_audio_ms"], r["cpu_us_per_session_frame"]
        print(
            f"  {mode:<6} first audio p50 {fa['p50']:.0f} ms p99 {fa['p99']:.0f} ms; CPU per session-frame: "
            f"session {cpu['session']} us, edge {cpu['edge']} us, worker {cpu['worker']} us"
        )
    if d["first_audio_ms"]["p99"] and e["first_audio_ms"]["p99"]:
        result["edge_first_audio_p99_over_direct"] = round(
            e["first_audio_ms"]["p99"] / d["first_audio_ms"]["p99"], 2
        )
    session_us = e["cpu_us_per_session_frame"]["session"]
    edge_us = e["cpu_us_per_session_frame"]["edge"]
    if session_us and edge_us:
        result["edge_cpu_over_session_cpu"] = round(edge_us / session_us, 2)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    write_result(args.json, "realtime_edge", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
