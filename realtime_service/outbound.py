"""What waits to be written to one WebSocket (no I/O).

Bounded in bytes: a client that stops reading while a reply streams is cut off
(``overflowed``) rather than held in memory. When a response is cancelled its audio still
waiting here is dropped: no audio of a cancelled response reaches the client after the edge
has learnt of the cancel.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Frame:
    text: str
    audio_of: str = ""
    """The response whose audio this is ("" for any other event)."""


class Outbound:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._frames: deque[Frame] = deque()
        self.queued_bytes = 0
        self.overflowed = False
        self.closed = False
        self.overflow = asyncio.Event()
        """Set once the bound was passed (the writer may be stuck in a write meanwhile)."""
        self._ready = asyncio.Event()

    def put(self, frame: Frame) -> None:
        """Queue a frame; past the bound the queue is marked ``overflowed`` (the connection ends)."""
        if self.closed:
            return
        self._frames.append(frame)
        self.queued_bytes += len(frame.text)
        if self.queued_bytes > self.limit_bytes:
            self.overflowed = True
            self.overflow.set()
        self._ready.set()

    def drop_audio(self, response_id: str) -> int:
        """Drop the unsent audio of ``response_id``; returns how many frames went."""
        kept = deque(f for f in self._frames if f.audio_of != response_id or not response_id)
        dropped = len(self._frames) - len(kept)
        if dropped:
            self._frames = kept
            self.queued_bytes = sum(len(f.text) for f in kept)
        return dropped

    def close(self) -> None:
        """Nothing more is queued; ``get`` returns None once the queue is empty."""
        self.closed = True
        self._ready.set()

    async def get(self) -> Frame | None:
        """The next frame to write, or None once closed and empty (or overflowed)."""
        while not self._frames:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self.overflowed:
            return None
        frame = self._frames.popleft()
        self.queued_bytes -= len(frame.text)
        return frame
