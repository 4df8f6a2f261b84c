"""LiveKit Agents through the Realtime edge, as its users run it: an ``AgentSession`` whose model
is ``livekit-plugins-openai``'s ``RealtimeModel(base_url=...)`` pointed at
``duplex up --realtime-port`` (no LiveKit room: the session's audio input and output are the
framework's own ``AudioInput``/``AudioOutput``, a microphone speaking tests/fixtures/hello.wav in
real time and a speaker that plays what it gets in real time).

Each pattern holds a conversation with the parrot with no error event from the framework, no
timeout, and no reply later than the parrot made it: default settings with a greeting,
client-driven turns, barge-in, and edits of the conversation's history."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from duplex.stack import LocalStack
from tests.framework_helpers import (
    HELLO_SPEECH_S,
    LATE_S,
    Microphone,
    base_url,
    parrot_edge,
    rms,
    until,
    wav_pcm,
)

lk_agents = pytest.importorskip("livekit.agents", reason="the frameworks extra is not installed (make setup)")
lk_openai = pytest.importorskip("livekit.plugins.openai")
from livekit import rtc  # noqa: E402
from livekit.agents import Agent, AgentSession  # noqa: E402
from livekit.agents.voice import io  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]
__all__ = ["parrot_edge"]

RATE = 24_000


class MicInput(io.AudioInput):
    """The framework's audio input: the microphone's chunks as ``rtc.AudioFrame``s."""

    def __init__(self, mic: Microphone) -> None:
        super().__init__(label="wav-microphone")
        self.mic = mic

    async def __anext__(self) -> rtc.AudioFrame:
        pcm = await self.mic.chunk()
        return rtc.AudioFrame(data=pcm, sample_rate=RATE, num_channels=1, samples_per_channel=len(pcm) // 2)


@dataclass
class Playback:
    started_at: float
    audio: bytearray = field(default_factory=bytearray)
    interrupted: bool = False


#: The speaker's playout delay (a room's jitter buffer): audio plays this long after it came.
PLAYOUT_DELAY_S = 0.3


class SpeakerOutput(io.AudioOutput):
    """The framework's audio output: plays what it is given in real time, ``PLAYOUT_DELAY_S``
    behind (so the framework sees playback as from a room), and keeps it, per segment."""

    def __init__(self) -> None:
        caps = io.AudioOutputCapabilities(pause=False)
        super().__init__(label="speaker", capabilities=caps, sample_rate=RATE)
        self.segments: list[Playback] = []
        self._current: Playback | None = None
        self._queued_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._flushed = False

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._current is None:
            self._current = Playback(time.monotonic() + PLAYOUT_DELAY_S)
            self.segments.append(self._current)
            self._queued_s = 0.0
            self._flushed = False
            self._task = asyncio.create_task(self._play(self._current))
            self.on_playback_started(created_at=time.time())
        self._current.audio += bytes(frame.data)
        self._queued_s += frame.samples_per_channel / frame.sample_rate

    def flush(self) -> None:
        super().flush()
        self._flushed = True
        if self._current is None:
            return

    async def _play(self, segment: Playback) -> None:
        # Real-time playback: the segment ends once its audio had time to play and it was flushed.
        while True:
            played = max(0.0, time.monotonic() - segment.started_at)
            if self._flushed and played >= self._queued_s:
                break
            await asyncio.sleep(0.02)
        self._finish(segment, interrupted=False)

    def _finish(self, segment: Playback, *, interrupted: bool) -> None:
        if self._current is not segment:
            return
        self._current = None
        segment.interrupted = interrupted
        position = min(max(0.0, time.monotonic() - segment.started_at), self._queued_s)
        self.on_playback_finished(playback_position=position, interrupted=interrupted)

    def clear_buffer(self) -> None:
        segment = self._current
        if segment is not None:
            if self._task is not None:
                self._task.cancel()
            self._finish(segment, interrupted=True)


@dataclass
class Run:
    session: AgentSession
    mic: Microphone
    speaker: SpeakerOutput
    errors: list[Any]
    server_events: list[dict[str, Any]]

    def rt_session(self) -> Any:
        activity = self.session._activity
        assert activity is not None and activity._rt_session is not None
        return activity._rt_session

    async def reply(self, after: int, timeout_s: float = 20.0) -> Playback:
        """The first playback segment past the first ``after``, once it finished."""
        segments = self.speaker.segments
        await until(
            lambda: len(segments) > after and self.speaker._current is not segments[after],
            timeout_s,
            f"reply {after + 1}",
        )
        return segments[after]

    async def event(self, kind: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The first server event of ``kind`` (waiting for it)."""
        await until(lambda: any(e["type"] == kind for e in self.server_events), timeout_s, kind)
        return next(e for e in self.server_events if e["type"] == kind)

    def server_errors(self) -> list[dict[str, Any]]:
        return [e for e in self.server_events if e["type"] == "error"]


@contextlib.asynccontextmanager
async def agent_session(
    stack: LocalStack, session_options: dict[str, Any] | None = None, **model_options: Any
) -> AsyncIterator[Run]:
    model = lk_openai.realtime.RealtimeModel(
        model="parrot", base_url=base_url(stack), api_key="unused", **model_options
    )
    turn = "manual" if model_options.get("turn_detection", "server") is None else None
    options = dict(session_options or {}) | ({"turn_detection": turn} if turn else {})
    session = AgentSession(llm=model, **options)
    mic, speaker = Microphone(), SpeakerOutput()
    session.input.audio = MicInput(mic)
    session.output.audio = speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    run = Run(session, mic, speaker, errors, [])
    await session.start(agent=Agent(instructions="Repeat what the user says."), record=False)
    run.rt_session().on("openai_server_event_received", run.server_events.append)
    try:
        yield run
    finally:
        await session.aclose()
        await model.aclose()


