"""A reply's tool calls, as a chat stage streams them: pieces in, client events out (no I/O).

The chat stage's worker reports each call in pieces (``worker_pb2.ToolCallNews``: the first names
the tool, each adds to its arguments, the last is ``done``). ``ReplyCalls`` turns them into the
client's ``function_call_delta`` events as they come and one ``function_call`` per call once it
is whole, and says which calls are whole (they go into the session's history). Bounded: a reply
makes at most ``MAX_CALLS`` calls, each with at most ``MAX_ARGUMENT_CHARS`` of arguments; past a
bound the reply fails (``ToolCallError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import session_pb2, worker_pb2

MAX_CALLS: Final = 16
MAX_ARGUMENT_CHARS: Final = 32_768
MAX_NAME_CHARS: Final = 128


class ToolCallError(BadEventError):
    """The model's tool calls broke a bound (the reply fails ``model_error``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.MODEL_ERROR, message)


@dataclass(frozen=True, slots=True)
class WholeCall:
    call_id: str
    name: str
    arguments: str


@dataclass(slots=True)
class _Open:
    name: str
    arguments: list[str]
    chars: int = 0


class ReplyCalls:
    """One reply's tool calls (see the module docstring)."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self._open: dict[str, _Open] = {}
        self.done: list[WholeCall] = []

    @property
    def count(self) -> int:
        return len(self._open) + len(self.done)

    def take(
        self, pieces: Sequence[worker_pb2.ToolCallNews]
    ) -> tuple[list[session_pb2.ServerEvent], list[WholeCall]]:
        """The events for ``pieces``, and the calls they completed; raises ``ToolCallError``."""
        events: list[session_pb2.ServerEvent] = []
        whole: list[WholeCall] = []
        for p in pieces:
            call = self._open.get(p.call_id)
            if call is None:
                if any(c.call_id == p.call_id for c in self.done) or not p.call_id:
                    raise ToolCallError("the model wrote to a tool call that was done, or one without an id")
                if self.count >= MAX_CALLS:
                    raise ToolCallError(f"the model made more than {MAX_CALLS} tool calls in one reply")
                if not p.name or len(p.name) > MAX_NAME_CHARS:
                    raise ToolCallError("the model called a tool without a name (or one too long)")
                call = self._open[p.call_id] = _Open(p.name, [])
            if p.arguments:
                call.chars += len(p.arguments)
                if call.chars > MAX_ARGUMENT_CHARS:
                    raise ToolCallError(
                        f"a tool call's arguments are at most {MAX_ARGUMENT_CHARS} characters"
                    )
                call.arguments.append(p.arguments)
                delta = session_pb2.FunctionCallDelta(
                    response_id=self.response_id, call_id=p.call_id, name=call.name, delta=p.arguments
                )
                events.append(session_pb2.ServerEvent(function_call_delta=delta))
            if p.done:
                del self._open[p.call_id]
                done = WholeCall(p.call_id, call.name, "".join(call.arguments))
                self.done.append(done)
                whole.append(done)
                fc = session_pb2.FunctionCall(
                    response_id=self.response_id,
                    call_id=done.call_id,
                    name=done.name,
                    arguments=done.arguments,
                )
                events.append(session_pb2.ServerEvent(function_call=fc))
        return events, whole
