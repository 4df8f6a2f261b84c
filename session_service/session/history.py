"""The conversation a language model in the loop sees, as the user heard it (state, no I/O).

A plugin whose model reads the whole conversation every turn (a chat stage: ``history_policy``)
gets a ``ChatHistory`` in its session: the user's transcripts, the assistant's replies, the
tool calls it made and their results, bounded by a ``HistoryPolicy`` (turns and characters; the
oldest turns go first, whole). The instructions are the session's settings, not kept here.

What a reply adds is what the user heard of it, not what the model wrote. Each reply has a
playback ledger: what was generated (the model's text), where each spoken sentence starts in the
reply's audio (the TTS stage's text comes with each sentence's first frame), how much of that
audio went out to the client (``sent``), and how much of it the client says was played
(``playback_ack``; the Realtime edge's ``conversation.item.truncate``). A reply that completed
and was not cut enters whole; one cut (cancelled by a barge-in, or a playback position reported
short of its end) enters only with the sentences whose audio started before the cut: the model
never believes it said what the user never heard begin (a sentence heard in part counts whole:
the ledger knows where sentences start, not where each word does). A cut reported after the
reply ended still cuts it (a client plays what it got after the server is done).

Tool calls: a call the model made is ``PENDING`` until the client answers it (``answer``); the
answer goes into the history and the model is owed a reply (``awaiting_reply``). A call of a
reply that did not complete (a barge-in cancelled it) is ``CANCELLED``, with a note the model
reads as its result; an answer to it later, or a second answer to any call, is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from duplex.errors import BadEventError, ErrorCode, echo

#: Replies whose ledger is kept for a late playback position (a client that truncates an older
#: reply than these is not heard: that reply entered as it was).
MAX_LEDGERS: Final = 8
#: What a cancelled call's result says to the model.
CANCELLED_NOTE: Final = '{"status": "cancelled", "reason": "the user interrupted before the result came"}'
#: What an unanswered call's result says to the model (the client has not answered it yet).
PENDING_NOTE: Final = '{"status": "pending", "reason": "no result yet"}'


class CallStatus(StrEnum):
    PENDING = "pending"
    ANSWERED = "answered"
    CANCELLED = "cancelled"


class Role(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class HistoryPolicy:
    """How much of the conversation a session keeps for its model."""

    max_turns: int = 32
    """The user's turns kept (each with the replies and tool calls after it)."""
    max_chars: int = 24_000
    """Characters kept in all (texts, tool arguments and results); the oldest turns go first.
    A tool result longer than half of this is cut to it."""


@dataclass(slots=True, eq=False)
class ToolCall:
    call_id: str
    name: str
    arguments: str
    status: CallStatus = CallStatus.PENDING
    output: str = ""
    """The client's answer (``ANSWERED``)."""

    @property
    def result(self) -> str:
        """What the model reads as the call's result."""
        if self.status is CallStatus.ANSWERED:
            return self.output
        return CANCELLED_NOTE if self.status is CallStatus.CANCELLED else PENDING_NOTE


@dataclass(slots=True, eq=False)
class Message:
    """One message of the history: the user's words, or a reply (its heard text and its calls)."""

    role: Role
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    ledger: Ledger | None = None
    """A reply's playback ledger while it is kept (its text is then the ledger's heard text)."""

    @property
    def content(self) -> str:
        return self.ledger.heard() if self.ledger is not None else self.text

    def chars(self) -> int:
        return len(self.content) + sum(len(c.arguments) + len(c.result) for c in self.calls)


