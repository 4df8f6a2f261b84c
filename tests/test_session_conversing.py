"""A session of the chat pipeline (``session_service.plugins.chat``: ASR -> chat -> TTS) in
process, with a fake link per stage: what the chat stage is sent each reply (the instructions,
the user's words, the replies as the user heard them, the tool calls and their results), the
model's tool calls reaching the client, the client's answers (once, never to a call cancelled by
a barge-in), ``response_create`` going on from a tool's result, and the conversation travelling
in the resume token to a runner on another replica."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.plugins.chat import ChatPlugin
from session_service.session.history import CANCELLED_NOTE
from session_service.session.runner import RunnerDeps, SessionRunner
from session_service.trust import resume_tokens as resume
from session_service.trust.resume_tokens import ResumeClaims, ResumeKeys, SessionProgress
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain
from tests.test_session_stages import FRAME, SID, TEXT, Placer, close, kinds, news, settle, turn_end

COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
INSTRUCTIONS = "You are brief."
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
KEYS = ResumeKeys.single(b"shared-resume-secret-of-32-bytes", kid="k1")
T0 = 1_700_000_000


@dataclasses.dataclass
class Chat:
    runner: SessionRunner
    asr: FakeLink
    chat: FakeLink
    tts: FakeLink


async def chatting(*, progress: SessionProgress | None = None, tools: bool = True) -> Chat:
    plugin = ChatPlugin()
    asr, chat, tts = FakeLink(), FakeLink(), FakeLink()
    runtime: dict[str, object] = {"tools": [WEATHER], "tool_choice": "auto"} if tools else {}
    r = SessionRunner(
        session_id=SID,
        settings=dataclasses.replace(plugin.default_settings(), instructions=INSTRUCTIONS),
        runtime_config=runtime,
        link=asr,
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=plugin.capabilities(max_sessions=4),
            config=RunnerConfig(coalesce_acks=False),
            placer=Placer(),
            stage_placers={"chat": Placer(chat), "tts": Placer(tts)},
            clock=ManualClock(),
            issue_token=lambda runner: resume.issue(
                KEYS, ResumeClaims(SID, issued_at=T0, settings=runner.settings, progress=runner.progress())
            ),
        ),
        progress=progress,
    )
    r.start()
    await settle()
    return Chat(r, asr, chat, tts)


def requests(chat: FakeLink) -> list[dict[str, Any]]:
    """The chat requests the stage was sent (one per reply, in TEXT pieces; the last final)."""
    out, pieces = [], []
    for sub in chat.subs:
        if sub.kind == TEXT:
            pieces.append(sub.text)
            if sub.text_final:
                out.append(json.loads("".join(pieces)))
                pieces = []
    return out


def write(c: Chat, epoch: int, turn: int, *updates: dict[str, Any]) -> None:
    """The chat stage's steps: text and tool call pieces."""
    for kw in updates:
        c.runner.on_stage_output(c.chat, None, None, [news(epoch, turn, **kw)])


def speak(c: Chat, epoch: int, turn: int, *updates: dict[str, Any], frames: int = 1) -> None:
    """The TTS stage's steps: each ``frames`` frames of audio, the first with the update."""
    for kw in updates:
        for i in range(frames):
            c.runner.on_stage_output(
                c.tts,
                Fence(SID, epoch, turn).to_proto(),
                common_pb2.AudioPayload(pcm=FRAME),
                [news(epoch, turn, **kw)] if i == 0 else [],
            )


def call(call_id: str, arguments: str = "", *, name: str = "", done: bool = False) -> worker_pb2.ToolCallNews:
    return worker_pb2.ToolCallNews(call_id=call_id, name=name, arguments=arguments, done=done)


async def post(r: SessionRunner, **event: Any) -> list[session_pb2.ServerEvent]:
    await r.post(session_pb2.ClientEvent(**event))
    await settle()
    return drain(r)


async def test_the_model_is_sent_the_conversation_and_its_tool_call_round_trips() -> None:
    c = await chatting()
    r = c.runner
    try:
        turn_end(r, "what is the weather in paris")
        (asked,) = requests(c.chat)
        assert asked["messages"] == [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "what is the weather in paris"},
        ]
        fn = {"name": "get_weather", "parameters": {"type": "object"}}
        assert asked["tools"] == [{"type": "function", "function": fn}] and asked["tool_choice"] == "auto"
        drain(r)
        write(
            c,
            1,
            1,
            {"text": "Let me look."},
            {"tool_calls": [call("c1", '{"city":', name="get_weather")]},
            {"tool_calls": [call("c1", ' "Paris"}', done=True)], "response_finished": True},
        )
        speak(c, 1, 1, {"text": "Let me look.", "response_started": True}, {"response_finished": True})
        evs = drain(r)
        # The call reaches the client in pieces, then whole; the reply completes.
        deltas = [e.function_call_delta for e in evs if e.HasField("function_call_delta")]
        assert [(d.call_id, d.name, d.delta) for d in deltas] == [
            ("c1", "get_weather", '{"city":'),
            ("c1", "get_weather", ' "Paris"}'),
        ]
        (whole,) = [e.function_call for e in evs if e.HasField("function_call")]
        assert (whole.call_id, whole.name, whole.arguments) == ("c1", "get_weather", '{"city": "Paris"}')
        assert whole.response_id == deltas[0].response_id == evs[-1].response_done.response_id
        assert evs[-1].response_done.status == COMPLETED
        # The client's result, then response_create: the model goes on from it, no new input.
        fco = session_pb2.FunctionCallOutput(call_id="c1", output='{"sky": "sunny"}')
        assert await post(r, event_id="e1", function_call_output=fco) == []
        evs = await post(r, event_id="e2", response_create=session_pb2.ResponseCreate())
        assert kinds(evs) == ["response_started"] and evs[0].response_started.event_id == "e2"
        assert requests(c.chat)[1]["messages"] == [
            *asked["messages"],
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
        ]
        # A second answer to the call is refused, with its code.
        evs = await post(r, event_id="e3", function_call_output=fco)
        assert [(e.error.code, e.error.event_id) for e in evs] == [("function_call_answered", "e3")]
        evs = await post(
            r, event_id="e4", function_call_output=session_pb2.FunctionCallOutput(call_id="nope", output="{}")
        )
        assert [e.error.code for e in evs] == ["unknown_call_id"]
    finally:
        await close(r)


