"""Pipecat through the Realtime edge, as its users run it: a pipeline of a transport, the context
aggregators and ``OpenAIRealtimeLLMService(base_url=...)`` pointed at
``duplex up --realtime-port`` (no room or WebRTC: the transport is built on Pipecat's own
``BaseInputTransport``/``BaseOutputTransport``, a microphone speaking tests/fixtures/hello.wav in
real time and a speaker that plays what it gets in real time).

Pipecat ends its pipeline on any ``error`` event but the two benign races it knows, so each
pattern here must hold a conversation with the parrot with no ``ErrorFrame``: server VAD with the
bot speaking first and a user text message in the context, and locally driven turns with
Pipecat's own VAD (Silero)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from duplex.audio import PCM16K_MONO as PCM16K
from duplex.audio import PcmFormat
from duplex.stack import LocalStack
from realtime_service.protocol import PCM24K
from tests.framework_helpers import (
    HELLO_SPEECH_S,
    LATE_S,
    Microphone,
    parrot_edge,
    rms,
    until,
    wav_pcm,
)

pytest.importorskip("pipecat", reason="the frameworks extra is not installed (make setup)")
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import (
    BotStoppedSpeakingFrame,
    ErrorFrame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    LLMRunFrame,
    OutputAudioRawFrame,
    StartFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import BaseTransport, TransportParams

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]
__all__ = ["parrot_edge"]

RATE = 24_000


class MicTransport(BaseInputTransport):
    """Pipecat's input transport, its audio the microphone's."""

    def __init__(self, mic: Microphone, params: TransportParams) -> None:
        super().__init__(params)
        self.mic = mic
        self.rate = mic.fmt.sample_rate_hz
        self._feeder: asyncio.Task[None] | None = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)
        if self._feeder is None:
            self._feeder = self.create_task(self._feed())

    async def _feed(self) -> None:
        while True:
            pcm = await self.mic.chunk()
            await self.push_audio_frame(InputAudioRawFrame(audio=pcm, sample_rate=self.rate, num_channels=1))

    async def cleanup(self) -> None:
        if self._feeder is not None:
            await self.cancel_task(self._feeder)
            self._feeder = None
        await super().cleanup()


@dataclass
class Speech:
    started_at: float
    audio: bytearray = field(default_factory=bytearray)
    ended: bool = False


class SpeakerTransport(BaseOutputTransport):
    """Pipecat's output transport: plays its audio in real time and keeps it, per bot turn."""

    def __init__(self, params: TransportParams) -> None:
        super().__init__(params)
        self.speeches: list[Speech] = []

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        if not self.speeches or self.speeches[-1].ended:
            self.speeches.append(Speech(time.monotonic()))
        self.speeches[-1].audio += frame.audio
        await asyncio.sleep(len(frame.audio) / 2 / frame.sample_rate)
        return True


class WavTransport(BaseTransport):
    def __init__(self, mic: Microphone) -> None:
        super().__init__()
        params = TransportParams(
            audio_in_enabled=True,
            audio_in_sample_rate=mic.fmt.sample_rate_hz,
            audio_out_enabled=True,
            audio_out_sample_rate=RATE,
        )
        self._input = MicTransport(mic, params)
        self._output = SpeakerTransport(params)

    def input(self) -> FrameProcessor:
        return self._input

    def output(self) -> FrameProcessor:
        return self._output


class Watch(BaseObserver):
    """Pipecat's own observer API: the bot's turns and every error frame."""

    def __init__(self, speaker: SpeakerTransport) -> None:
        super().__init__()
        self.speaker = speaker
        self.errors: list[ErrorFrame] = []
        self.responses_ended = 0
        """LLMFullResponseEndFrames the realtime service pushed (one per response it saw end)."""

    async def on_push_frame(self, data: FramePushed) -> None:
        frame = data.frame
        if isinstance(frame, ErrorFrame) and frame not in self.errors:
            self.errors.append(frame)
        if isinstance(frame, LLMFullResponseEndFrame) and isinstance(data.source, OpenAIRealtimeLLMService):
            self.responses_ended += 1
        if isinstance(frame, BotStoppedSpeakingFrame) and self.speaker.speeches:
            self.speaker.speeches[-1].ended = True


@dataclass
class Run:
    task: PipelineTask
    mic: Microphone
    speaker: SpeakerTransport
    watch: Watch
    llm: OpenAIRealtimeLLMService

    async def reply(self, index: int, timeout_s: float = 20.0) -> Speech:
        """The bot's ``index``-th turn of speech, once it ended."""
        speeches = self.speaker.speeches
        await until(lambda: len(speeches) > index and speeches[index].ended, timeout_s, f"reply {index + 1}")
        return speeches[index]

    def assert_no_error(self) -> None:
        assert self.watch.errors == [], [e.error for e in self.watch.errors]
        assert not self.task.has_finished()


