"""The model's audio waiting to be played on a call's track, and what of it has been played (no
I/O).

The session service sends a reply's audio as fast as the model makes it; the call's track plays
it in real time (``take``, one 20 ms frame at a time, silence when there is none). So the edge
knows, for each reply, how much the user has heard: a barge-in or ``output_audio_buffer.clear``
drops what is left (``clear``) and truncates the item where it was heard. The WebRTC-only events
of the GA API come from here: ``output_audio_buffer.started`` when a reply's first audio is
played, ``.stopped`` when a finished reply's last audio has been, ``.cleared`` when it is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from duplex.audio import PcmFormat


@dataclass(frozen=True)
class Started:
    response_id: str


@dataclass(frozen=True)
class Stopped:
    response_id: str


@dataclass(frozen=True)
class Cleared:
    response_id: str
    item_id: str
    played_ms: int
    """How much of the reply was played before it was dropped."""


Notice = Started | Stopped


@dataclass
class _Reply:
    response_id: str
    item_id: str
    pending: bytearray = field(default_factory=bytearray)
    played: int = 0
    """Bytes played."""
    started: bool = False
    done: bool = False
    """The response is over: no more audio comes."""


#: Replies remembered as cleared, so that audio of theirs still on its way is not played.
MAX_CLEARED = 32


class Playout:
    def __init__(self, fmt: PcmFormat) -> None:
        self.fmt = fmt
        self._replies: deque[_Reply] = deque()
        self._cleared: deque[str] = deque(maxlen=MAX_CLEARED)
        self.underruns = 0
        """Frames a reply still in progress had too little audio for (played partly silent)."""
        self.played_bytes = 0
        """Reply audio played in all."""

    def _find(self, response_id: str) -> _Reply | None:
        return next((r for r in self._replies if r.response_id == response_id), None)

    @property
    def pending_bytes(self) -> int:
        return sum(len(r.pending) for r in self._replies)

    @property
    def playing(self) -> bool:
        """Whether a reply is being played or waits to be (so a barge-in has something to stop)."""
        return any(r.pending or (r.started and not r.done) for r in self._replies)

    def push(self, response_id: str, item_id: str, pcm: bytes) -> None:
        """Audio of a reply, to be played after what is queued (dropped for a reply cleared)."""
        if response_id in self._cleared:
            return
        reply = self._find(response_id)
        if reply is None:
            reply = _Reply(response_id, item_id)
            self._replies.append(reply)
        if not reply.done:
            reply.pending += pcm

    def finish(self, response_id: str) -> list[Notice]:
        """The response is over; ``Stopped`` at once when all its audio was played already."""
        reply = self._find(response_id)
        if reply is None:
            return []
        reply.done = True
        if reply.pending:
            return []
        self._replies.remove(reply)
        return [Stopped(response_id)] if reply.started else []

    def take(self, nbytes: int) -> tuple[bytes, list[Notice]]:
        """The next ``nbytes`` to play (silence where there is no audio), and what they start
        and end."""
        out = bytearray()
        notices: list[Notice] = []
        while len(out) < nbytes and self._replies:
            reply = self._replies[0]
            if reply.pending:
                if not reply.started:
                    reply.started = True
                    notices.append(Started(reply.response_id))
                n = min(nbytes - len(out), len(reply.pending))
                out += reply.pending[:n]
                del reply.pending[:n]
                reply.played += n
                self.played_bytes += n
            if not reply.pending:
                if not reply.done:
                    if len(out) < nbytes and reply.started:
                        self.underruns += 1
                    break  # more of it is coming: wait for it, in silence
                self._replies.popleft()
                if reply.started:
                    notices.append(Stopped(reply.response_id))
        out += bytes(nbytes - len(out))
        return bytes(out), notices

    def clear(self, response_id: str | None = None) -> list[Cleared]:
        """Drop the audio of ``response_id`` (None: of every reply) still to be played; a
        ``Cleared`` for each reply that was playing or waiting to."""
        cleared: list[Cleared] = []
        for reply in list(self._replies):
            if response_id is not None and reply.response_id != response_id:
                continue
            if reply.pending or (reply.started and not reply.done):
                cleared.append(
                    Cleared(reply.response_id, reply.item_id, int(self.fmt.duration_ms(reply.played)))
                )
            self._replies.remove(reply)
            self._cleared.append(reply.response_id)
        if response_id is not None and response_id not in self._cleared:
            self._cleared.append(response_id)  # cancelled before any of its audio came
        return cleared