@dataclass(slots=True, eq=False)
class Ledger:
    """One reply's playback ledger: generated, sent, played (milliseconds of the reply's audio)."""

    response_id: str
    generated: str = ""
    sentences: list[tuple[float, str]] = field(default_factory=list)
    """(where its audio starts, its text) of each sentence spoken, in order."""
    sent_ms: float = 0.0
    played_ms: float | None = None
    ended: bool = False
    completed: bool = False

    def heard(self, *, so_far: bool = False) -> str:
        """The reply as the user heard it (see the module docstring); ``so_far``: of a reply still
        going, only what went out yet (what a resume token may carry while it goes on)."""
        cut = (self.ended and not self.completed) or (so_far and not self.ended)
        limit = self.sent_ms if cut else float("inf")
        if self.played_ms is not None:
            limit = min(limit, self.played_ms)
        if limit == float("inf"):
            return self.generated.strip()  # all of it (or, still going, all it will say)
        return " ".join(text.strip() for at, text in self.sentences if at < limit and text.strip())


class ChatHistory:
    """One session's conversation for its model (see the module docstring)."""

    def __init__(self, policy: HistoryPolicy) -> None:
        self.policy = policy
        self.messages: list[Message] = []
        self._ledgers: OrderedDict[str, Message] = OrderedDict()
        self.awaiting_reply = False
        """Something the model has not answered yet came in (the user's words, a tool's result)."""

    # ---- what comes in ---------------------------------------------------------------------------

    def user(self, text: str) -> None:
        """The user's words of a committed turn (nothing when none were recognized)."""
        text = text.strip()
        if text:
            self.messages.append(Message(Role.USER, text))
            self.awaiting_reply = True
            self._bound()

    def begin_reply(self, response_id: str) -> None:
        """A reply to what the model is owed begins (its message fills as it goes)."""
        msg = Message(Role.ASSISTANT, ledger=Ledger(response_id))
        self.messages.append(msg)
        self._ledgers[response_id] = msg
        while len(self._ledgers) > MAX_LEDGERS:
            _, old = self._ledgers.popitem(last=False)
            self._settle(old)
        self.awaiting_reply = False

    def generated(self, response_id: str, text: str) -> None:
        """The model wrote ``text`` (the next piece of the reply)."""
        led = self._ledger(response_id)
        if led is not None and not led.ended:
            led.generated += text

    def spoken(self, response_id: str, at_ms: float, text: str) -> None:
        """A sentence's audio starts ``at_ms`` into the reply's audio."""
        led = self._ledger(response_id)
        if led is not None and not led.ended:
            led.sentences.append((at_ms, text))

    def sent(self, response_id: str, end_ms: float) -> None:
        """The reply's audio up to ``end_ms`` went out to the client."""
        led = self._ledger(response_id)
        if led is not None:
            led.sent_ms = max(led.sent_ms, end_ms)

    def played(self, response_id: str, played_ms: float) -> bool:
        """The client played ``played_ms`` of the reply (its last word on it counts); whether the
        reply's ledger is kept."""
        led = self._ledger(response_id)
        if led is None:
            return False
        led.played_ms = played_ms
        return True

    def tool_call(self, response_id: str, call_id: str, name: str, arguments: str) -> None:
        """The reply called a tool (its arguments whole)."""
        msg = self._ledgers.get(response_id)
        if msg is not None:
            msg.calls.append(ToolCall(call_id, name, arguments))
            self._bound()

    def reply_ended(self, response_id: str, *, completed: bool) -> None:
        """The reply ended; one that did not complete cancels its unanswered calls."""
        msg = self._ledgers.get(response_id)
        if msg is None or msg.ledger is None:
            return
        msg.ledger.ended, msg.ledger.completed = True, completed
        if not completed:
            for call in msg.calls:
                if call.status is CallStatus.PENDING:
                    call.status = CallStatus.CANCELLED
        self._bound()

    def answer(self, call_id: str, output: str) -> None:
        """The client's result of a call; raises ``BadEventError`` (``unknown_call_id``,
        ``function_call_answered``, ``function_call_cancelled``)."""
        call = self._call(call_id)
        if call is None:
            raise BadEventError(ErrorCode.UNKNOWN_CALL_ID, f"no call {echo(call_id)} of the model is kept")
        if call.status is CallStatus.ANSWERED:
            raise BadEventError(
                ErrorCode.FUNCTION_CALL_ANSWERED, f"call {echo(call_id)} was answered already"
            )
        if call.status is CallStatus.CANCELLED:
            raise BadEventError(
                ErrorCode.FUNCTION_CALL_CANCELLED,
                f"call {echo(call_id)} was cancelled with its reply (a barge-in): the model was told so",
            )
        call.status, call.output = CallStatus.ANSWERED, output[: self.policy.max_chars // 2]
        self.awaiting_reply = True
        self._bound()

    def pending_calls(self) -> list[str]:
        return [c.call_id for m in self.messages for c in m.calls if c.status is CallStatus.PENDING]

    # ---- bounds ----------------------------------------------------------------------------------

    def chars(self) -> int:
        return sum(m.chars() for m in self.messages)

    def _bound(self) -> None:
        """The oldest turns go, whole (a reply with its calls and their results stays together),
        while more than the policy's turns or characters are kept; the newest turn stays."""
        p = self.policy
        turns = sum(m.role is Role.USER for m in self.messages)
        while len(self.messages) > 1 and (turns > p.max_turns or self.chars() > p.max_chars):
            cut = 1
            while cut < len(self.messages) and self.messages[cut].role is not Role.USER:
                cut += 1
            if cut >= len(self.messages):
                break  # one turn left: it stays
            for msg in self.messages[:cut]:
                turns -= msg.role is Role.USER
                if msg.ledger is not None:
                    self._ledgers.pop(msg.ledger.response_id, None)
            del self.messages[:cut]

    # ---- lookups -----------------------------------------------------------------------------

    def _ledger(self, response_id: str) -> Ledger | None:
        msg = self._ledgers.get(response_id)
        return msg.ledger if msg is not None else None

    def _call(self, call_id: str) -> ToolCall | None:
        for msg in reversed(self.messages):
            for call in msg.calls:
                if call.call_id == call_id:
                    return call
        return None

    @staticmethod
    def _settle(msg: Message) -> None:
        """A reply whose ledger is no longer kept keeps its heard text as it stands."""
        if msg.ledger is not None:
            msg.text, msg.ledger = msg.ledger.heard(), None

    # ---- what a resume token carries ---------------------------------------------------------

    def records(self) -> list[list[object]]:
        """The history as plain JSON records, oldest first: ``["u", text]`` and ``["a", text,
        [[call_id, name, arguments, status, output], ...]]`` (what a resume token carries)."""
        out: list[list[object]] = []
        for m in self.messages:
            if m.role is Role.USER:
                out.append(["u", m.text])
            else:
                calls = [[c.call_id, c.name, c.arguments, c.status.value, c.output] for c in m.calls]
                heard = m.ledger.heard(so_far=True) if m.ledger is not None else m.text
                out.append(["a", heard, calls])
        return out

    @classmethod
    def from_records(cls, records: object, policy: HistoryPolicy) -> ChatHistory:
        """A history rebuilt from ``records``; raises ``ValueError`` for malformed ones."""
        history = cls(policy)
        if not isinstance(records, list | tuple):
            raise ValueError("history records must be a list")
        for rec in records:
            if not isinstance(rec, list | tuple) or not rec or rec[0] not in ("u", "a"):
                raise ValueError("bad history record")
            if rec[0] == "u" and len(rec) == 2 and isinstance(rec[1], str):
                history.messages.append(Message(Role.USER, rec[1]))
            elif rec[0] == "a" and len(rec) == 3 and isinstance(rec[1], str) and isinstance(rec[2], list):
                history.messages.append(Message(Role.ASSISTANT, rec[1], [_call(c) for c in rec[2]]))
            else:
                raise ValueError("bad history record")
        history._bound()
        return history


def _call(rec: object) -> ToolCall:
    if not isinstance(rec, list | tuple) or len(rec) != 5 or not all(isinstance(x, str) for x in rec):
        raise ValueError("bad tool call record")
    call_id, name, arguments, status, output = rec
    return ToolCall(call_id, name, arguments, CallStatus(status), output)
