"""What crosses between the asyncio side and the engine thread, in domain form.

Submission kinds, the queued ``Work`` and its ``QueueCounter``, the ordered engine commands
(``Enqueue``, ``AbortOlder``, ``ReleaseSession``), and the results the engine hands back
(``Update``, ``OwnerStep``). They live apart from ``engine`` so that command handling, delivery
and conversion can name them without the engine thread's machinery; ``engine`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from duplex.errors import ErrorCode, InternalError
from duplex.fence import Fence
from duplex.v1 import common_pb2, worker_pb2
from worker_service.model import FloatArray, ToolCallPiece

APPEND = worker_pb2.SUBMISSION_KIND_APPEND
COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
TEXT = worker_pb2.SUBMISSION_KIND_TEXT
#: Work of the reply's side: dropped by any newer epoch (input of the other kinds survives the
#: owner's cancel, ``Abort.keep_input``).
REPLY_KINDS = frozenset({RESPOND, TEXT})


class QueueCounter:
    """A request's queued input in units (frames; 1 per non-APPEND submission).

    Lock-free across threads: only the asyncio side writes ``submitted`` and only the engine
    writes ``retired``, so ``depth`` is at worst a little stale, never corrupt.
    """

    __slots__ = ("retired", "submitted")

    def __init__(self) -> None:
        self.submitted = 0
        self.retired = 0

    @property
    def depth(self) -> int:
        return self.submitted - self.retired


@dataclass(slots=True, eq=False)
class Work:
    """One submission, queued for its request."""

    kind: worker_pb2.SubmissionKind.ValueType
    fence: Fence
    owner: str
    request_id: str
    seq: int = 0
    frames: FloatArray | None = None
    """APPEND: ``(n, frame_samples)`` float32."""
    pos: int = 0
    """APPEND: frames consumed so far."""
    options: object | None = None
    """Parsed ``params`` to apply before the submission's effect."""
    replay: bool = False
    """APPEND: input replayed after a move; its news were reported by the worker that first
    consumed it, so only its consumption is reported (``Submission.replay``)."""
    text: str = ""
    """TEXT: a piece of the reply's text input."""
    text_final: bool = False
    """TEXT: the last piece."""

    @property
    def units(self) -> int:
        """Queue units this work still holds."""
        return len(self.frames) - self.pos if self.frames is not None else 1


@dataclass(frozen=True, slots=True)
class Enqueue:
    work: Work
    counter: QueueCounter


@dataclass(frozen=True, slots=True)
class AbortOlder:
    """Drop the session's queued and running work of epochs below ``epoch``; with
    ``keep_input`` (the owner's cancel: ``Abort.keep_input``) only its reply and RESPONDs go, and
    its queued input is taken under ``epoch``."""

    session_id: str
    epoch: int
    keep_input: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseSession:
    session_id: str


@dataclass(frozen=True, slots=True)
class CommandMark:
    """Run stream ``stream`` of ``owner`` has had ``count`` commands handled, all of their work
    queued before this mark (``count`` 0: the stream ended; its mark is dropped)."""

    owner: str
    stream: int
    count: int


EngineCommand = Enqueue | AbortOlder | ReleaseSession | CommandMark


class CommandMarks:
    """The engine thread's last ``CommandMark`` of each owner's open Run stream."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[int, int]] = {}  # owner -> (its stream, commands handled)

    def apply(self, mark: CommandMark) -> None:
        if mark.count:
            self._marks[mark.owner] = (mark.stream, mark.count)
        elif self._marks.get(mark.owner, (0, 0))[0] == mark.stream:
            del self._marks[mark.owner]  # that stream ended (a newer one of the owner keeps its own)

    def count(self, owner: str) -> int:
        """Commands of ``owner``'s stream applied so far (0: none known)."""
        mark = self._marks.get(owner)
        return mark[1] if mark is not None else 0

    def __len__(self) -> int:
        return len(self._marks)


@dataclass(slots=True)
class Update:
    """Per-request news for one owner (``RequestUpdate`` in domain form)."""

    request_id: str
    fence: Fence
    vad: list[tuple[worker_pb2.VadEvent.Kind.ValueType, int]] = field(default_factory=list)
    text: str = ""
    input_seq: int = 0
    turn_ended: bool = False
    committed_samples: int = 0
    response_started: bool = False
    response_finished: bool = False
    error: tuple[str, str] | None = None
    user_text: str = ""
    user_transcript: str | None = None
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


@dataclass(slots=True)
class OwnerStep:
    """One step as one owner sees it (``StepOutput`` in domain form); ``step`` 0 = news only."""

    step: int
    batch: list[tuple[str, Fence]] = field(default_factory=list)
    output_type: worker_pb2.OutputType.ValueType = worker_pb2.OUTPUT_TYPE_UNSPECIFIED
    sparse: bool = True
    audio_ids: list[str] = field(default_factory=list)
    """Sparse: the owner's request ids, aligned to ``audio``."""
    audio: list[common_pb2.AudioPayload] = field(default_factory=list)
    """Sparse: aligned to ``audio_ids``; dense: aligned to ``batch``."""
    input_seq: list[int] = field(default_factory=list)
    """Aligned to ``batch``: the request's highest APPEND seq consumed where this step moved it,
    else 0 (the acks: one per request nearly every step, so a column, not an ``Update``)."""
    updates: list[Update] = field(default_factory=list)
    """News other than ``input_seq`` (for a step, of requests in its batch, in batch order)."""
    next_tick_at: float = 0.0
    """Frame clock: ``time.monotonic()`` of the engine's next tick as this step ended (0: the
    free clock); sent as ``StepOutput.next_tick_us``."""
    commands_applied: int = 0
    """Frame clock: the owner's stream's commands applied when the tick began (its last
    ``CommandMark``); sent as ``StepOutput.commands_applied``."""
    held: list[str] = field(default_factory=list)
    """Reconciliation (``step`` 0, first on a new Run stream): sessions the worker held for the
    owner when the stream opened; sent as ``held_sessions`` with their fences as they are when
    sent (those released meanwhile are left out)."""


Sink = Callable[[list[tuple[str, OwnerStep]]], None]
"""Receives each iteration's per-owner results on the engine thread; must never block."""


class EngineDeadError(InternalError):
    """The engine thread stopped on a fatal error; the worker no longer serves."""

    def __init__(self) -> None:
        super().__init__(ErrorCode.INTERNAL, "the worker's engine failed", retryable=True)
