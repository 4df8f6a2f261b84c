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
- CLEAR drops the chunks after the last marker (the worker dropped them too); a cancel's new
  epoch keeps them (the worker keeps the input it holds, under the new epoch);
- when the turn is given up (no worker took the session over, or the model cannot be replayed)
  everything goes (``clear``): replayed later, it would begin the next turn;
- the log is bounded in two parts, each by ``max_bytes``: the input after the newest commit
  (what the user is saying now), and the committed input before it (what a response answers).
  Past a bound the oldest chunks of that part go and the log is ``trimmed`` (a replay then
  rebuilds the most recent input only), so a long reply fed with silence never pushes out the
  utterance it answers.

Each chunk keeps the turn it was appended under: a replay writes it under that turn again, so
speech in input appended before a response (the utterance it answers) cannot barge in on the
restarted response, while speech appended during it still can.
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
    turn_id: int = 0
    """The turn of the APPEND's fence."""
    consumed: bool = False
    """The current worker reported it consumed."""
    reported: bool = False
    """Some worker consumed it and reported its news (they are not repeated on a replay)."""


@dataclass(slots=True, eq=False)
class Marker:
    """A commit point in the input."""

    explicit: bool
    """A COMMIT the runner sent (replayed as one); else the model's own turn detection."""
    turn_id: int = 0
    """The turn of the COMMIT's fence."""


