"""One connection's conversation in Realtime terms: the session service's events in, Realtime
server events out, and the client's edits of the conversation (no I/O).

The session service speaks of turns, responses and epochs; a Realtime client of items (a user
message per committed turn, an assistant message per response, and whatever it adds itself),
output indexes and content parts. ``Conversation`` keeps what the translation needs: the
conversation's items (``items.Items``), which item a response writes and what the
``response.create`` that asked for it said (``metadata`` comes back), which client event each
command sent to the session service stands for (so its errors name it, in OpenAI's codes), and
the effective settings (``session.created``/``session.updated``).
"""

from __future__ import annotations

import base64
import itertools
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Final

from duplex.audio import PcmFormat
from duplex.v1 import session_pb2
from realtime_service import errors
from realtime_service.errors import RealtimeError
from realtime_service.function_calls import FunctionCalls
from realtime_service.items import Items, assistant_item, user_audio_item
from realtime_service.protocol import CreateItem, CreateResponse, UpdateSession
from realtime_service.session_config import Settings, format_object, session_object, turn_from_proto

Event = dict[str, Any]

#: Assistant items whose response id is remembered for ``conversation.item.truncate``.
MAX_REMEMBERED_ITEMS: Final = 64

#: Committed turns whose user item is remembered (their transcript may come after the commit).
MAX_TURNS_REMEMBERED: Final = 16

#: Client commands remembered (to name them in errors the session service reports later).
MAX_REMEMBERED_EVENT_IDS: Final = 512

_STATUS: Final = {
    session_pb2.RESPONSE_STATUS_COMPLETED: "completed",
    session_pb2.RESPONSE_STATUS_CANCELLED: "cancelled",
    session_pb2.RESPONSE_STATUS_FAILED: "failed",
    session_pb2.RESPONSE_STATUS_INTERRUPTED: "failed",
}


@dataclass
class _Response:
    response_id: str
    item_id: str
    metadata: dict[str, Any] | None = None
    modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | str | None = None
    transcript: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Sent:
    """A client command as sent to the session service."""

    client_id: str | None
    command: str
    """Its class name (``CommitAudio``, ``CreateResponse``, ...)."""
    create: CreateResponse | None = None
    update: UpdateSession | None = None