async def test_a_barge_in_cuts_the_reply_to_what_was_heard_and_cancels_its_call() -> None:
    c = await chatting()
    r = c.runner
    try:
        turn_end(r, "book a table")
        write(
            c,
            1,
            1,
            {"text": "Sure. I will book it now for you."},
            {"tool_calls": [call("c1", "{}", name="book", done=True)], "response_finished": True},
        )
        # The first sentence is spoken (two frames of it went out); the user talks over it.
        speak(c, 1, 1, {"text": "Sure.", "response_started": True}, frames=2)
        drain(r)
        r.on_output(
            None, None, [news(1, 1, vad=[worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED)])]
        )
        evs = drain(r)
        assert evs[-1].response_done.status == CANCELLED
        # The token response_done carries already knows the reply as heard (another replica
        # taking the session over from it never tells the model it said the rest).
        token = evs[-1].response_done.resume_token
        carried = resume.decode(KEYS, token, session_id=SID, now=T0 + 1).progress.history
        assert list(carried) == [
            ["u", "book a table"],
            ["a", "Sure.", [["c1", "book", "{}", "cancelled", ""]]],
        ]
        # The call was cancelled with its reply: an answer to it is refused, the model told so.
        fco = session_pb2.FunctionCallOutput(call_id="c1", output="{}")
        evs = await post(r, event_id="e1", function_call_output=fco)
        assert [e.error.code for e in evs] == ["function_call_cancelled"]
        turn_end(r, "no wait", epoch=2, turn=1)
        assert requests(c.chat)[-1]["messages"][1:] == [
            {"role": "user", "content": "book a table"},
            {
                "role": "assistant",
                "content": "Sure.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "book", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": CANCELLED_NOTE},
            {"role": "user", "content": "no wait"},
        ]
    finally:
        await close(r)


async def test_a_playback_position_cuts_a_completed_reply() -> None:
    c = await chatting(tools=False)
    r = c.runner
    try:
        turn_end(r, "tell me two things")
        write(c, 1, 1, {"text": "One thing. Another thing.", "response_finished": True})
        speak(c, 1, 1, {"text": "One thing.", "response_started": True}, frames=3)
        speak(c, 1, 1, {"text": "Another thing."}, {"response_finished": True})
        evs = drain(r)
        done = evs[-1].response_done
        assert done.status == COMPLETED
        # The client played 50 ms of it (the first sentence's audio starts at 0, the second at 96).
        ack = session_pb2.PlaybackAck(response_id=done.response_id, played_ms=50)
        assert await post(r, event_id="e1", playback_ack=ack) == []
        turn_end(r, "and", turn=1)
        assert requests(c.chat)[-1]["messages"][2:] == [
            {"role": "assistant", "content": "One thing."},
            {"role": "user", "content": "and"},
        ]
    finally:
        await close(r)


async def test_the_conversation_travels_in_the_resume_token_to_another_replica() -> None:
    c = await chatting(tools=False)
    r = c.runner
    try:
        turn_end(r, "my name is ada")
        write(c, 1, 1, {"text": "Hello Ada. Nice to meet you.", "response_finished": True})
        speak(c, 1, 1, {"text": "Hello Ada.", "response_started": True})
        speak(c, 1, 1, {"text": "Nice to meet you."}, {"response_finished": True})
        drain(r)
        progress = r.progress()
    finally:
        await close(r)
    # What the token carries, sealed and opened on another replica (same secret).
    claims = ResumeClaims(SID, issued_at=T0, settings=r.settings, progress=progress)
    token = resume.issue(KEYS, claims)
    opened = resume.decode(KEYS, token, session_id=SID, now=T0 + 1)
    elsewhere = await chatting(progress=opened.progress, tools=False)
    try:
        turn_end(elsewhere.runner, "what is my name", turn=1)
        assert requests(elsewhere.chat)[-1]["messages"] == [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "my name is ada"},
            {"role": "assistant", "content": "Hello Ada. Nice to meet you."},
            {"role": "user", "content": "what is my name"},
        ]
    finally:
        await close(elsewhere.runner)


def test_a_long_conversation_keeps_its_newest_turns_in_a_bounded_token() -> None:
    records: list[Sequence[object]] = []
    for i in range(200):
        records += [["u", f"question {i} " + "x" * 80], ["a", f"answer {i} " + "y" * 80, []]]
    claims = ResumeClaims(
        SID,
        issued_at=T0,
        settings=ChatPlugin().default_settings(),
        progress=SessionProgress(history=tuple(records)),
    )
    token = resume.issue(KEYS, claims)
    assert len(token) <= resume.MAX_TOKEN_CHARS
    kept = resume.decode(KEYS, token, session_id=SID, now=T0 + 1).progress.history
    # The newest records, in order, as many as fit.
    assert 10 < len(kept) < len(records) and list(kept) == [list(x) for x in records[-len(kept) :]]
