"""LiveKit Agents uses a tool end to end through the Realtime edge: an ``AgentSession`` whose model
is ``livekit-plugins-openai``'s ``RealtimeModel`` pointed at ``duplex up --pipeline chat
--realtime-port`` (ASR, chat and TTS workers; the scripted chat server, a real HTTP server process,
as the language model), an ``Agent`` with instructions and a ``@function_tool``, and a spoken
question from a microphone (the framework's own ``AudioInput``/``AudioOutput``, no room).

The model asks for the tool; the framework runs it and answers the call itself
(``conversation.item.create`` ``function_call_output``, then ``response.create``); the chat server
gets the call and its result in the next request, and the spoken answer uses the result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duplex.stack import LocalStack
from tests.chat_helpers import ChatServer, chat_server
from tests.framework_helpers import Microphone, base_url, rms, until, wav_pcm
from tests.test_cascade_stack import espeak_wav, heard

lk_agents = pytest.importorskip("livekit.agents", reason="the frameworks extra is not installed (make setup)")
lk_openai = pytest.importorskip("livekit.plugins.openai")
from livekit.agents import Agent, AgentSession, function_tool  # noqa: E402

from tests.test_framework_livekit import RATE, MicInput, SpeakerOutput  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
__all__ = ["chat_server"]

ASKED = "what is the weather in paris"
INSTRUCTIONS = "You are a weather assistant. Use the get_weather tool. Answer in one sentence."
FORECAST = "sunny and 21 degrees"
LOOKING = "Let me look that up."


@pytest.fixture(scope="module")
def chat_edge(chat_server: ChatServer) -> Iterator[LocalStack]:
    llm = ["--llm-url", chat_server.url, "--llm-model", "scripted-llm", "--llm-timeout-s", "5"]
    with LocalStack(pipeline="chat", realtime_port=0, stage_args={"chat": llm}) as stack:
        yield stack


@pytest.fixture(scope="module")
def question(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    wav: Path = espeak_wav(tmp_path_factory.mktemp("speech") / "asked.wav", ASKED)
    return wav_pcm(wav, trailing_silence_ms=1200)


class WeatherAgent(Agent):
    """An agent with one tool, which records what it was called with (in this process)."""

    def __init__(self) -> None:
        super().__init__(instructions=INSTRUCTIONS)
        self.calls: list[str] = []

    @function_tool
    async def get_weather(self, city: str) -> str:
        """The weather in a city now.

        Args:
            city: The city's name.
        """
        self.calls.append(city)
        return f"{FORECAST} in {city}"


def assistant_texts(session: AgentSession) -> list[str]:
    return [m.text_content or "" for m in session.history.messages() if m.role == "assistant"]


async def test_a_spoken_question_runs_the_agents_tool_and_the_spoken_answer_uses_its_result(
    chat_edge: LocalStack, chat_server: ChatServer, question: bytes
) -> None:
    chat_server.reset()
    # The model's first answer is a call of the tool; its second, the chat server's default after
    # a tool result, says what the tool said ("The tool says: <the tool message's content>.").
    chat_server.script(
        {"text": LOOKING, "tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    )
    model = lk_openai.realtime.RealtimeModel(model="chat", base_url=base_url(chat_edge), api_key="unused")
    session: AgentSession = AgentSession(llm=model)
    mic, speaker = Microphone(), SpeakerOutput()
    session.input.audio = MicInput(mic)
    session.output.audio = speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    executed: list[Any] = []
    session.on("function_tools_executed", executed.append)
    agent = WeatherAgent()
    answer = f"The tool says: {FORECAST} in Paris."
    try:
        await session.start(agent=agent, record=False)
        assert session._activity is not None and session._activity._rt_session is not None
        rt_session = session._activity._rt_session
        sent: list[dict[str, Any]] = []
        received: list[dict[str, Any]] = []
        rt_session.on("openai_client_event_queued", sent.append)
        rt_session.on("openai_server_event_received", received.append)
        mic.say(question)
        await until(lambda: any(answer in t for t in assistant_texts(session)), 60, "spoken answer")
        # The answer's playback ends (the speaker plays it in real time).
        await until(lambda: speaker._current is None and len(speaker.segments) >= 2, 20, "playback")
    finally:
        await asyncio.wait_for(session.aclose(), 20)
        await model.aclose()

    # The tool ran once, here, with the model's arguments; the framework saw its output.
    assert agent.calls == ["Paris"]
    assert len(executed) == 1
    ((call, output),) = executed[0].zipped()
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert output is not None and output.output == f"{FORECAST} in Paris" and not output.is_error

    # The framework answered the call itself: the call's output, then a response asked for.
    answered = [
        i
        for i, e in enumerate(sent)
        if e["type"] == "conversation.item.create" and e["item"]["type"] == "function_call_output"
    ]
    assert len(answered) == 1, [e["type"] for e in sent]
    assert sent[answered[0]]["item"]["call_id"] == call.call_id
    assert [e["type"] for e in sent[answered[0] :]].count("response.create") == 1
    done = [e["response"] for e in received if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["completed", "completed"]
    assert [o["type"] for o in done[0]["output"]] == ["message", "function_call"]
    assert [e for e in received if e["type"] == "error"] == []

    # The chat server's first request: the agent's instructions, the user's words and its tool.
    requests = chat_server.requests()
    assert len(requests) == 2, [r["messages"] for r in requests]
    first, second = requests
    system, user = first["messages"]
    assert system == {"role": "system", "content": INSTRUCTIONS} and user["role"] == "user"
    # The user's words as the edge recognized them and told the framework (PocketSphinx hears
    # eSpeak NG's "paris" as other words, and more or less of the rest with the turn's timing).
    transcripts = [
        e["transcript"]
        for e in received
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    assert transcripts == [user["content"]] and heard(user["content"], ASKED) >= 2, (transcripts, user)
    assert [m.text_content for m in session.history.messages() if m.role == "user"] == transcripts
    assert [t["function"]["name"] for t in first["tools"] or []] == ["get_weather"]
    # The second: the assistant's call and the tool's result, sent back by the framework itself.
    assert second["messages"][:2] == first["messages"]
    calling, result = second["messages"][2:]
    assert calling["role"] == "assistant" and calling["content"] == LOOKING
    (tool_call,) = calling["tool_calls"]
    assert tool_call["id"] == call.call_id and tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    assert result == {"role": "tool", "tool_call_id": call.call_id, "content": f"{FORECAST} in Paris"}

    # The spoken answer reached the session's history (its transcript) and the framework's audio
    # output, whole and not silent.
    assert assistant_texts(session)[-1] == answer
    spoken = speaker.segments[-1]
    assert not spoken.interrupted
    assert len(spoken.audio) / 2 / RATE > 1.5 and rms(bytes(spoken.audio)) > 0.01
    assert errors == [], errors
