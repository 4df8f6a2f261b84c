"""Helpers of the Realtime edge's tests: the demo recording in a Realtime format, sending it with
the official ``openai`` SDK, and reading typed events until one arrives."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from openai import AsyncOpenAI

from duplex.audio import PcmFormat, encode
from duplex.client import load_wav_as
from duplex.stack import example_path

#: hello.wav holds 3.36 s of speech; the parrot answers with as much audio.
HELLO_SPEECH_S = 3.36


def speech(fmt: PcmFormat, trailing_silence_ms: int = 1500) -> bytes:
    """examples/hello.wav in ``fmt``, then silence that lets server VAD end the turn."""
    silence = encode(np.zeros(fmt.sample_rate_hz * trailing_silence_ms // 1000, np.float32), fmt)
    return load_wav_as(example_path("hello.wav"), fmt) + silence


def sdk(base_url: str, api_key: str = "unused") -> AsyncOpenAI:
    """The OpenAI SDK pointed at an edge (``ws://HOST:PORT/v1`` or ``http://...``)."""
    return AsyncOpenAI(base_url=base_url.replace("ws://", "http://"), api_key=api_key, max_retries=0)


async def send_audio(conn: Any, pcm: bytes, fmt: PcmFormat, chunk_ms: int = 20) -> None:
    """``input_audio_buffer.append`` of ``pcm`` in ``chunk_ms`` pieces, as fast as the edge takes
    them (it reads no faster than the model consumes)."""
    step = fmt.bytes_for_ms(chunk_ms)
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())


@contextlib.asynccontextmanager
async def sending(conn: Any, pcm: bytes, fmt: PcmFormat) -> AsyncIterator[asyncio.Task[None]]:
    """``send_audio`` in a task for the block's duration (cancelled at its end if still going)."""
    task = asyncio.create_task(send_audio(conn, pcm, fmt))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def read_until(
    conn: Any, done: Callable[[Any], bool], timeout_s: float = 30.0, seen: list[Any] | None = None
) -> list[Any]:
    """Typed events in order until ``done(event)`` (that one included); fails on a timeout."""
    events: list[Any] = [] if seen is None else seen
    async with asyncio.timeout(timeout_s):
        async for event in conn:
            events.append(event)
            if done(event):
                return events
    raise AssertionError(f"the connection ended before the awaited event; got {[e.type for e in events]}")


def audio_of(events: list[Any], response_id: str | None = None) -> bytes:
    """The audio of ``response.output_audio.delta`` events (of one response when given)."""
    return b"".join(
        base64.b64decode(e.delta)
        for e in events
        if e.type == "response.output_audio.delta" and (response_id is None or e.response_id == response_id)
    )


def types(events: list[Any]) -> list[str]:
    return [e.type for e in events]
