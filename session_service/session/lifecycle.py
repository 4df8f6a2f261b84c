"""The states a session runner moves through, as explicit enums.

A runner's condition is the product of a few small, independent state machines; each is an
enum here so that a reader (and a log line) sees which one, and the transitions are named
where they happen in ``session_service.session.runner``:

- ``SessionStatus``: OPEN → CLOSED, on close (client, idle, drain, fenced, slow consumer); why
  it closed is a ``CloseReason``.
- ``InputStatus``: OPEN → ABANDONED when an append is lost with its write; back to OPEN on
  commit, clear, cancel or worker loss.
- ``TurnStatus``: LISTENING → COMMITTED on commit or turn end; back to LISTENING when a
  response starts or the worker is lost.
- ``SpeechStatus`` (held by ``worker_output``): SILENT ⇄ SPEAKING on the worker's VAD events;
  a turn end or worker loss closes the span.
- ``SeqStatus``: IN_EPOCH → RESTART_ALLOWED when the epoch moves; back to IN_EPOCH when the
  client's seq restarts at 1.
- ``OptionsStatus``: PENDING → CURRENT when a submission carries the session's model options;
  back to PENDING on an update, a new placement or a failed write.

Two reason enums live here too, so that every module may name them without importing the
module that acts on them: ``CloseReason`` (why a session closed; ``ENDED_FOR_GOOD`` are those
after which it is over) and ``DropReason`` (why worker output did not reach a client).

The response is not an enum but an object (``session_service.session.response.ActiveResponse``) that
exists exactly while a response is active.
"""

from __future__ import annotations

from enum import StrEnum


class SessionStatus(StrEnum):
    """Whether the session still takes events."""

    OPEN = "open"
    CLOSED = "closed"


class InputStatus(StrEnum):
    """Whether appends are taken."""

    OPEN = "open"
    ABANDONED = "abandoned"
    """An append was lost with its write: the input timeline has a hole, so later appends are
    refused (``input_abandoned``) until a commit, clear or cancel starts a new stretch."""


class TurnStatus(StrEnum):
    """The user's side of the turn."""

    LISTENING = "listening"
    """Nothing committed awaits an answer."""
    COMMITTED = "committed"
    """Committed input awaits a response (``response_create``, or auto-respond once the
    active response is done)."""


class SpeechStatus(StrEnum):
    """The worker's voice activity as the client has been told it."""

    SILENT = "silent"
    SPEAKING = "speaking"
    """``speech_started`` was sent and its ``speech_stopped`` not yet."""


class SeqStatus(StrEnum):
    """The client's append numbering."""

    IN_EPOCH = "in_epoch"
    """Seqs must keep increasing."""
    RESTART_ALLOWED = "restart_allowed"
    """The epoch moved: an append with seq 1 starts the new epoch's numbering (appends the
    client sent before it saw ``audio_cancelled`` still pass if they keep increasing)."""


class OptionsStatus(StrEnum):
    """Whether the worker has the session's current model options."""

    CURRENT = "current"
    PENDING = "pending"
    """The next submission carries them (first submission, update, new placement)."""


class CloseReason(StrEnum):
    """Why a session closed: the value is what ``SessionClosed.reason`` carries on the wire."""

    CLIENT_CLOSE = "client_close"
    """The client sent ``close`` (or half-closed its stream)."""
    IDLE_TIMEOUT = "idle_timeout"
    """No client event and no response for the idle timeout."""
    DETACHED = "detached"
    """The client's stream ended without ``close`` and no resume came within the grace."""
    SLOW_CONSUMER = "slow_consumer"
    """The client stopped reading: its outbound queue passed the limit."""
    INTERNAL_ERROR = "internal_error"
    """The runner's task ended unexpectedly."""
    RESUMED_ELSEWHERE = "resumed_elsewhere"
    """Another stream or replica took the session over (it lives on there)."""
    DRAINING = "draining"
    """The replica is draining (the session lives on wherever it is resumed)."""


#: Close reasons after which the session is over (its worker tombstones it; its token is dead).
#: A drained or fenced session lives on elsewhere.
ENDED_FOR_GOOD: frozenset[CloseReason] = frozenset(
    {
        CloseReason.CLIENT_CLOSE,
        CloseReason.IDLE_TIMEOUT,
        CloseReason.DETACHED,
        CloseReason.SLOW_CONSUMER,
        CloseReason.INTERNAL_ERROR,
    }
)


class DropReason(StrEnum):
    """Why worker output did not reach a client (the table in the docstring of
    ``session_service.session.worker_output``, which also creates every reason's series)."""

    STALE_EPOCH = "stale_epoch"
    STALE_TURN = "stale_turn"
    RESPONSE_CANCELLED = "response_cancelled"
    WRONG_SESSION = "wrong_session"
    UNKNOWN_REQUEST = "unknown_request"
    STALE_WORKER = "stale_worker"
    PURGED = "purged"
    FAIL_CLOSED = "fail_closed"
