"""One connection's conversation in Realtime terms: the session service's events in, Realtime
server events out (no I/O).

The session service speaks of turns, responses and epochs; a Realtime client of items (a user
message per committed turn, an assistant message per response), output indexes and content
parts. ``Conversation`` keeps what the translation needs: the item ids it gave, which item a
response writes, how much audio each assistant item holds (for ``conversation.item.truncate``),
and the effective settings (for ``session.created``/``session.updated``).
"""

from __future__ import annotations

import base64
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from duplex.audio import PcmFormat
from duplex.v1 import session_pb2
from realtime_service.protocol import DEFAULT_TURN, RealtimeError, TurnSetting, format_object

Event = dict[str, Any]

#: Assistant items remembered for ``conversation.item.truncate`` (older ones are refused).
MAX_REMEMBERED_ITEMS: Final = 64

#: Client event ids remembered to echo in errors the session service reports later.
MAX_REMEMBERED_EVENT_IDS: Final = 512

_STATUS: Final = {
    session_pb2.RESPONSE_STATUS_COMPLETED: "completed",
    session_pb2.RESPONSE_STATUS_CANCELLED: "cancelled",
    session_pb2.RESPONSE_STATUS_FAILED: "failed",
    session_pb2.RESPONSE_STATUS_INTERRUPTED: "failed",
}

#: Session-service error codes that are the server's fault, not the request's.
_SERVER_ERRORS: Final = frozenset({"internal", "worker_unavailable", "unavailable", "draining", "fenced"})


@dataclass
class _Response:
    response_id: str
    item_id: str
    audio_bytes: int = 0
    transcript: list[str] = field(default_factory=list)


@dataclass
class Settings:
    """The session's effective settings as the edge reports them."""

    input_format: PcmFormat
    output_format: PcmFormat
    turn: TurnSetting = DEFAULT_TURN
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    model_native: bool = False
    """The model decides itself when to speak (``TURN_POLICY_MODEL_NATIVE``): each of its speech
    spans is a response, and turn detection is its own."""


def turn_from_proto(td: session_pb2.TurnDetection, vad: bool) -> TurnSetting:
    if not vad:
        return TurnSetting(vad=False)
    return TurnSetting(
        vad=True, silence_ms=td.silence_ms, create_response=td.auto_respond, interrupt_response=td.barge_in
    )


class Conversation:
    """Translation state of one connection's session."""

    def __init__(self, model: str, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self.session_id = ""
        self._event_ids = itertools.count(1)
        self._item_ids = itertools.count(1)
        self._user_item = ""
        """The id of the user item the current input will become (given at speech start)."""
        self._created_items: list[str] = []
        """Items of ``conversation.item.create`` whose commits are on their way, in order."""
        self._last_item: str | None = None
        self._responses: dict[str, _Response] = {}
        self._items: OrderedDict[str, _Response] = OrderedDict()
        """Assistant item id -> its response (which counts the audio sent for it)."""
        self._client_ids: OrderedDict[str, str] = OrderedDict()
        """The session service's event id of a client event -> the client's own ``event_id``."""

    # ---- ids ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "event_id": f"event_{next(self._event_ids)}", **fields}

    def new_item_id(self) -> str:
        return f"item_{next(self._item_ids)}"

    def remember_client_event(self, sent_id: str, client_id: str | None) -> None:
        """``sent_id`` (what went to the session service) stands for the client's ``client_id``."""
        if not client_id:
            return
        self._client_ids[sent_id] = client_id
        while len(self._client_ids) > MAX_REMEMBERED_EVENT_IDS:
            self._client_ids.popitem(last=False)

    # ---- what the edge reports --------------------------------------------------------------

    def session_object(self) -> Event:
        s = self.settings
        turn: Event | None = None
        if s.model_native:
            # The API's nearest word for it: the model itself judges when the user is done (and
            # when to stop); nothing of it can be set (duplex's turn_policy: model_native).
            turn = {
                "type": "semantic_vad",
                "eagerness": "auto",
                "create_response": True,
                "interrupt_response": True,
            }
        elif s.turn.vad:
            turn = {
                "type": "server_vad",
                "silence_duration_ms": s.turn.silence_ms or None,
                "create_response": s.turn.create_response,
                "interrupt_response": s.turn.interrupt_response,
            }
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model,
            "output_modalities": list(s.output_modalities),
            "instructions": s.instructions,
            "audio": {
                "input": {
                    "format": format_object(s.input_format),
                    "turn_detection": turn,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {"format": format_object(s.output_format), "voice": self.model, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "tracing": None,
        }

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
            s.turn = turn_from_proto(config.turn_detection, s.turn.vad)
        s.instructions = config.instructions
        if config.modalities:
            s.output_modalities = tuple(config.modalities)

    # ---- the session service's events -------------------------------------------------------

    def on_opened(self, opened: session_pb2.SessionOpened, *, first: bool) -> list[Event]:
        """``session.created`` for the first ``opened``; after a resume, the end of any response
        the lost stream left open (it will restart as a new one)."""
        self.session_id = opened.session_id
        self.settings.model_native = opened.capabilities.turn_policy == session_pb2.TURN_POLICY_MODEL_NATIVE
        self.apply_config(opened.config)
        if first:
            return [self._event("session.created", session=self.session_object())]
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
        return [self._event("session.updated", session=self.session_object())]

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

    def expect_created_item(self, item_id: str) -> str:
        """A ``conversation.item.create`` of audio is on its way as a commit; returns its id."""
        item_id = item_id or self.new_item_id()
        self._created_items.append(item_id)
        return item_id

    def _committed(self, ev: session_pb2.ServerEvent) -> list[Event]:
        out: list[Event] = []
        previous = self._last_item
        if self._created_items:
            item_id = self._created_items.pop(0)
        else:
            item_id = self._user_item or self.new_item_id()
            out.append(
                self._event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
            )
        self._user_item = ""
        self._last_item = item_id
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        out.append(self._event("conversation.item.added", previous_item_id=previous, item=item))
        out.append(self._event("conversation.item.done", previous_item_id=previous, item=item))
        return out

    def _cleared(self, _ev: session_pb2.ServerEvent) -> list[Event]:
        self._user_item = ""
        return [self._event("input_audio_buffer.cleared")]

    def function_output_added(self, item_id: str, call_id: str, output: str) -> list[Event]:
        """A function call's output, handed to the session service: the item it makes."""
        previous, self._last_item = self._last_item, item_id or self.new_item_id()
        item = {
            "id": self._last_item,
            "object": "realtime.item",
            "type": "function_call_output",
            "status": "completed",
            "call_id": call_id,
            "output": output,
        }
        return [
            self._event("conversation.item.added", previous_item_id=previous, item=item),
            self._event("conversation.item.done", previous_item_id=previous, item=item),
        ]

    def _assistant_item(self, r: _Response, status: str) -> Event:
        content: list[Event] = []
        if status != "in_progress":
            content = [{"type": "output_audio", "transcript": "".join(r.transcript)}]
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

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
            "output_modalities": list(self.settings.output_modalities),
            "audio": {"output": {"format": format_object(self.settings.output_format), "voice": self.model}},
            "max_output_tokens": "inf",
            "metadata": None,
            "usage": None,
        }

    def _response_started(self, ev: session_pb2.ServerEvent) -> list[Event]:
        started = ev.response_started
        r = _Response(started.response_id, self.new_item_id())
        self._responses[r.response_id] = r
        previous, self._last_item = self._last_item, r.item_id
        self._items[r.item_id] = r
        while len(self._items) > MAX_REMEMBERED_ITEMS:
            self._items.popitem(last=False)
        ids = {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0}
        item = self._assistant_item(r, "in_progress")
        return [
            self._event("response.created", response=self._response_object(r, "in_progress", None, [])),
            self._event("response.output_item.added", response_id=r.response_id, output_index=0, item=item),
            self._event("conversation.item.added", previous_item_id=previous, item=item),
            self._event(
                "response.content_part.added",
                **ids,
                content_index=0,
                part={"type": "audio", "transcript": ""},
            ),
        ]

    def _audio_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        delta = ev.audio_delta
        r = self._responses.get(delta.response_id)
        if r is None:
            return []  # a response this connection never saw start (not one of its own)
        r.audio_bytes += len(delta.pcm)
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
        if "audio" not in self.settings.output_modalities:
            kind = "response.output_text.delta"
        return [
            self._event(
                kind,
                response_id=r.response_id,
                item_id=r.item_id,
                output_index=0,
                content_index=0,
                delta=text,
            )
        ]

    def _text_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        return self._text(ev.text_delta.response_id, ev.text_delta.text)

    def _transcript_delta(self, ev: session_pb2.ServerEvent) -> list[Event]:
        t = ev.transcript_delta
        if t.role == "assistant":
            return self._text(t.response_id, t.text)
        item_id = self._user_item or self._last_item
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
        item_status = "completed" if status == "completed" else "incomplete"
        item = self._assistant_item(r, item_status)
        transcript = "".join(r.transcript)
        ids = {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0}
        part = {"type": "audio", "transcript": transcript}
        return [
            self._event("response.output_audio.done", **ids, content_index=0),
            self._event(
                "response.output_audio_transcript.done", **ids, content_index=0, transcript=transcript
            ),
            self._event("response.content_part.done", **ids, content_index=0, part=part),
            self._event("response.output_item.done", response_id=r.response_id, output_index=0, item=item),
            self._event("conversation.item.done", previous_item_id=None, item=item),
            self._event("response.done", response=self._response_object(r, status, details, [item])),
        ]

    def _response_done_event(self, ev: session_pb2.ServerEvent) -> list[Event]:
        done = ev.response_done
        return self._response_done(done.response_id, _STATUS.get(done.status, "failed"), done.reason)

    def _error(self, ev: session_pb2.ServerEvent) -> list[Event]:
        err = ev.error
        client_id = self._client_ids.get(err.event_id)
        kind = "server_error" if err.code in _SERVER_ERRORS else "invalid_request_error"
        return [self.error(RealtimeError(err.code, err.message, event_id=client_id, type=kind))]

    # ---- the client's truncation -------------------------------------------------------------

    def truncation(self, item_id: str, audio_end_ms: int) -> tuple[str, Event]:
        """The response whose played position ``conversation.item.truncate`` reports, and the
        ``conversation.item.truncated`` answer; raises ``RealtimeError``."""
        known = self._items.get(item_id)
        if known is None:
            raise RealtimeError(
                "item_not_found", "no assistant item with that id (or too old)", param="item_id"
            )
        response_id = known.response_id
        audio_ms = self.settings.output_format.duration_ms(known.audio_bytes)
        if audio_end_ms > audio_ms + 1:
            raise RealtimeError(
                "invalid_value",
                f"audio_end_ms {audio_end_ms} is past the item's audio ({int(audio_ms)} ms)",
                param="audio_end_ms",
            )
        answer = self._event(
            "conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=audio_end_ms
        )
        return response_id, answer


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
    "response_done": Conversation._response_done_event,
    "error": Conversation._error,
}
