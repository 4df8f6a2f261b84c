"""The states a session runner moves through, as explicit enums.

A runner's condition is the product of a few small, independent state machines; each is an
enum here so that a reader (and a log line) sees which one, and the transitions are named
where they happen in ``session_service.session.runner``:

- ``SessionStatus``: OPEN → CLOSED, on close (client, idle, drain, fenced, slow consumer).
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
