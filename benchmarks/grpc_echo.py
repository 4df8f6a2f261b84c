"""The transport's floor: a bare grpc.aio bidi echo at a session tier's message rate.

    python -m benchmarks.grpc_echo [--streams 32] [--period-ms 32] [--seconds 5] [--json PATH]

A server process of its own (the project's server options; its handler does nothing but
``context.read()`` and ``context.write()``) echoes the messages of S streams. The client, in this
process, writes one 1 KiB message per stream per period at real-time pace: the client side of a
session-frame (one append in, one reply frame out) with no serving logic at all. The server's CPU
per message pair over a window (from /proc: user, kernel and context switches of all its threads)
is what gRPC's asyncio API costs before the session tier does anything: for the transport, what the
model alone is for the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import signal
import subprocess
import sys
import time
from typing import Any

import grpc

from benchmarks._sys import NoMeasurement, fail, proc_detail, reap, write_result
from duplex import spawn
from duplex.serving import CHANNEL_OPTIONS, SERVER_OPTIONS

METHOD = "/benchmark.Echo/Echo"
START_TIMEOUT_S = 30.0
"""How long the server process may take to say it is listening."""
PAYLOAD_BYTES = 1024
"""One 32 ms frame of 16 kHz 16-bit PCM, as an append and a reply frame carry."""


def _same(b: bytes) -> bytes:
    return b


async def serve() -> None:
    """Echo every message of every stream; print ``{"port": N}`` once listening; stop when stdin
    closes (the parent went away)."""

    async def echo(request: Any, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        del request
        while True:
            msg = await context.read()
            if not isinstance(msg, bytes):  # grpc.aio.EOF: the client half-closed
                return
            await context.write(msg)

    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "benchmark.Echo",
        {"Echo": grpc.stream_stream_rpc_method_handler(echo, _same, _same)},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # EOF: the parent is done (or gone)
    await server.stop(0)


async def drive(port: int, streams: int, period_s: float, until: float) -> int:
    """S streams, one message each per period at real-time pace, until ``until``; returns the
    messages echoed back."""
    got = 0
    payload = bytes(PAYLOAD_BYTES)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        method = ch.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)

        async def one(i: int) -> None:
            nonlocal got
            call = method()

            async def read() -> None:
                nonlocal got
                async for _ in call:
                    got += 1

            reader = asyncio.create_task(read())
            due = time.monotonic() + period_s * i / streams  # spread like real sessions
            while due < until:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await call.write(payload)
                due += period_s
            await call.done_writing()
            await reader

        await asyncio.gather(*(one(i) for i in range(streams)))
    return got


def start_server() -> tuple[subprocess.Popen[str], int]:
    """The echo server in a process of its own, and its port once it says it listens (within
    ``START_TIMEOUT_S``, else ``NoMeasurement`` and the process is stopped)."""
    proc = spawn.popen(
        [sys.executable, "-m", "benchmarks.grpc_echo", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        parent_death_signal=signal.SIGTERM,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise NoMeasurement(f"the echo server did not start within {START_TIMEOUT_S:g} s")
        return proc, int(json.loads(line)["port"])
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen[str]) -> None:
    """Close its stdin (it stops), wait for it, kill it if it does not; close its pipes."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    reap(proc, 10)
    if proc.stdout is not None:
        proc.stdout.close()


def measure(streams: int, period_ms: float, seconds: float, warmup_s: float = 1.5) -> dict[str, Any]:
    """Start the echo server, drive it, and return its CPU per message pair over the window."""
    proc, port = start_server()
    try:
        marks: dict[str, Any] = {}

        async def run() -> int:
            start = time.monotonic()
            a, b = start + warmup_s, start + warmup_s + seconds

            async def window() -> None:
                await asyncio.sleep(max(0.0, a - time.monotonic()))
                marks["a"] = proc_detail(proc.pid)
                marks["t0"] = time.monotonic()
                await asyncio.sleep(max(0.0, b - time.monotonic()))
                marks["b"] = proc_detail(proc.pid)
                marks["t1"] = time.monotonic()

            watcher = asyncio.create_task(window())
            got = await drive(port, streams, period_ms / 1000.0, b + 0.2)
            await watcher
            return got

        try:
            echoed = asyncio.run(run())
        except grpc.RpcError as exc:  # the server went away mid-run
            raise NoMeasurement(f"the echo stream failed ({type(exc).__name__})") from exc
    finally:
        stop_server(proc)
    d0, d1 = marks.get("a"), marks.get("b")
    if d0 is None or d1 is None or echoed <= 0:
        raise NoMeasurement("the echo server answered nothing or could not be measured")
    wall = marks["t1"] - marks["t0"]
    pairs = streams * wall / (period_ms / 1000.0)
    return per_pair(d0, d1, pairs) | {
        "streams": streams,
        "period_ms": period_ms,
        "window_s": wall,
        "pairs": pairs,
        "echoed": echoed,
    }


def per_pair(d0: dict[str, float], d1: dict[str, float], pairs: float) -> dict[str, float]:
    """CPU µs (all, user, kernel) and context switches per message pair between two
    ``proc_detail`` readings."""
    if pairs <= 0:
        raise NoMeasurement("no message pair in the window")
    user, system = d1["user_s"] - d0["user_s"], d1["system_s"] - d0["system_s"]
    if user + system <= 0:
        # /proc counts CPU in clock ticks (10 ms): a window that light is not a measurement.
        raise NoMeasurement("no server CPU was counted in the window; drive more pairs or a longer window")
    return {
        "cpu_us_per_pair": 1e6 * (user + system) / pairs,
        "user_us": 1e6 * user / pairs,
        "kernel_us": 1e6 * system / pairs,
        "switches": (d1["switches"] - d0["switches"]) / pairs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--period-ms", type=float, default=32.0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", default="")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve())
        return 0
    try:
        r = measure(args.streams, args.period_ms, args.seconds)
    except NoMeasurement as exc:
        return fail(str(exc))
    print(
        f"grpc echo: {args.streams} streams, one {PAYLOAD_BYTES} B message each per {args.period_ms:g} ms, "
        f"server CPU per message pair {r['cpu_us_per_pair']:.0f} µs ({r['user_us']:.0f} user, "
        f"{r['kernel_us']:.0f} kernel), {r['switches']:.1f} context switches",
        flush=True,
    )
    write_result(args.json, "grpc_echo", r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