class Conversation:
    """Translation state of one connection's session."""

    def __init__(self, model: str, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self.session_id = ""
        self.capabilities = session_pb2.Capabilities()
        self.items = Items()
        self._event_ids = itertools.count(1)
        self._item_ids = itertools.count(1)
        self._user_item = ""
        """The id of the user item the current input will become (given at speech start)."""
        self._turn_items: OrderedDict[int, str] = OrderedDict()
        """Committed turn -> its user item (its transcript may come after: ``input_transcribed``)."""
        self._created_items: deque[CreateItem] = deque()
        """Audio items of ``conversation.item.create`` whose commits are on their way, in order."""
        self._responses: dict[str, _Response] = {}
        self._item_responses: OrderedDict[str, str] = OrderedDict()
        """Assistant item id -> its response id (a truncation names the response it played)."""
        self._sent: OrderedDict[str, _Sent] = OrderedDict()
        """The session service's event id of a client command -> what it was."""
        self._updates: deque[str] = deque()
        """Updates sent and not yet answered ``updated`` (answered in order)."""
        self.calls = FunctionCalls(self.items, self._event, self.new_item_id)
        """The model's tool calls: output items after each response's message."""

    # ---- ids ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "event_id": f"event_{next(self._event_ids)}", **fields}

    def new_item_id(self) -> str:
        while (item_id := f"item_{next(self._item_ids)}") in self.items:
            pass
        return item_id

    def remember_client_event(self, sent_id: str, command: object) -> None:
        """``sent_id`` (what went to the session service) stands for ``command``."""
        if not sent_id:
            return
        client_id = getattr(command, "event_id", None)
        kind = type(command).__name__
        create = command if isinstance(command, CreateResponse) else None
        update = command if isinstance(command, UpdateSession) else None
        if update is not None:
            self._updates.append(sent_id)
        self._sent[sent_id] = _Sent(client_id, kind, create, update)
        while len(self._sent) > MAX_REMEMBERED_EVENT_IDS:
            self._sent.popitem(last=False)

    # ---- what the edge reports --------------------------------------------------------------

    def session_object(self, not_applied: tuple[tuple[str, str], ...] = ()) -> Event:
        return session_object(self.settings, self.session_id, self.model, self.capabilities, not_applied)

    def error(self, err: RealtimeError) -> Event:
        return self._event("error", error=err.to_error())

    def apply_config(self, config: session_pb2.SessionConfig) -> None:
        """The settings the session service says are in effect (``opened``/``updated``)."""
        s = self.settings
        if config.HasField("input_format"):
            s.input_format = PcmFormat.from_proto(config.input_format)
        if config.HasField("output_format") and config.output_format.sample_rate_hz:
            s.output_format = PcmFormat.from_proto(config.output_format)
        if config.HasField("turn_detection"):
            s.turn = turn_from_proto(config.turn_detection, s.turn)
        s.instructions = config.instructions
        if config.modalities:
            s.output_modalities = tuple(config.modalities)

    def apply_update(self, update: UpdateSession) -> None:
        """What the edge keeps of an update (the session service applies the rest)."""
        if update.turn is not None:
            # Whether speech events are reported follows the client's choice at once.
            self.settings.turn = update.turn
        self.settings.stored.update(update.stored)

    # ---- the session service's events -------------------------------------------------------

    def on_opened(self, opened: session_pb2.SessionOpened, *, first: bool) -> list[Event]:
        """``session.created`` for the first ``opened``; after a resume, the end of any response
        the lost stream left open (it will restart as a new one)."""
        self.session_id = opened.session_id
        if opened.HasField("capabilities"):
            self.capabilities.CopyFrom(opened.capabilities)
        self.apply_config(opened.config)
        if first:
            return [self._event("session.created", session=self.session_object())]
        # Updates the lost stream did not answer get no ``updated`` now (they go again, new).
        self._updates.clear()
        out: list[Event] = []
        for response_id in list(self._responses):
            out += self._response_done(response_id, "failed", "interrupted")
        return out

    def on_event(self, ev: session_pb2.ServerEvent) -> list[Event]:
        kind = ev.WhichOneof("event")
        handler = _HANDLERS.get(kind or "")
        return handler(self, ev) if handler is not None else []

    def _updated(self, ev: session_pb2.ServerEvent) -> list[Event]:
        self.apply_config(ev.updated.config)
        sent = self._sent.get(self._updates.popleft()) if self._updates else None
        notes = sent.update.not_applied if sent is not None and sent.update is not None else ()
        return [self._event("session.updated", session=self.session_object(notes))]

    def _speech(self, kind: str, position: str, audio_ms: int) -> list[Event]:
        """A speech boundary of server VAD (not reported without it), on the user item the turn
        becomes."""
        if not self.settings.turn.vad:
            return []
        if not self._user_item:
            self._user_item = self.new_item_id()
        return [self._event(kind, **{position: audio_ms}, item_id=self._user_item)]

    def _speech_started(self, ev: session_pb2.ServerEvent) -> list[Event]:
        return self._speech("input_audio_buffer.speech_started", "audio_start_ms", ev.speech_started.audio_ms)

    def _speech_stopped(self, ev: session_pb2.ServerEvent) -> list[Event]:
        return self._speech("input_audio_buffer.speech_stopped", "audio_end_ms", ev.speech_stopped.audio_ms)

    def _added(self, item: Event, previous_item_id: str | None = None) -> list[Event]:
        previous = self.items.add(item, previous_item_id)
        return [
            self._event("conversation.item.added", previous_item_id=previous, item=item),
            self._event("conversation.item.done", previous_item_id=previous, item=item),
        ]

    def _committed(self, ev: session_pb2.ServerEvent) -> list[Event]:
        if self._created_items:
            created = self._created_items.popleft()
            self._remember_turn(ev.committed.turn_id, created.item["id"])
            return self._added(created.item, created.previous_item_id)
        item_id = (
            self._user_item if self._user_item and self._user_item not in self.items else self.new_item_id()
        )
        self._user_item = ""
        self._remember_turn(ev.committed.turn_id, item_id)
        committed = self._event(
            "input_audio_buffer.committed", item_id=item_id, previous_item_id=self.items.last
        )
        return [committed, *self._added(user_audio_item(item_id))]

    def _remember_turn(self, turn_id: int, item_id: str) -> None:
        self._turn_items[turn_id] = item_id
        while len(self._turn_items) > MAX_TURNS_REMEMBERED:
            self._turn_items.popitem(last=False)

    def _input_transcribed(self, ev: session_pb2.ServerEvent) -> list[Event]:
        """The words of a committed turn: its user item's transcript (OpenAI's event for the end
        of a transcription of the item's audio)."""
        t = ev.input_transcribed
        item_id = self._turn_items.get(t.turn_id)
        if item_id is None:
            return []
        self.items.update(item_id, content=[{"type": "input_audio", "transcript": t.transcript}])
        return [
            self._event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=t.transcript,
                usage={"type": "duration", "seconds": 0},
            )
        ]

    def _call_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        if ev.function_call_delta.response_id not in self._responses:
            return []  # a response this connection never saw start, or one already done
        return self.calls.delta(ev.function_call_delta)

    def _call_done(self, ev: session_pb2.ServerEvent) -> list[Event]:
        if ev.function_call.response_id not in self._responses:
            return []
        return self.calls.done(ev.function_call)

    def _cleared(self, _ev: session_pb2.ServerEvent) -> list[Event]:
        self._user_item = ""
        return [self._event("input_audio_buffer.cleared")]

    def _response_object(
        self, r: _Response, status: str, details: Event | None, output: list[Event]
    ) -> Event:
        return {
            "id": r.response_id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "conversation_id": f"conv_{self.session_id}",
            "output": output,
            "output_modalities": list(r.modalities),
            "audio": {"output": {"format": format_object(self.settings.output_format), "voice": self.model}},
            "max_output_tokens": r.max_output_tokens
            or self.settings.stored.get("max_output_tokens")
            or "inf",
            "metadata": r.metadata,
            "usage": None,
        }

    def _new_response(self, response_id: str, event_id: str) -> _Response:
        sent = self._sent.get(event_id) if event_id else None
        create = sent.create if sent is not None else None
        r = _Response(response_id, self.new_item_id())
        r.modalities = self.settings.output_modalities
        if create is not None:
            r.metadata = create.metadata
            r.modalities = create.output_modalities or r.modalities
            r.max_output_tokens = create.max_output_tokens
        return r

    def _modality(self, r: _Response) -> str:
        return "audio" if "audio" in r.modalities else "text"

    def _response_started(self, ev: session_pb2.ServerEvent) -> list[Event]:
        started = ev.response_started
        r = self._new_response(started.response_id, started.event_id)
        self._responses[r.response_id] = r
        self._item_responses[r.item_id] = r.response_id
        while len(self._item_responses) > MAX_REMEMBERED_ITEMS:
            self._item_responses.popitem(last=False)
        item = assistant_item(r.item_id, "in_progress", None, self._modality(r))
        previous = self.items.add(dict(item))
        ids = {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0}
        part = (
            {"type": "audio", "transcript": ""}
            if self._modality(r) == "audio"
            else {"type": "text", "text": ""}
        )
        return [
            self._event("response.created", response=self._response_object(r, "in_progress", None, [])),
            self._event("response.output_item.added", response_id=r.response_id, output_index=0, item=item),
            self._event("conversation.item.added", previous_item_id=previous, item=item),
            self._event("response.content_part.added", **ids, content_index=0, part=part),
        ]

    def _audio_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        delta = ev.audio_delta
        r = self._responses.get(delta.response_id)
        if r is None:
            return []  # a response this connection never saw start (not one of its own)
        self.items.add_audio(r.item_id, len(delta.pcm))
        return [
            self._event(
                "response.output_audio.delta",
                response_id=r.response_id,
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                delta=base64.b64encode(delta.pcm).decode("ascii"),
            )
        ]

    def _text(self, response_id: str, text: str) -> list[Event]:
        r = self._responses.get(response_id)
        if r is None or not text:
            return []
        r.transcript.append(text)
        kind = "response.output_audio_transcript.delta"
        if self._modality(r) != "audio":
            kind = "response.output_text.delta"
        ids = {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        return [self._event(kind, **ids, delta=text)]

    def _text_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        return self._text(ev.text_delta.response_id, ev.text_delta.text)

    def _transcript_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        t = ev.transcript_delta
        if t.role == "assistant":
            return self._text(t.response_id, t.text)
        item_id = self._user_item or self.items.last
        if not item_id or not t.text:
            return []
        return [
            self._event(
                "conversation.item.input_audio_transcription.delta",
                item_id=item_id,
                content_index=0,
                delta=t.text,
            )
        ]

    def _response_done(self, response_id: str, status: str, reason: str) -> list[Event]:
        r = self._responses.pop(response_id, None)
        if r is None:
            return []
        details: Event | None = None
        if status == "cancelled":
            details = {
                "type": "cancelled",
                "reason": "turn_detected" if reason == "barge_in" else "client_cancelled",
            }
        elif status == "failed":
            details = {"type": "failed", "error": {"type": "server_error", "code": reason or "failed"}}
        transcript = "".join(r.transcript)
        item = assistant_item(
            r.item_id, "completed" if status == "completed" else "incomplete", transcript, self._modality(r)
        )
        kept = self.items.get(r.item_id)
        if kept is not None:
            # A truncation before the end keeps its cut transcript.
            if kept.get("content"):
                item["content"] = kept["content"]
            self.items.update(r.item_id, status=item["status"], content=item["content"])
        ids = {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0}
        out: list[Event] = []
        if self._modality(r) == "audio":
            out += [
                self._event("response.output_audio.done", **ids, content_index=0),
                self._event(
                    "response.output_audio_transcript.done", **ids, content_index=0, transcript=transcript
                ),
            ]
            part: Event = {"type": "audio", "transcript": transcript}
        else:
            out.append(self._event("response.output_text.done", **ids, content_index=0, text=transcript))
            part = {"type": "text", "text": transcript}
        return [
            *out,
            self._event("response.content_part.done", **ids, content_index=0, part=part),
            self._event("response.output_item.done", response_id=r.response_id, output_index=0, item=item),
            self._event(
                "conversation.item.done", previous_item_id=self.items.previous_of(r.item_id), item=item
            ),
            self._event(
                "response.done",
                response=self._response_object(r, status, details, [item, *self.calls.ended(r.response_id)]),
            ),
        ]

    def _response_done_event(self, ev: session_pb2.ServerEvent) -> list[Event]:
        done = ev.response_done
        return self._response_done(done.response_id, _STATUS.get(done.status, "failed"), done.reason)

    def empty_response(self, create: CreateResponse | None) -> list[Event]:
        """A response with nothing to say: what a model that has no input to answer gives for a
        ``response.create`` (created and done, completed, no output)."""
        r = _Response(f"resp_{uuid.uuid4().hex[:16]}", "", modalities=self.settings.output_modalities)
        if create is not None:
            r.metadata = create.metadata
            r.modalities = create.output_modalities or r.modalities
            r.max_output_tokens = create.max_output_tokens
        return [
            self._event("response.created", response=self._response_object(r, "in_progress", None, [])),
            self._event("response.done", response=self._response_object(r, "completed", None, [])),
        ]

    def _error(self, ev: session_pb2.ServerEvent) -> list[Event]:
        err = ev.error
        sent = self._sent.get(err.event_id)
        command = sent.command if sent is not None else ""
        if sent is not None and sent.update is not None and err.event_id in self._updates:
            self._updates.remove(err.event_id)  # refused: no ``updated`` answers it
        if command == "CreateItem":
            # Its turn was not committed: the item is not added.
            self._created_items = deque(c for c in self._created_items if c.event_id != _client_id(sent))
        if command == "CreateResponse" and err.code == "no_committed_input":
            return self.empty_response(sent.create if sent is not None else None)
        active = next(iter(self._responses), "")
        mapped = errors.from_session(err.code, err.message, command, active)
        mapped.event_id = sent.client_id if sent is not None else None
        return [self.error(mapped)]

    # ---- the client's edits -------------------------------------------------------------------

    def create_item(self, command: CreateItem) -> list[Event]:
        """A ``conversation.item.create``: checked, then added (an audio item once its turn is
        committed); raises ``RealtimeError``."""
        self.items.check_new(command.item_id, command.previous_item_id)
        if command.item_id and any(c.item_id == command.item_id for c in self._created_items):
            self.items.check_new(command.item_id, None)  # (raises: the same id is on its way)
        item = dict(command.item, id=command.item_id or self.new_item_id())
        if command.kind == "audio":
            self._created_items.append(
                CreateItem(command.event_id, item, command.previous_item_id, kind="audio")
            )
            return []
        return self._added(item, command.previous_item_id)

    def delete_item(self, item_id: str) -> list[Event]:
        if not self.items.delete(item_id):
            raise errors.item_not_found("delete", item_id)
        return [self._event("conversation.item.deleted", item_id=item_id)]

    def retrieve_item(self, item_id: str) -> list[Event]:
        item = self.items.get(item_id)
        if item is None:
            raise errors.item_not_found("retrieve", item_id)
        return [self._event("conversation.item.retrieved", item=item)]

    def truncation(self, item_id: str, audio_end_ms: int) -> tuple[str, Event]:
        """The response whose played position ``conversation.item.truncate`` reports ("" when too
        old to say), and the ``conversation.item.truncated`` answer; raises ``RealtimeError``.
        The item's transcript goes: the API keeps no text of what the user did not hear."""
        self.items.truncate(item_id, audio_end_ms, self.settings.output_format)
        answer = self._event(
            "conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=audio_end_ms
        )
        return self._item_responses.get(item_id, ""), answer


def _client_id(sent: _Sent | None) -> str | None:
    return sent.client_id if sent is not None else None


_HANDLERS: Final = {
    "updated": Conversation._updated,
    "speech_started": Conversation._speech_started,
    "speech_stopped": Conversation._speech_stopped,
    "committed": Conversation._committed,
    "cleared": Conversation._cleared,
    "response_started": Conversation._response_started,
    "audio_delta": Conversation._audio_delta,
    "text_delta": Conversation._text_delta,
    "transcript_delta": Conversation._transcript_delta,
    "input_transcribed": Conversation._input_transcribed,
    "response_done": Conversation._response_done_event,
    "error": Conversation._error,
    "function_call_delta": Conversation._call_delta,
    "function_call": Conversation._call_done,
}

__all__ = ["Conversation", "Event", "Settings"]