class ReplayLog:
    """The current turn's input, as handed on, for replay on another worker.

    Two parts: ``_head``, everything up to and including the newest commit marker, and
    ``_tail``, the chunks after it; so an append and the bound cost O(1)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        """The bound of each part: the input after the newest commit, and the input before it."""
        self._head: deque[Chunk | Marker] = deque()
        self._tail: deque[Chunk] = deque()
        self._head_bytes = 0
        self._tail_bytes = 0
        self.trimmed = False
        """Chunks were dropped for the bound since the log last emptied."""

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __iter__(self) -> Iterator[Chunk | Marker]:
        yield from self._head
        yield from self._tail

    @property
    def size(self) -> int:
        return self._head_bytes + self._tail_bytes

    def appended(self, frames: bytes, *, epoch: int, seq: int, turn_id: int = 0) -> None:
        """An APPEND of ``frames`` was handed on under worker ``seq`` in ``epoch``."""
        if not frames or not self.max_bytes:  # a log of no bytes keeps nothing (no replays)
            return
        self._tail.append(Chunk(frames, epoch, seq, turn_id))
        self._tail_bytes += len(frames)
        while self._tail_bytes > self.max_bytes and len(self._tail) > 1:
            self._tail_bytes -= len(self._tail.popleft().frames)
            self.trimmed = True

    def _trim_head(self) -> None:
        """The oldest items before the newest marker go until that part fits."""
        while self._head_bytes > self.max_bytes and len(self._head) > 1:
            first = self._head.popleft()
            if isinstance(first, Chunk):
                self._head_bytes -= len(first.frames)
                self.trimmed = True

    def consumed(self, *, epoch: int, seq: int) -> None:
        """The worker consumed every APPEND of ``epoch`` up to ``seq``."""
        # Newest first: everything before the newest consumed chunk is consumed already.
        for item in self._newest_first():
            if isinstance(item, Chunk) and item.epoch == epoch and item.seq <= seq:
                if item.consumed:
                    break
                item.consumed = item.reported = True

    def _newest_first(self) -> Iterator[Chunk | Marker]:
        yield from reversed(self._tail)
        yield from reversed(self._head)

    def _close_tail(self, keep: int, marker: Marker) -> None:
        """The first ``keep`` chunks of the tail and then ``marker`` join the head."""
        for _ in range(keep):
            chunk = self._tail.popleft()
            self._tail_bytes -= len(chunk.frames)
            self._head_bytes += len(chunk.frames)
            self._head.append(chunk)
        self._head.append(marker)
        self._trim_head()

    def committed(self, turn_id: int = 0) -> Marker:
        """The runner sent a COMMIT (under ``turn_id``) after the chunks so far."""
        marker = Marker(explicit=True, turn_id=turn_id)
        self._close_tail(len(self._tail), marker)
        return marker

    def turn_ended(self) -> Marker:
        """The worker's turn detection committed: the commit point lies after the chunks it
        reported consumed (and at most within the next one)."""
        marker = Marker(explicit=False)
        keep = len(self._tail)
        while keep > 0 and not self._tail[keep - 1].reported:
            keep -= 1
        self._close_tail(keep, marker)
        return marker

    def last_marker(self) -> Marker | None:
        """The latest commit point (what a response started now answers)."""
        if self._head and isinstance(self._head[-1], Marker):
            return self._head[-1]
        return None

    def holds(self, marker: Marker | None) -> bool:
        """Whether ``marker`` (and so the input it ends) is still in the log."""
        return marker is not None and any(item is marker for item in self._head)

    def answered(self, marker: Marker | None) -> None:
        """The response to the input up to ``marker`` ended: that input is no longer needed."""
        if not self.holds(marker):
            return  # trimmed away already, with everything before it
        while self._head:
            item = self._head.popleft()
            if isinstance(item, Chunk):
                self._head_bytes -= len(item.frames)
            if item is marker:
                break
        if not self._head and not self._tail:
            self.trimmed = False
        self._rebalance()

    def _rebalance(self) -> None:
        """After the head lost items: chunks after its last marker belong to the tail."""
        moved: list[Chunk] = []
        while self._head and isinstance(self._head[-1], Chunk):
            chunk = self._head.pop()
            assert isinstance(chunk, Chunk)
            self._head_bytes -= len(chunk.frames)
            moved.append(chunk)
        for chunk in moved:  # newest was popped first
            self._tail.appendleft(chunk)
            self._tail_bytes += len(chunk.frames)

    def cleared(self) -> None:
        """CLEAR: the input after the last commit is gone at the worker."""
        self._tail.clear()
        self._tail_bytes = 0

    def new_epoch(self, epoch: int) -> None:
        """The epoch moved to ``epoch`` by a cancel: the worker keeps the input it had not consumed
        and takes it under ``epoch`` (``Abort.keep_input``), with its seqs; so does the log."""
        for item in self:
            if isinstance(item, Chunk) and item.epoch < epoch:
                item.epoch = epoch

    def clear(self) -> None:
        """Forget everything (the session cannot replay, or starts over)."""
        self._head.clear()
        self._tail.clear()
        self._head_bytes = self._tail_bytes = 0
        self.trimmed = False

    def plan(self, max_append_bytes: int) -> list[ReplayAppend | Marker]:
        """What to replay, in order: APPENDs (consecutive chunks of one turn and kind merged up
        to ``max_append_bytes``) and explicit commit markers."""
        out: list[ReplayAppend | Marker] = []
        current: ReplayAppend | None = None
        for item in self:
            if isinstance(item, Marker):
                if item.explicit:
                    current = None
                    out.append(item)
                continue
            if (
                current is None
                or current.replay != item.reported
                or current.turn_id != item.turn_id
                or current.size + len(item.frames) > max_append_bytes
            ):
                current = ReplayAppend(replay=item.reported, turn_id=item.turn_id)
                out.append(current)
            current.chunks.append(item)
            current.size += len(item.frames)
        return out


@dataclass(slots=True)
class ReplayAppend:
    """One APPEND of a replay: chunks of the log of one turn, all reported already or none."""

    replay: bool
    turn_id: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    size: int = 0

    @property
    def frames(self) -> bytes:
        return b"".join(c.frames for c in self.chunks)

    def handed_on(self, *, epoch: int, seq: int) -> None:
        """It was written to the new worker under ``seq``: its chunks live there now."""
        for chunk in self.chunks:
            chunk.epoch, chunk.seq, chunk.consumed = epoch, seq, False
