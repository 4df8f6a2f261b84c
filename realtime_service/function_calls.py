"""A model's tool calls in Realtime terms: ``function_call`` output items (no I/O).

The session service reports a call in pieces (``function_call_delta``) and whole
(``function_call``). A Realtime client sees each call as an output item of its response, after
the response's message (output index 1, 2, ...), in the GA event shapes:
``response.output_item.added`` and ``conversation.item.added`` (the item ``in_progress``, no
arguments yet), ``response.function_call_arguments.delta`` per piece, then
``response.function_call_arguments.done``, ``response.output_item.done`` and
``conversation.item.done`` (the item ``completed`` with its arguments); ``response.done`` lists
the call items in its ``output``. The client answers with a ``function_call_output`` item
(``conversation.item.create``), then ``response.create``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplex.v1 import session_pb2
from realtime_service.items import Items

Event = dict[str, Any]


@dataclass
class _Call:
    item: dict[str, Any]
    output_index: int
    arguments: list[str] = field(default_factory=list)


class FunctionCalls:
    """The function call items of a connection's responses in progress."""

    def __init__(self, items: Items, event: Callable[..., Event], new_item_id: Callable[[], str]) -> None:
        self._items = items
        self._event = event
        self._new_item_id = new_item_id
        self._calls: dict[str, dict[str, _Call]] = {}
        """response id -> call id -> its item, in the order the calls began."""

    def delta(self, d: session_pb2.FunctionCallDelta) -> list[Event]:
        """A piece of a call's arguments (the call's item begins with its first)."""
        out: list[Event] = []
        call = self._calls.get(d.response_id, {}).get(d.call_id)
        if call is None:
            call, out = self._begin(d.response_id, d.call_id, d.name)
        call.arguments.append(d.delta)
        out.append(
            self._event(
                "response.function_call_arguments.delta",
                response_id=d.response_id,
                item_id=call.item["id"],
                output_index=call.output_index,
                call_id=d.call_id,
                delta=d.delta,
            )
        )
        return out

    def done(self, fc: session_pb2.FunctionCall) -> list[Event]:
        """The whole call: its item is complete."""
        out: list[Event] = []
        call = self._calls.get(fc.response_id, {}).get(fc.call_id)
        if call is None:  # (a call whose arguments came whole)
            call, out = self._begin(fc.response_id, fc.call_id, fc.name)
        item = call.item
        item.update(status="completed", arguments=fc.arguments)
        self._items.update(item["id"], status="completed", arguments=fc.arguments)
        ids = {"response_id": fc.response_id, "output_index": call.output_index}
        return [
            *out,
            self._event(
                "response.function_call_arguments.done",
                **ids,
                item_id=item["id"],
                call_id=fc.call_id,
                name=fc.name,
                arguments=fc.arguments,
            ),
            self._event("response.output_item.done", **ids, item=dict(item)),
            self._event(
                "conversation.item.done",
                previous_item_id=self._items.previous_of(item["id"]),
                item=dict(item),
            ),
        ]

    def ended(self, response_id: str) -> list[dict[str, Any]]:
        """The response ended: its call items, for ``response.done``'s output (a call it did not
        finish writing is ``incomplete``)."""
        items = []
        for call in self._calls.pop(response_id, {}).values():
            if call.item["status"] == "in_progress":
                call.item["status"] = "incomplete"
                self._items.update(call.item["id"], status="incomplete")
            items.append(dict(call.item))
        return items

    def _begin(self, response_id: str, call_id: str, name: str) -> tuple[_Call, list[Event]]:
        calls = self._calls.setdefault(response_id, {})
        item = {
            "id": self._new_item_id(),
            "object": "realtime.item",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        call = calls[call_id] = _Call(item, output_index=1 + len(calls))
        previous = self._items.add(dict(item))
        return call, [
            self._event(
                "response.output_item.added",
                response_id=response_id,
                output_index=call.output_index,
                item=dict(item),
            ),
            self._event("conversation.item.added", previous_item_id=previous, item=dict(item)),
        ]
