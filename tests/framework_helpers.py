"""What the voice-agent framework tests share: a microphone that speaks a WAV of tests/fixtures in
real time (silence when it has nothing to say, as a real one), the parrot's stack with its
Realtime edge, and how the tests judge a reply."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from duplex.audio import PcmFormat, decode
from duplex.client import load_wav_as
from duplex.stack import LocalStack
from realtime_service.protocol import PCM24K

FIXTURES = Path(__file__).parent / "fixtures"

#: tests/fixtures/hello.wav: 1.8 s of speech in 2 s (the parrot answers with as much audio).
HELLO = FIXTURES / "hello.wav"
HELLO_SPEECH_S = 1.8

#: A reply later than this after the end of the user's turn is late: the parrot's own delay is
#: its silence length (0.5 s) and a step or two; a reply that waited out a framework's 10 s
#: timeout (a response the framework could not match to its request) is what this catches.
LATE_S = 5.0

FRAME_MS = 20


def wav_pcm(path: Path = HELLO, fmt: PcmFormat = PCM24K, trailing_silence_ms: int = 0) -> bytes:
    silence = bytes(fmt.bytes_for_ms(trailing_silence_ms))
    return load_wav_as(path, fmt) + silence


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Wait until ``condition()`` holds (framework state, which has no event to wait on)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout_s:g}s") from None


def rms(pcm: bytes, fmt: PcmFormat = PCM24K) -> float:
    samples = decode(pcm, fmt)
    return float(np.sqrt(np.mean(np.square(samples)))) if len(samples) else 0.0


class Microphone:
    """20 ms chunks of 16-bit mono PCM at ``rate`` in real time: what it was told to ``say``,
    else silence."""

    def __init__(self, fmt: PcmFormat = PCM24K) -> None:
        self.fmt = fmt
        self.chunk_bytes = fmt.bytes_for_ms(FRAME_MS)
        self._queue: deque[bytes] = deque()
        self._next = 0.0
        self.said_at: float | None = None
        """When the last ``say`` was all spoken (``time.monotonic``): the end of the user's turn."""
        self.done = asyncio.Event()

    def say(self, pcm: bytes) -> None:
        self.done.clear()
        self.said_at = None
        for i in range(0, len(pcm), self.chunk_bytes):
            chunk = pcm[i : i + self.chunk_bytes]
            self._queue.append(chunk + bytes(self.chunk_bytes - len(chunk)))

    async def chunk(self) -> bytes:
        now = time.monotonic()
        if self._next == 0.0 or self._next < now - 0.2:
            self._next = now
        await asyncio.sleep(max(0.0, self._next - now))
        self._next += FRAME_MS / 1000
        if self._queue:
            chunk = self._queue.popleft()
            if not self._queue:
                self.said_at = time.monotonic()
                self.done.set()
            return chunk
        return bytes(self.chunk_bytes)


@pytest.fixture(scope="module")
def parrot_edge() -> Iterator[LocalStack]:
    """``duplex up --realtime-port 0``: a parrot worker, the session service and the edge."""
    with LocalStack(realtime_port=0) as stack:
        yield stack


def base_url(stack: LocalStack) -> str:
    """The edge as an OpenAI ``base_url`` (``http://HOST:PORT/v1``)."""
    return stack.realtime_url.replace("ws://", "http://")
