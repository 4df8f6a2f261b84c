"""The input a session's worker holds for the current turn, kept so another worker can rebuild it.

A worker's model state for a session (VAD state, uncommitted input, the committed utterance a
response answers) dies with the worker. To let a turn survive its worker, the runner keeps what
it handed on since that state last stopped mattering, in worker frames, in order, with the
commits between them: the input appended since the last commit, and the committed input of a
response that has not ended. When the session moves to another worker it replays the log there
(``plan``) before anything new, then restarts the interrupted response.

What is kept, and when it goes:

- every APPEND the runner hands on (client audio and fed silence) is a chunk, in order; a chunk
  the worker reported consumed (``RequestUpdate.input_seq``) had its news (VAD, turn ends)
  reported already, so it is replayed with ``Submission.replay`` and its news are not repeated;
- an explicit COMMIT is a marker replayed as a COMMIT; a commit the worker's turn detection made
  (``turn_ended``) is a marker too, placed after the last chunk reported consumed, and is not
  replayed (the model finds the same turn end in the same input);
- when a response ends (completed, cancelled, failed for a reason of its own) the utterance it
  answered is no longer needed: everything up to its marker goes;
- CLEAR drops the chunks after the last marker (the worker dropped them too), and a new epoch
  drops chunks of older epochs the worker had not consumed (it drops them too);
- the log is bounded (``max_bytes``): past it the oldest chunks go and the log is ``trimmed``
  (a replay then rebuilds the most recent input only).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Chunk", "Marker", "ReplayAppend", "ReplayLog"]


@dataclass(slots=True, eq=False)
class Chunk:
    """Worker frames handed on under one APPEND."""

    frames: bytes
    epoch: int
    seq: int
    consumed: bool = False
    """The current worker reported it consumed."""
    reported: bool = False
    """Some worker consumed it and reported its news (they are not repeated on a replay)."""


@dataclass(slots=True, eq=False)
class Marker:
    """A commit point in the input."""

    explicit: bool
    """A COMMIT the runner sent (replayed as one); else the model's own turn detection."""


class ReplayLog:
    """The current turn's input, as handed on, for replay on another worker."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[Chunk | Marker] = deque()
        self._bytes = 0
        self.trimmed = False
        """Chunks were dropped for the bound since the log last emptied."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Chunk | Marker]:
        return iter(self._items)

    @property
    def size(self) -> int:
        return self._bytes

    def appended(self, frames: bytes, *, epoch: int, seq: int) -> None:
        """An APPEND of ``frames`` was handed on under worker ``seq`` in ``epoch``."""
        if not frames:
            return
        self._items.append(Chunk(frames, epoch, seq))
        self._bytes += len(frames)
        while self._bytes > self.max_bytes:
            first = self._items[0]
            if isinstance(first, Chunk):
                self._bytes -= len(first.frames)
                self.trimmed = True
            self._items.popleft()

    def consumed(self, *, epoch: int, seq: int) -> None:
        """The worker consumed every APPEND of ``epoch`` up to ``seq``."""
        # Newest first: everything before the newest consumed chunk is consumed already.
        for item in reversed(self._items):
            if isinstance(item, Chunk) and item.epoch == epoch and item.seq <= seq:
                if item.consumed:
                    break
                item.consumed = item.reported = True

    def committed(self) -> Marker:
        """The runner sent a COMMIT after the chunks so far."""
        marker = Marker(explicit=True)
        self._items.append(marker)
        return marker

    def turn_ended(self) -> Marker:
        """The worker's turn detection committed: the commit point lies after the chunks it
        reported consumed (and at most within the next one)."""
        marker = Marker(explicit=False)
        at = len(self._items)
        while at > 0:
            item = self._items[at - 1]
            if isinstance(item, Chunk) and not item.reported:
                at -= 1
                continue
            break
        self._items.insert(at, marker)
        return marker

    def last_marker(self) -> Marker | None:
        """The latest commit point (what a response started now answers)."""
        for item in reversed(self._items):
            if isinstance(item, Marker):
                return item
        return None

    def answered(self, marker: Marker | None) -> None:
        """The response to the input up to ``marker`` ended: that input is no longer needed."""
        if marker is None or not any(item is marker for item in self._items):
            return  # trimmed away already, with everything before it
        while self._items:
            item = self._items.popleft()
            if isinstance(item, Chunk):
                self._bytes -= len(item.frames)
            if item is marker:
                break
        if not self._items:
            self.trimmed = False

    def cleared(self) -> None:
        """CLEAR: the input after the last commit is gone at the worker."""
        while self._items and isinstance(self._items[-1], Chunk):
            chunk = self._items.pop()
            assert isinstance(chunk, Chunk)
            self._bytes -= len(chunk.frames)

    def new_epoch(self, epoch: int) -> None:
        """The epoch moved to ``epoch``: the worker drops queued input of older epochs."""
        kept: deque[Chunk | Marker] = deque()
        for item in self._items:
            if isinstance(item, Chunk) and item.epoch < epoch and not item.consumed:
                self._bytes -= len(item.frames)
                continue
            kept.append(item)
        self._items = kept

    def clear(self) -> None:
        """Forget everything (the session cannot replay, or starts over)."""
        self._items.clear()
        self._bytes = 0
        self.trimmed = False

    def plan(self, max_append_bytes: int) -> list[ReplayAppend | Marker]:
        """What to replay, in order: APPENDs (consecutive chunks of one kind merged up to
        ``max_append_bytes``) and explicit commit markers."""
        out: list[ReplayAppend | Marker] = []
        current: ReplayAppend | None = None
        for item in self._items:
            if isinstance(item, Marker):
                if item.explicit:
                    current = None
                    out.append(item)
                continue
            if (
                current is None
                or current.replay != item.reported
                or current.size + len(item.frames) > max_append_bytes
            ):
                current = ReplayAppend(replay=item.reported)
                out.append(current)
            current.chunks.append(item)
            current.size += len(item.frames)
        return out


@dataclass(slots=True)
class ReplayAppend:
    """One APPEND of a replay: chunks of the log, all reported already or none."""

    replay: bool
    chunks: list[Chunk] = field(default_factory=list)
    size: int = 0

    @property
    def frames(self) -> bytes:
        return b"".join(c.frames for c in self.chunks)

    def handed_on(self, *, epoch: int, seq: int) -> None:
        """It was written to the new worker under ``seq``: its chunks live there now."""
        for chunk in self.chunks:
            chunk.epoch, chunk.seq, chunk.consumed = epoch, seq, False
