"""One connection's conversation as the client sees it: its items, in order (no I/O).

The Realtime API lets a client read (``conversation.item.retrieve``), add
(``conversation.item.create``, after any item or at the ``root``) and remove
(``conversation.item.delete``) the conversation's items; LiveKit Agents keeps its own copy of
the conversation in step with it that way. ``Items`` holds them as the edge reports them: ids,
order, status, content (the transcript of audio, never the audio itself), and for assistant
items how much audio they hold (``conversation.item.truncate``).

It is bounded (``MAX_ITEMS`` items, ``MAX_TEXT_CHARS`` of their JSON): past a bound the oldest
items are forgotten, as retrieve and delete then say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from duplex.audio import PcmFormat
from realtime_service import errors
from realtime_service.errors import RealtimeError

MAX_ITEMS: Final = 512
MAX_TEXT_CHARS: Final = 2 * 1024 * 1024

#: ``previous_item_id`` that puts an item first.
ROOT: Final = "root"


@dataclass
class _Entry:
    item: dict[str, Any]
    size: int
    audio_bytes: int = 0
    """Audio the edge sent for an assistant item."""


class Items:
    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_TEXT_CHARS) -> None:
        self.max_items = max_items
        self.max_chars = max_chars
        self._order: list[str] = []
        self._entries: dict[str, _Entry] = {}
        self._chars = 0

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._entries

    def __len__(self) -> int:
        return len(self._order)

    @property
    def ids(self) -> list[str]:
        return list(self._order)

    @property
    def last(self) -> str | None:
        return self._order[-1] if self._order else None

    def get(self, item_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(item_id)
        return entry.item if entry is not None else None

    def check_new(self, item_id: str, previous_item_id: str | None) -> None:
        """Raise ``RealtimeError`` if an item ``item_id`` cannot be added after ``previous_item_id``."""
        if item_id and item_id in self._entries:
            raise RealtimeError(
                errors.DUPLICATE_ITEM,
                f"Item with id '{item_id}' already exists.",
                param="item.id",
                duplex_code="duplicate_item_id",
            )
        if previous_item_id not in (None, ROOT) and previous_item_id not in self._entries:
            raise RealtimeError(
                "item_create_invalid_previous_item_id",
                f"Error adding item: the previous item with id '{previous_item_id}' does not exist.",
                param="previous_item_id",
                duplex_code="item_not_found",
            )

    def add(self, item: dict[str, Any], previous_item_id: str | None = None) -> str | None:
        """Add ``item`` (its ``id`` set) after ``previous_item_id`` (None: at the end, ``root``:
        first); returns the id of the item now before it. Call ``check_new`` first."""
        item_id = item["id"]
        if previous_item_id is None or previous_item_id not in self._entries:
            at = len(self._order) if previous_item_id != ROOT else 0
        else:
            at = self._order.index(previous_item_id) + 1
        self._order.insert(at, item_id)
        entry = _Entry(item, _size(item))
        self._entries[item_id] = entry
        self._chars += entry.size
        self._bound(keep=item_id)
        return self.previous_of(item_id)

    def previous_of(self, item_id: str) -> str | None:
        if item_id not in self._entries:
            return None
        at = self._order.index(item_id)
        return self._order[at - 1] if at else None

    def update(self, item_id: str, **fields: Any) -> dict[str, Any] | None:
        """Set ``fields`` of a kept item; returns it (None when it is not kept)."""
        entry = self._entries.get(item_id)
        if entry is None:
            return None
        entry.item.update(fields)
        self._chars -= entry.size
        entry.size = _size(entry.item)
        self._chars += entry.size
        self._bound(keep=item_id)
        return entry.item

    def delete(self, item_id: str) -> bool:
        entry = self._entries.pop(item_id, None)
        if entry is None:
            return False
        self._order.remove(item_id)
        self._chars -= entry.size
        return True

    def add_audio(self, item_id: str, n_bytes: int) -> None:
        entry = self._entries.get(item_id)
        if entry is not None:
            entry.audio_bytes += n_bytes

    def audio_bytes(self, item_id: str) -> int:
        entry = self._entries.get(item_id)
        return entry.audio_bytes if entry is not None else 0

    def truncate(self, item_id: str, audio_end_ms: int, fmt: PcmFormat) -> None:
        """``conversation.item.truncate``: the assistant item's transcript goes (the API keeps no
        text of what the user did not hear); raises ``RealtimeError`` for an item not kept, not
        an assistant's, or a position past its audio (``fmt``: the audio's format)."""
        item = self.get(item_id)
        if item is None:
            raise errors.item_not_found("truncate", item_id)
        if item.get("role") != "assistant":
            raise RealtimeError(
                "invalid_value",
                "only assistant messages can be truncated",
                param="item_id",
                duplex_code="not_assistant",
            )
        audio_ms = fmt.duration_ms(self.audio_bytes(item_id))
        if audio_end_ms > audio_ms + 1:
            raise RealtimeError(
                "invalid_value",
                f"audio_end_ms {audio_end_ms} is past the item's audio ({int(audio_ms)} ms)",
                param="audio_end_ms",
            )
        self.update(item_id, content=[{"type": "output_audio", "transcript": ""}])

    def _bound(self, keep: str) -> None:
        while len(self._order) > 1 and (len(self._order) > self.max_items or self._chars > self.max_chars):
            oldest = self._order[0] if self._order[0] != keep else self._order[1]
            self.delete(oldest)


def _size(item: dict[str, Any]) -> int:
    return len(json.dumps(item))


def user_audio_item(item_id: str, transcript: str | None = None) -> dict[str, Any]:
    """A committed user turn (its audio is the model's; the item has its transcript, if any)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_audio", "transcript": transcript}],
    }


def assistant_item(item_id: str, status: str, transcript: str | None, modality: str) -> dict[str, Any]:
    """The item a response writes (no content while in progress)."""
    content: list[dict[str, Any]] = []
    if status != "in_progress":
        if modality == "audio":
            content = [{"type": "output_audio", "transcript": transcript or ""}]
        else:
            content = [{"type": "output_text", "text": transcript or ""}]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }
