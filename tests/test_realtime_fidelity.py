"""The Realtime edge where the OpenAI Realtime API has an answer (issue 38): OpenAI's error codes,
``response.create`` with nothing committed, ``metadata`` echoed, ``semantic_vad``, partial
``session.update``s, and a conversation the client can see and edit (retrieve, delete, create of
text and function items). Units on ``Conversation``, then the edge in front of an in-process
stack through a plain WebSocket."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from duplex.v1 import session_pb2
from realtime_service.conversation import Conversation, Settings
from realtime_service.items import Items
from realtime_service.protocol import (
    PCM24K,
    CancelResponse,
    CreateResponse,
    RealtimeError,
    UpdateSession,
    parse_client_event,
)
from tests.realtime_helpers import speech
from tests.session_helpers import InProcessStack
from tests.test_realtime_edge import edge, next_of, raw


def parse(event: dict[str, Any]) -> Any:
    return parse_client_event(json.dumps(event), PCM24K)


def conversation() -> Conversation:
    conv = Conversation("parrot", Settings(input_format=PCM24K, output_format=PCM24K))
    opened = session_pb2.SessionOpened(session_id="sess_1")
    opened.config.input_format.CopyFrom(PCM24K.to_proto())
    opened.capabilities.turn_detection = True
    conv.on_opened(opened, first=True)
    return conv


def ev(**fields: Any) -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(**fields)


# ---- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "code", "openai", "message"),
    [
        (CancelResponse("c"), "no_active_response", "response_cancel_not_active", "Cancellation failed"),
        (
            CreateResponse("c"),
            "response_in_progress",
            "conversation_already_has_active_response",
            "Conversation",
        ),
    ],
)
def test_session_service_errors_are_openais_codes(command: Any, code: str, openai: str, message: str) -> None:
    conv = conversation()
    conv.remember_client_event("s1", command)
    error = conv.on_event(ev(error=session_pb2.Error(code=code, message="m", event_id="s1")))[0]["error"]
    assert (error["code"], error["duplex_code"], error["event_id"]) == (openai, code, "c")
    assert error["message"].startswith(message)


def test_a_create_with_nothing_committed_is_an_empty_completed_response_with_its_metadata() -> None:
    conv = conversation()
    response = {"metadata": {"k": "v"}, "max_output_tokens": 64, "output_modalities": ["audio"]}
    create = parse({"type": "response.create", "event_id": "e1", "response": response})
    conv.remember_client_event("s1", create)
    out = conv.on_event(ev(error=session_pb2.Error(code="no_committed_input", message="m", event_id="s1")))
    assert [e["type"] for e in out] == ["response.created", "response.done"]
    done = out[1]["response"]
    assert done["status"] == "completed" and done["output"] == [] and done["metadata"] == {"k": "v"}
    assert done["max_output_tokens"] == 64 and done["output_modalities"] == ["audio"]
    assert out[0]["response"]["id"] == done["id"]


def test_a_started_response_carries_the_metadata_of_the_create_that_asked_for_it() -> None:
    conv = conversation()
    conv.remember_client_event("s1", CreateResponse("e1", {"client_event_id": "e1"}, ("audio",)))
    started = conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="r1", event_id="s1")))
    assert started[0]["response"]["metadata"] == {"client_event_id": "e1"}
    done = conv.on_event(ev(response_done=session_pb2.ResponseDone(response_id="r1", status=1)))
    assert done[-1]["response"]["metadata"] == {"client_event_id": "e1"}
    # A response the server started (turn detection) has none.
    started = conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="r2")))
    assert started[0]["response"]["metadata"] is None


def test_semantic_vad_is_a_silence_length_and_reported_as_asked() -> None:
    conv = conversation()
    update = parse(
        {
            "type": "session.update",
            "session": {
                "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}},
                "tools": [{"type": "function", "name": "f", "parameters": {}}],
                "max_output_tokens": 100,
            },
        }
    )
    assert isinstance(update, UpdateSession) and update.turn is not None and not update.problems
    assert update.turn.to_proto().silence_ms == 300
    conv.apply_update(update)
    conv.remember_client_event("s1", update)
    config = session_pb2.SessionConfig(turn_detection=update.turn.to_proto())
    session = conv.on_event(ev(updated=session_pb2.SessionUpdated(config=config)))[0]["session"]
    td = session["audio"]["input"]["turn_detection"]
    assert td == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": True,
    }
    assert session["duplex"]["turn_detection"] == {"silence_duration_ms": 300}
    assert session["tools"][0]["name"] == "f" and session["max_output_tokens"] == 100
    assert session["duplex"]["capabilities"]["function_calling"] is False
    assert {n["param"] for n in session["duplex"]["not_applied"]} == {
        "session.tools",
        "session.max_output_tokens",
    }


def test_the_conversations_items_in_order_bounded() -> None:
    items = Items(max_items=3)
    for i in range(3):
        items.add({"id": f"i{i}"})
    assert items.add({"id": "first"}, "root") is None and items.ids[0] == "first"
    assert items.ids == ["first", "i1", "i2"]  # the oldest other than the new one is forgotten
    assert items.add({"id": "mid"}, "i1") == "i1" and items.ids == ["i1", "mid", "i2"]
    with pytest.raises(RealtimeError) as err:
        items.check_new("mid", None)
    assert err.value.code == "item_create_duplicate_item_id"
    with pytest.raises(RealtimeError) as err:
        items.check_new("new", "gone")
    assert err.value.param == "previous_item_id"


def test_text_items_are_kept_and_edits_answered() -> None:
    conv = conversation()
    text = parse(
        {
            "type": "conversation.item.create",
            "item": {
                "id": "t1",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            },
        }
    )
    added = conv.create_item(text)
    assert [e["type"] for e in added] == ["conversation.item.added", "conversation.item.done"]
    assert added[0]["item"]["content"] == [{"type": "input_text", "text": "hi"}]
    assert conv.retrieve_item("t1")[0]["item"]["id"] == "t1"
    deleted = conv.delete_item("t1")
    assert deleted[0]["type"] == "conversation.item.deleted" and deleted[0]["item_id"] == "t1"
    for action, call in (("retrieve", conv.retrieve_item), ("delete", conv.delete_item)):
        with pytest.raises(RealtimeError) as err:
            call("t1")
        assert err.value.code == f"item_{action}_invalid_item_id"
    with pytest.raises(RealtimeError) as err:
        conv.truncation("t1", 0)
    assert err.value.code == "item_truncate_invalid_item_id"


# ---- the edge ----------------------------------------------------------------------------------------


async def test_over_a_websocket(stack: InProcessStack) -> None:
    async with edge(stack.target) as server:
        ws = await raw(server)
        try:
            # Cancel with nothing to cancel: OpenAI's code and message.
            await ws.send(json.dumps({"type": "response.cancel", "event_id": "c1"}))
            error = (await next_of(ws, "error"))["error"]
            assert error["code"] == "response_cancel_not_active" and error["event_id"] == "c1"
            # The bot speaks first: nothing committed, an empty completed response, its metadata back.
            create = {"type": "response.create", "response": {"metadata": {"client_event_id": "g1"}}}
            await ws.send(json.dumps(create))
            done = (await next_of(ws, "response.done"))["response"]
            assert done["status"] == "completed" and done["metadata"] == {"client_event_id": "g1"}
            # A partial update: semantic_vad applies, the bad field is refused alone.
            session = {
                "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}},
                "output_modalities": [],
            }
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            assert (await next_of(ws, "error"))["error"]["param"] == "session.output_modalities"
            updated = (await next_of(ws, "session.updated"))["session"]
            assert updated["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
            assert updated["duplex"]["not_applied"] == [
                {"param": "session.output_modalities", "reason": "invalid_value"}
            ]
            # A text item, then a spoken turn placed after it; retrieve and delete.
            text = {
                "id": "t1",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": text}))
            assert (await next_of(ws, "conversation.item.added"))["item"]["id"] == "t1"
            await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "t1"}))
            assert (await next_of(ws, "conversation.item.retrieved"))["item"]["content"][0]["text"] == "hi"
            pcm = speech(PCM24K, trailing_silence_ms=1200)
            for i in range(0, len(pcm), 9600):
                chunk = base64.b64encode(pcm[i : i + 9600]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            committed = await next_of(ws, "input_audio_buffer.committed", timeout_s=30)
            assert committed["previous_item_id"] == "t1"
            reply = await next_of(ws, "response.done", timeout_s=30)
            assert reply["response"]["status"] == "completed" and reply["response"]["metadata"] is None
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "t1"}))
            assert (await next_of(ws, "conversation.item.deleted"))["item_id"] == "t1"
        finally:
            await ws.close()