def assert_a_full_reply(reply: Speech, turn_end: float) -> None:
    assert reply.started_at - turn_end < LATE_S, f"the reply came {reply.started_at - turn_end:.1f}s late"
    assert len(reply.audio) / 2 / RATE > HELLO_SPEECH_S * 0.8 and rms(bytes(reply.audio)) > 0.01


@contextlib.asynccontextmanager
async def pipeline(
    stack: LocalStack,
    session: events.SessionProperties,
    messages: list[dict[str, Any]],
    user_params: LLMUserAggregatorParams | None = None,
    mic_format: PcmFormat = PCM24K,
    tools: ToolsSchema | None = None,
) -> AsyncIterator[Run]:
    mic = Microphone(mic_format)
    transport = WavTransport(mic)
    llm = OpenAIRealtimeLLMService(
        api_key="unused",
        base_url=stack.realtime_url + "/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model="parrot", session_properties=session),
    )
    context = LLMContext(messages, tools) if tools is not None else LLMContext(messages)
    aggregators = LLMContextAggregatorPair(context, user_params=user_params)
    task = PipelineTask(
        Pipeline([transport.input(), aggregators.user(), llm, transport.output(), aggregators.assistant()]),
        params=PipelineParams(audio_in_sample_rate=mic_format.sample_rate_hz, audio_out_sample_rate=RATE),
    )
    watch = Watch(transport._output)
    task.add_observer(watch)
    runner = PipelineRunner(handle_sigint=False)
    running = asyncio.create_task(runner.run(task))
    try:
        yield Run(task, mic, transport._output, watch, llm)
    finally:
        await task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)


async def test_server_vad_the_bot_speaks_first_with_a_user_text_message(parrot_edge: LocalStack) -> None:
    # Pipecat's example: the context opens with a user text message and the bot is asked to
    # speak first. The parrot takes no text (the edge keeps it in the conversation) and has
    # nothing to say yet: an empty completed response, no error.
    session = events.SessionProperties(
        audio=events.AudioConfiguration(
            input=events.AudioInput(
                transcription=events.InputAudioTranscription(),
                turn_detection=events.TurnDetection(silence_duration_ms=500),
                noise_reduction=events.InputAudioNoiseReduction(type="near_field"),
            )
        ),
        instructions="Repeat what the user says.",
    )
    messages = [{"role": "user", "content": "Say hello to the user."}]
    # A tool, as in Pipecat's example: kept by the edge, never called (the parrot calls none).
    weather = FunctionSchema(
        name="get_weather",
        description="The weather in a city",
        properties={"city": {"type": "string"}},
        required=["city"],
    )
    calls: list[Any] = []

    async def get_weather(params: Any) -> None:
        calls.append(params)
        await params.result_callback({"weather": "sunny"})

    async with pipeline(parrot_edge, session, messages, tools=ToolsSchema(standard_tools=[weather])) as run:
        run.llm.register_function("get_weather", get_weather)
        await run.task.queue_frames([LLMRunFrame()])
        await until(lambda: run.watch.responses_ended, 10, "the greeting's end")
        assert run.speaker.speeches == []  # an empty response: nothing to say yet
        for turn in range(2):
            run.mic.say(wav_pcm())
            reply = await run.reply(turn)
            assert run.mic.said_at is not None
            assert_a_full_reply(reply, run.mic.said_at)
        run.assert_no_error()
        assert calls == []


async def test_semantic_vad(parrot_edge: LocalStack) -> None:
    session = events.SessionProperties(
        audio=events.AudioConfiguration(
            input=events.AudioInput(turn_detection=events.SemanticTurnDetection(eagerness="high"))
        )
    )
    async with pipeline(parrot_edge, session, []) as run:
        run.mic.say(wav_pcm())
        reply = await run.reply(0)
        assert run.mic.said_at is not None
        assert_a_full_reply(reply, run.mic.said_at)
        run.assert_no_error()


async def test_locally_driven_turns_with_pipecats_own_vad(parrot_edge: LocalStack) -> None:
    # Pipecat's "locally driven turns" example: server turn detection off, Pipecat's Silero VAD
    # ends the user's turn, the service commits the input and asks for the response.
    session = events.SessionProperties(
        audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=False))
    )
    # Silero takes 16 kHz (or 8 kHz): the microphone is 16 kHz, as in Pipecat's examples. The
    # phrase has a 150 ms pause in it: Pipecat's default stop_secs (0.2 s) can end the turn
    # there (Pipecat then clears the input and cancels the reply it asked for), so the turn ends
    # after half a second of silence, as with the server's VAD.
    user_params = LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer(params=VADParams(stop_secs=0.5)))
    async with pipeline(parrot_edge, session, [], user_params, PCM16K) as run:
        for turn in range(2):
            run.mic.say(wav_pcm(fmt=PCM16K))
            reply = await run.reply(turn)
            assert run.mic.said_at is not None
            assert_a_full_reply(reply, run.mic.said_at)
        run.assert_no_error()
