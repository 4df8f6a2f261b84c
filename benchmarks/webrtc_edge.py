"""WebRTC calls on the Realtime edge beside WebSocket connections, from a real browser.

    python -m benchmarks.webrtc_edge [--calls 1,3] [--turns 3] [--json PATH]

One local stack (a parrot worker, a session service, the edge: ``duplex up --realtime-port``)
and a headless Chromium (``apt-get install chromium``) whose fake microphone plays
examples/hello.wav then 5 s of silence, looped. Per window, N pages talk at once for ``--turns``
turns each, with the same microphone:

- **websocket**: a page on ``/v1/realtime`` (tests/fixtures/realtime_websocket_page.html): its
  microphone through an AudioWorklet as 24 kHz PCM16 appends every 20 ms, the reply's deltas
  decoded and scheduled with WebAudio as they come;
- **webrtc**: a page written to OpenAI's WebRTC flow (tests/fixtures/openai_webrtc_page.html):
  Opus both ways, the reply paced by the edge, the events on ``oai-events``.

Reported per window: end of speech to first reply audio **heard in the page** (both measured on
the page's AudioContext clock: the last loud 20 ms of the microphone's utterance to the first
loud 20 ms of the reply that follows; it includes the parrot's 500 ms of silence before it ends
a turn), p50/p90; and the edge's CPU (% of a core, /proc utime + stime) per conversation, its
idle use subtracted, with the session service's beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._sys import CpuMeter, NoMeasurement, fail, ints, summary_ms, write_result
from duplex.stack import LocalStack
from tests.browser import Browser, chromium_path
from tests.webrtc_helpers import (
    FIXTURES,
    OPENAI_PAGE,
    PAGE_RATE,
    Recording,
    loud_spans,
    microphone_wav,
    page_server,
)

WEBSOCKET_PAGE = (FIXTURES / "realtime_websocket_page.html").read_text()
SILENCE_S = 5.0
LOUD = 0.02
IDLE_S = 5.0


def first_audio_ms(rec: Recording) -> list[float]:
    """Per utterance of the microphone: its end to the start of the reply heard after it."""
    utterances: list[tuple[int, int]] = []
    for start, end in loud_spans(rec.mic, LOUD):
        if utterances and start - utterances[-1][1] < PAGE_RATE:  # a pause within it
            utterances[-1] = (utterances[-1][0], end)
        else:
            utterances.append((start, end))
    replies = loud_spans(rec.reply, LOUD)
    out = []
    for i, (_, end) in enumerate(utterances):
        limit = utterances[i + 1][0] if i + 1 < len(utterances) else len(rec.reply)
        heard = [s for s, _ in replies if end <= s < limit]
        if heard:
            out.append(1000 * (heard[0] - end) / PAGE_RATE)
    return out


async def _window(
    stack: LocalStack, browser: Browser, mode: str, calls: int, turns: int, idle_pct: float, port: int
) -> dict[str, Any]:
    assert stack.realtime is not None and stack.session is not None
    base = stack.realtime_url.replace("ws://", "http://")
    timeout_ms = int((turns * (3.7 + SILENCE_S) + 10) * 1000)
    page_text = OPENAI_PAGE if mode == "webrtc" else WEBSOCKET_PAGE
    if mode == "webrtc":
        opts = {"turns": turns, "timeout_ms": timeout_ms, "retry_with": []}
        call = f"talk({json.dumps(base)}, 'unused', {json.dumps(opts)})"
    else:
        url = stack.realtime_url + "/realtime?model=parrot"
        call = f"talk({json.dumps(url)}, {json.dumps({'turns': turns, 'timeout_ms': timeout_ms})})"
    meter = CpuMeter({"edge": stack.realtime.pid, "session": stack.session.pid})
    async with page_server(page_text, port=port) as origin:
        pages = [browser.page(origin + "/") for _ in range(calls)]
        opened = [await p.__aenter__() for p in pages]
        try:
            meter.start()
            outs = await asyncio.gather(*(page.evaluate(call, timeout_ms / 1000 + 30) for page in opened))
            pct = meter.stop()
        finally:
            for p in pages:
                await p.__aexit__(None, None, None)
    latencies = [ms for out in outs for ms in first_audio_ms(Recording.of(out))]
    if len(latencies) < calls * (turns - 1):
        raise NoMeasurement(f"{mode} x{calls}: {len(latencies)} replies heard of {calls * turns} turns")
    edge = pct["edge"]
    return {
        "calls": calls,
        "turns": calls * turns,
        "first_audio_heard_ms": summary_ms(latencies),
        "edge_cpu_pct": None if edge is None else round(edge, 1),
        "edge_cpu_pct_per_call": None if edge is None else round((edge - idle_pct) / calls, 2),
        "session_cpu_pct_per_call": None if pct["session"] is None else round(pct["session"] / calls, 2),
        "other_cpu_pct": round(pct.get("other") or 0.0, 1),
        "wall_s": round(meter.wall, 1),
    }


async def _run(
    stack: LocalStack, browser: Browser, calls: list[int], turns: int, port: int
) -> dict[str, Any]:
    assert stack.realtime is not None
    idle = CpuMeter({"edge": stack.realtime.pid})
    idle.start()
    await asyncio.sleep(IDLE_S)
    idle_pct = idle.stop()["edge"] or 0.0
    result: dict[str, Any] = {"edge_idle_cpu_pct": round(idle_pct, 2), "windows": []}
    for n in calls:
        for mode in ("websocket", "webrtc"):
            window = await _window(stack, browser, mode, n, turns, idle_pct, port)
            window["mode"] = mode
            result["windows"].append(window)
            fa = window["first_audio_heard_ms"]
            print(
                f"  {mode:<9} x{n}: first audio heard p50 {fa['p50']:.0f} ms p90 {fa['p90']:.0f} ms "
                f"(n={fa['n']}); edge {window['edge_cpu_pct_per_call']} % of a core per conversation, "
                f"session service {window['session_cpu_pct_per_call']} %",
                flush=True,
            )
            await asyncio.sleep(2)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.webrtc_edge", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=ints, default=[1, 3], help="conversations at once, per window")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--json", default=None, help="write the result to this JSON file")
    args = p.parse_args(argv)
    if chromium_path() is None:
        return fail("no chromium on this machine (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = microphone_wav(Path(tmp) / "mic.wav", silence_s=SILENCE_S)
        t0 = time.monotonic()
        # The pages' origin, allowed to call the edge (--cors-origin): a port picked now.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        edge_args = ["--cors-origin", f"http://127.0.0.1:{port}"]
        try:
            with (
                LocalStack(realtime_port=0, log=sys.stderr, realtime_args=edge_args) as stack,
                Browser(wav) as browser,
            ):
                print(
                    f"{args.turns} turns per conversation; hello.wav then {SILENCE_S:g} s of silence, looped"
                )
                result = asyncio.run(_run(stack, browser, args.calls, args.turns, port))
        except NoMeasurement as exc:
            return fail(str(exc))
    by = {(w["mode"], w["calls"]): w for w in result["windows"]}
    for n in args.calls:
        ws, rtc = by[("websocket", n)], by[("webrtc", n)]
        if ws["edge_cpu_pct_per_call"] and rtc["edge_cpu_pct_per_call"]:
            result[f"webrtc_over_websocket_edge_cpu_x{n}"] = round(
                rtc["edge_cpu_pct_per_call"] / ws["edge_cpu_pct_per_call"], 1
            )
        result[f"webrtc_minus_websocket_first_audio_p50_ms_x{n}"] = round(
            rtc["first_audio_heard_ms"]["p50"] - ws["first_audio_heard_ms"]["p50"]
        )
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list | dict)}))
    write_result(args.json, "webrtc_edge", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