def assert_a_full_reply(run: Run, reply: Playback, turn_end: float) -> None:
    """The parrot's whole reply (the user's speech back), started in time after the turn ended."""
    assert reply.started_at - turn_end < LATE_S, f"the reply came {reply.started_at - turn_end:.1f}s late"
    assert len(reply.audio) / 2 / RATE > HELLO_SPEECH_S * 0.8 and rms(bytes(reply.audio)) > 0.01
    assert not reply.interrupted


def assert_no_error(run: Run, benign: frozenset[str] = frozenset()) -> None:
    """No error reached the framework's user, and the edge sent none but ``benign`` ones."""
    assert run.errors == [], run.errors
    assert [e for e in run.server_errors() if e["error"]["code"] not in benign] == []


async def test_default_settings_a_greeting_and_a_spoken_turn(parrot_edge: LocalStack) -> None:
    # LiveKit's defaults: semantic_vad (eagerness medium), input transcription, a voice.
    async with agent_session(parrot_edge) as run:
        updated = await run.event("session.updated")
        assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        # The bot speaks first: the parrot has nothing to say yet, so the greeting is an empty
        # completed response, matched to its request by its metadata (no 10 s timeout).
        t0 = time.monotonic()
        greeting = run.session.generate_reply(instructions="Greet the user.")
        await asyncio.wait_for(greeting.wait_for_playout(), LATE_S)
        assert time.monotonic() - t0 < LATE_S and greeting.done() and not greeting.interrupted
        done = [e for e in run.server_events if e["type"] == "response.done"]
        assert done[-1]["response"]["status"] == "completed" and done[-1]["response"]["output"] == []
        assert "client_event_id" in done[-1]["response"]["metadata"]
        run.mic.say(wav_pcm())
        reply = await run.reply(after=0)
        assert run.mic.said_at is not None
        assert_a_full_reply(run, reply, run.mic.said_at)
        assert_no_error(run)


async def test_client_driven_turns(parrot_edge: LocalStack) -> None:
    # No server turn detection: the agent commits the user's turn and asks for the reply.
    async with agent_session(parrot_edge, turn_detection=None) as run:
        for turn in range(2):
            run.mic.say(wav_pcm())
            await asyncio.wait_for(run.mic.done.wait(), 10)
            committed_at = time.monotonic()
            run.session.commit_user_turn()
            reply = await run.reply(after=turn)
            assert_a_full_reply(run, reply, committed_at)
        created = [e for e in run.server_events if e["type"] == "response.created"]
        assert len(created) == 2 and all("client_event_id" in e["response"]["metadata"] for e in created)
        assert_no_error(run)


async def test_barge_in_interrupts_and_truncates_the_reply(parrot_edge: LocalStack) -> None:
    # LiveKit hears no user audio for the first 3 s of the agent's speech by default (its
    # aec_warmup_duration, against echo before echo cancellation settles); the parrot's replies
    # here are shorter, so the warm-up is off, as LiveKit's docs say for audio without echo.
    async with agent_session(parrot_edge, {"aec_warmup_duration": None}) as run:
        run.mic.say(wav_pcm())
        await until(lambda: run.speaker.segments, 20, "reply")
        await asyncio.sleep(0.8)  # the user hears part of the reply, then talks over it
        run.mic.say(wav_pcm())
        first = await run.reply(after=0)
        assert first.interrupted  # the playback stopped: the rest of the reply is not heard
        second = await run.reply(after=1)
        assert run.mic.said_at is not None
        assert_a_full_reply(run, second, run.mic.said_at)
        kinds = [e["type"] for e in run.server_events]
        assert "conversation.item.truncated" in kinds or "conversation.item.deleted" in kinds
        done = [e["response"] for e in run.server_events if e["type"] == "response.done"]
        assert done[0]["status"] == "cancelled" and done[0]["status_details"]["reason"] == "turn_detected"
        assert done[-1]["status"] == "completed"
        # LiveKit cancels the response it interrupted, which the server's turn detection has
        # cancelled already: OpenAI answers that with response_cancel_not_active, and so does the
        # edge (LiveKit knows it as the benign race it is).
        assert_no_error(run, benign=frozenset({"response_cancel_not_active"}))


async def test_history_edits_are_kept_and_the_conversation_goes_on(parrot_edge: LocalStack) -> None:
    async with agent_session(parrot_edge) as run:
        run.mic.say(wav_pcm())
        await run.reply(after=0)
        agent = run.session.current_agent
        # Add a user text message and an assistant message (the parrot does not take text: the
        # edge keeps them in the conversation), then remove the first again.
        ctx = agent.chat_ctx.copy()
        note = ctx.add_message(role="user", content="My name is Ada.")
        ctx.add_message(role="assistant", content="Hello Ada.")
        await asyncio.wait_for(agent.update_chat_ctx(ctx), 10)
        remote = run.rt_session().chat_ctx
        assert [m.text_content for m in remote.messages()][-2:] == ["My name is Ada.", "Hello Ada."]
        ctx = agent.chat_ctx.copy()
        ctx.items = [i for i in ctx.items if i.id != note.id]
        await asyncio.wait_for(agent.update_chat_ctx(ctx), 10)
        assert note.id not in [i.id for i in run.rt_session().chat_ctx.items]
        kinds = [e["type"] for e in run.server_events]
        assert kinds.count("conversation.item.deleted") >= 1
        # The conversation goes on.
        run.mic.say(wav_pcm())
        reply = await run.reply(after=1)
        assert run.mic.said_at is not None
        assert_a_full_reply(run, reply, run.mic.said_at)
        assert_no_error(run)
