"""The Realtime edge's pure parts, without sockets: client events to commands
(``realtime_service.protocol``), the session service's events to Realtime events
(``realtime_service.conversation``) and the bounded outbound queue (``realtime_service.outbound``)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from duplex.audio import PCMA_8K, PCMU_8K
from duplex.v1 import session_pb2
from realtime_service.conversation import Conversation, Settings
from realtime_service.outbound import Frame, Outbound
from realtime_service.protocol import (
    CLIENT_EVENTS,
    PCM24K,
    AppendAudio,
    CommitAudio,
    CreateItem,
    RealtimeError,
    TruncateItem,
    UpdateSession,
    parse_client_event,
)


def parse(event: dict[str, Any]) -> Any:
    return parse_client_event(json.dumps(event), PCM24K)


# ---- protocol -----------------------------------------------------------------------------------


def test_every_served_client_event_parses() -> None:
    audio = base64.b64encode(b"\0\0" * 480).decode()
    events = {
        "session.update": {"session": {"type": "realtime"}},
        "input_audio_buffer.append": {"audio": audio},
        "input_audio_buffer.commit": {},
        "input_audio_buffer.clear": {},
        "response.create": {},
        "response.cancel": {},
        "conversation.item.truncate": {"item_id": "item_1", "content_index": 0, "audio_end_ms": 10},
        "conversation.item.delete": {"item_id": "item_1"},
        "conversation.item.retrieve": {"item_id": "item_1"},
        "conversation.item.create": {
            "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}
        },
    }
    assert set(events) == set(CLIENT_EVENTS)
    for kind, fields in events.items():
        command = parse({"type": kind, "event_id": "e7", **fields})
        assert command.event_id == "e7"


def test_session_update_maps_formats_turns_and_instructions() -> None:
    command = parse(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "instructions": "be brief",
                "output_modalities": ["audio", "text", "audio"],
                "voice": "ignored",
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcmu"},
                        "turn_detection": {
                            "type": "server_vad",
                            "silence_duration_ms": 700,
                            "interrupt_response": False,
                        },
                        "noise_reduction": None,
                    },
                    "output": {"format": {"type": "audio/pcma"}, "voice": "alloy"},
                },
            },
        }
    )
    assert isinstance(command, UpdateSession)
    assert command.input_format == PCMU_8K and command.output_format == PCMA_8K
    assert command.instructions == "be brief" and command.output_modalities == ("audio", "text")
    assert command.turn is not None
    turn = command.turn.to_proto()
    assert (turn.auto_respond, turn.silence_ms, turn.barge_in) == (True, 700, False)
    off = parse({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    assert off.turn is not None and not off.turn.vad
    assert (off.turn.to_proto().auto_respond, off.turn.to_proto().barge_in) == (False, False)
    # Unset fields stay unset (the session keeps them).
    bare = parse({"type": "session.update", "session": {}})
    assert bare == UpdateSession(None)


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"output_modalities": []}, "invalid_value", "session.output_modalities"),
        ({"output_modalities": ["video"]}, "invalid_value", "session.output_modalities"),
        ({"instructions": 5}, "invalid_type", "session.instructions"),
        (
            {"audio": {"input": {"format": {"type": "audio/opus"}}}},
            "invalid_value",
            "session.audio.input.format.type",
        ),
        (
            {"audio": {"input": {"turn_detection": {"silence_duration_ms": 50}}}},
            "invalid_value",
            "session.audio.input.turn_detection.silence_duration_ms",
        ),
        (
            {"audio": {"input": {"turn_detection": {"create_response": "yes"}}}},
            "invalid_type",
            "session.audio.input.turn_detection.create_response",
        ),
        ({"audio": {"output": {"bitrate": 5}}}, "unknown_parameter", "session.audio.output.bitrate"),
        ({"audio": []}, "invalid_type", "session.audio"),
    ],
)
def test_a_bad_field_of_a_session_update_is_refused_alone(
    session: dict[str, Any], code: str, param: str
) -> None:
    # The bad field is refused with its code and param; the rest of the update still applies.
    command = parse(
        {"type": "session.update", "event_id": "x", "session": {**session, "instructions": "kept"}}
    )
    if "instructions" in session:
        command = parse({"type": "session.update", "event_id": "x", "session": session})
    assert isinstance(command, UpdateSession)
    assert [(e.code, e.param, e.event_id) for e in command.problems] == [(code, param, "x")]
    assert command.problems[0].to_error()["type"] == "invalid_request_error"
    assert (param, code) in command.not_applied
    if "instructions" not in session:
        assert command.instructions == "kept"


def test_an_update_that_is_not_one_is_refused_whole() -> None:
    for session in ({"type": "transcription"}, None, []):
        with pytest.raises(RealtimeError) as err:
            parse({"type": "session.update", "event_id": "x", "session": session})
        assert err.value.event_id == "x"


def test_appends_hold_whole_samples_of_the_input_format() -> None:
    ulaw = base64.b64encode(b"\x7f" * 3).decode()
    assert parse_client_event(json.dumps({"type": "input_audio_buffer.append", "audio": ulaw}), PCMU_8K) == (
        AppendAudio(None, b"\x7f" * 3)
    )
    with pytest.raises(RealtimeError) as err:
        parse({"type": "input_audio_buffer.append", "audio": ulaw})  # 3 bytes of 16-bit PCM
    assert err.value.code == "invalid_audio_length"
    with pytest.raises(RealtimeError) as err:
        parse({"type": "input_audio_buffer.append", "audio": ""})
    assert err.value.code == "empty_audio"


def test_a_long_event_id_is_echoed_bounded() -> None:
    with pytest.raises(RealtimeError) as err:
        parse({"type": "nope", "event_id": "e" * 100_000})
    assert err.value.event_id == "e" * 256


def test_items_the_model_can_take_and_items_kept() -> None:
    item = parse(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        }
    )
    assert isinstance(item, CreateItem) and item.kind == "function_call_output" and item.call_id == "c1"
    # What the model does not take is kept in the conversation (no audio or image data is).
    for kept in (
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "be brief"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ):
        command = parse({"type": "conversation.item.create", "item": kept})
        assert isinstance(command, CreateItem) and command.kind == "kept" and not command.audio
    for bad, code in (
        ({"type": "message", "role": "user", "content": []}, "invalid_value"),
        (
            {"type": "message", "role": "critic", "content": [{"type": "input_text", "text": "x"}]},
            "invalid_value",
        ),
        (
            {"type": "message", "role": "system", "content": [{"type": "input_audio", "audio": "AAA="}]},
            "invalid_value",
        ),
        ({"type": "reasoning"}, "invalid_value"),
    ):
        with pytest.raises(RealtimeError) as err:
            parse({"type": "conversation.item.create", "item": bad})
        assert err.value.code == code
    truncate = parse({"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": 5})
    assert truncate == TruncateItem(None, "i", 0, 5)
    with pytest.raises(RealtimeError):
        parse({"type": "conversation.item.truncate", "item_id": "i", "content_index": 1, "audio_end_ms": 5})


# ---- conversation -------------------------------------------------------------------------------


def conversation() -> Conversation:
    conv = Conversation("parrot", Settings(input_format=PCM24K, output_format=PCM24K))
    opened = session_pb2.SessionOpened(session_id="sess_1")
    opened.config.input_format.CopyFrom(PCM24K.to_proto())
    created = conv.on_opened(opened, first=True)
    assert [e["type"] for e in created] == ["session.created"]
    return conv


def ev(**fields: Any) -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(**fields)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_turn_becomes_items_and_a_response() -> None:
    conv = conversation()
    started = conv.on_event(ev(speech_started=session_pb2.SpeechStarted(audio_ms=120)))
    user_item = started[0]["item_id"]
    assert started[0]["audio_start_ms"] == 120
    committed = conv.on_event(ev(committed=session_pb2.InputCommitted(turn_id=1, audio_ms=900)))
    assert kinds(committed) == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert committed[0]["item_id"] == user_item == committed[1]["item"]["id"]
    created = conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="resp_1", turn_id=1)))
    assert kinds(created) == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assistant_item = created[1]["item"]["id"]
    assert created[2]["previous_item_id"] == user_item
    delta = conv.on_event(ev(audio_delta=session_pb2.AudioDelta(response_id="resp_1", pcm=b"\1\0" * 2400)))
    assert delta[0]["item_id"] == assistant_item and base64.b64decode(delta[0]["delta"]) == b"\1\0" * 2400
    # Audio of a response this connection never saw start is not passed on.
    assert conv.on_event(ev(audio_delta=session_pb2.AudioDelta(response_id="resp_other", pcm=b"\0\0"))) == []
    done = conv.on_event(
        ev(
            response_done=session_pb2.ResponseDone(
                response_id="resp_1", status=session_pb2.RESPONSE_STATUS_COMPLETED
            )
        )
    )
    assert kinds(done)[-1] == "response.done" and done[-1]["response"]["status"] == "completed"
    assert done[-1]["response"]["output"][0]["id"] == assistant_item
    # 2400 samples at 24 kHz = 100 ms: truncating within them is answered, past them refused.
    response_id, answer = conv.truncation(assistant_item, 100)
    assert response_id == "resp_1" and answer["type"] == "conversation.item.truncated"
    with pytest.raises(RealtimeError):
        conv.truncation(assistant_item, 150)
    # Event ids never repeat.
    ids = [e["event_id"] for e in [*started, *committed, *created, *delta, *done]]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    ("status", "reason", "realtime", "details"),
    [
        (
            session_pb2.RESPONSE_STATUS_CANCELLED,
            "barge_in",
            "cancelled",
            {"type": "cancelled", "reason": "turn_detected"},
        ),
        (
            session_pb2.RESPONSE_STATUS_CANCELLED,
            "response_cancel",
            "cancelled",
            {"type": "cancelled", "reason": "client_cancelled"},
        ),
        (
            session_pb2.RESPONSE_STATUS_FAILED,
            "worker_unavailable",
            "failed",
            {"type": "failed", "error": {"type": "server_error", "code": "worker_unavailable"}},
        ),
    ],
)
def test_how_a_response_ended(status: int, reason: str, realtime: str, details: dict[str, Any]) -> None:
    conv = conversation()
    conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="r", turn_id=1)))
    done = conv.on_event(
        ev(response_done=session_pb2.ResponseDone(response_id="r", status=status, reason=reason))
    )  # type: ignore[arg-type]
    assert done[-1]["response"]["status"] == realtime and done[-1]["response"]["status_details"] == details
    assert done[-3]["type"] == "response.output_item.done" and done[-3]["item"]["status"] == "incomplete"


def test_a_resume_ends_the_response_the_lost_stream_left_open() -> None:
    conv = conversation()
    conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="r", turn_id=1)))
    again = conv.on_opened(session_pb2.SessionOpened(session_id="sess_1"), first=False)
    assert "session.created" not in kinds(again)
    assert again[-1]["type"] == "response.done" and again[-1]["response"]["status"] == "failed"
    assert conv.on_opened(session_pb2.SessionOpened(session_id="sess_1"), first=False) == []


def test_without_server_vad_no_speech_events_are_reported() -> None:
    conv = conversation()
    conv.settings.turn = parse(
        {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
    ).turn
    assert conv.on_event(ev(speech_started=session_pb2.SpeechStarted(audio_ms=1))) == []
    assert conv.on_event(ev(speech_stopped=session_pb2.SpeechStopped(audio_ms=2))) == []


def test_a_created_item_keeps_its_id_and_is_not_a_buffer_commit() -> None:
    conv = conversation()
    audio = base64.b64encode(b"\0\0" * 480).decode()
    command = parse(
        {
            "type": "conversation.item.create",
            "item": {
                "id": "mine",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": audio}],
            },
        }
    )
    assert conv.create_item(command) == []  # added when its turn is committed
    committed = conv.on_event(ev(committed=session_pb2.InputCommitted(turn_id=1)))
    assert kinds(committed) == ["conversation.item.added", "conversation.item.done"]
    assert committed[0]["item"]["id"] == "mine"


def test_a_session_service_error_names_the_clients_event() -> None:
    conv = conversation()
    conv.remember_client_event("c17", CommitAudio("client-evt"))
    out = conv.on_event(ev(error=session_pb2.Error(code="no_committed_input", message="m", event_id="c17")))
    error = out[0]["error"]
    assert error["event_id"] == "client-evt" and error["type"] == "invalid_request_error"
    # OpenAI's code for the case, the session service's in a field of its own.
    assert error["code"] == "input_audio_buffer_commit_empty" and error["duplex_code"] == "no_committed_input"
    out = conv.on_event(ev(error=session_pb2.Error(code="worker_unavailable", message="m")))
    assert out[0]["error"]["event_id"] is None and out[0]["error"]["type"] == "server_error"


# ---- outbound ----------------------------------------------------------------------------------


async def test_cancelled_audio_leaves_the_queue_unsent() -> None:
    out = Outbound(limit_bytes=1 << 20)
    out.put(Frame("a1", audio_of="r1"))
    out.put(Frame("done-of-something-else"))
    out.put(Frame("a2", audio_of="r1"))
    out.put(Frame("b1", audio_of="r2"))
    assert out.drop_audio("r1") == 2
    assert out.drop_audio("") == 0  # "" names no response: nothing goes
    assert [(await out.get()).text for _ in range(2)] == ["done-of-something-else", "b1"]  # type: ignore[union-attr]
    assert out.queued_bytes == 0
    out.close()
    assert await out.get() is None


async def test_past_its_bound_the_queue_overflows() -> None:
    out = Outbound(limit_bytes=10)
    out.put(Frame("x" * 8))
    assert not out.overflow.is_set()
    out.put(Frame("x" * 8))
    assert out.overflowed and out.overflow.is_set()
    assert await asyncio.wait_for(out.get(), 1) is None  # the writer stops


def test_a_models_tool_calls_are_function_call_items_after_its_message() -> None:
    conv = conversation()
    conv.on_event(ev(response_started=session_pb2.ResponseStarted(response_id="resp_1", turn_id=1)))
    first = conv.on_event(
        ev(
            function_call_delta=session_pb2.FunctionCallDelta(
                response_id="resp_1", call_id="c1", name="f", delta="{"
            )
        )
    )
    assert kinds(first) == [
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
    ]
    item = first[0]["item"]
    assert (item["type"], item["status"], item["call_id"], item["name"]) == (
        "function_call",
        "in_progress",
        "c1",
        "f",
    )
    assert first[0]["output_index"] == 1 and first[2]["item_id"] == item["id"] and first[2]["delta"] == "{"
    conv.on_event(
        ev(
            function_call_delta=session_pb2.FunctionCallDelta(
                response_id="resp_1", call_id="c1", name="f", delta="}"
            )
        )
    )
    done = conv.on_event(
        ev(
            function_call=session_pb2.FunctionCall(
                response_id="resp_1", call_id="c1", name="f", arguments="{}"
            )
        )
    )
    assert kinds(done) == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
    ]
    assert done[1]["item"]["status"] == "completed" and done[1]["item"]["arguments"] == "{}"
    # A second call, begun and not finished when the response is cancelled: incomplete.
    second = conv.on_event(
        ev(
            function_call_delta=session_pb2.FunctionCallDelta(
                response_id="resp_1", call_id="c2", name="g", delta="["
            )
        )
    )
    assert second[0]["output_index"] == 2
    ended = conv.on_event(
        ev(
            response_done=session_pb2.ResponseDone(
                response_id="resp_1", status=session_pb2.RESPONSE_STATUS_CANCELLED
            )
        )
    )
    output = ended[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in output] == [
        ("message", "incomplete"),
        ("function_call", "completed"),
        ("function_call", "incomplete"),
    ]
    assert conv.items.get(output[2]["id"])["status"] == "incomplete"
    # Calls of a response this connection does not hold (never seen, or done) are not passed on.
    late = session_pb2.FunctionCallDelta(response_id="resp_1", call_id="c3", name="h", delta="{")
    other = session_pb2.FunctionCall(response_id="resp_other", call_id="c4", name="h", arguments="{}")
    assert conv.on_event(ev(function_call_delta=late)) == [] and conv.on_event(ev(function_call=other)) == []
