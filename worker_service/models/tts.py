"""A speech synthesis stage: text in, speech out, sentence by sentence (eSpeak NG in process).

A pipeline's last stage (``session_service.plugins.cascade``): the session hands it the reply's
text as it is written (TEXT submissions, a sentence each, the last one ``text_final``) and a
RESPOND. Each sentence is synthesized on a helper thread as soon as it comes (``run_as_helper``:
its CPU counts as the model's), and the reply plays out at real time: one 32 ms frame per tick of
the engine's frame clock, the first as soon as the first sentence is ready. The text of each
sentence goes out with its first frame (``RequestNews.text``: the transcript in step with its
audio). After a failover the session asks it to leave out what the client already heard
(``skip_samples``): the same text synthesizes to the same speech, so nothing is heard twice
(eSpeak NG's output varies by a few samples from one synthesis to the next, under a millisecond
per sentence: the seam is that close, not exact to the sample).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np
import torch

from duplex.audio import PCM16K_MONO, encode, resample
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2, worker_pb2
from worker_service.model import (
    FloatArray,
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    bad_submission,
    check_option_keys,
    float_option,
    run_as_helper,
)
from worker_service.models.espeak import Espeak

FRAME: Final = 512
"""32 ms at 16 kHz."""
_OPTION_KEYS: Final = frozenset({"skip_samples", "voice", "wpm"})


@dataclass(frozen=True, slots=True)
class TtsOptions:
    skip_samples: int = 0
    """Samples of the reply left out at its start (what a client heard from a lost worker)."""
    voice: str = "en-us"
    wpm: int = 160

    @classmethod
    def parse(cls, params: Mapping[str, object], base: TtsOptions) -> TtsOptions:
        check_option_keys(params, _OPTION_KEYS)
        voice = params.get("voice", base.voice)
        name = voice.replace("-", "").replace("+", "") if isinstance(voice, str) else ""
        if not isinstance(voice, str) or not 0 < len(voice) <= 32 or not name.isalnum():
            raise bad_submission("option 'voice' must be an eSpeak NG voice name")
        return replace(
            base,
            skip_samples=int(float_option(params, "skip_samples", base.skip_samples, 0, 16000 * 3600)),
            voice=voice,
            wpm=int(float_option(params, "wpm", base.wpm, 80, 450)),
        )


@dataclass(slots=True, eq=False)
class TtsState:
    options: TtsOptions
    sentences: deque[str] = field(default_factory=deque)
    """Text given, not yet handed to synthesis."""
    final: bool = False
    """The last sentence has come."""
    responding: bool = False
    pending: deque[tuple[str, Future[FloatArray]]] = field(default_factory=deque)
    """Sentences being synthesized, in order."""
    audio: FloatArray = field(default_factory=lambda: np.zeros(0, np.float32))
    """Synthesized and not yet played."""
    marks: deque[tuple[int, str]] = field(default_factory=deque)
    """(samples into ``audio`` where a sentence starts, its text), for the text news."""
    skip: int = 0
    """Samples still to leave out."""
    said: bool = False
    """Text of this reply went out (the next sentence's is joined on with a space)."""
    started: bool = False


class TtsModel(StepModel[TtsState]):
    """Text in, speech out; see the module docstring."""

    model_id = "tts"
    audio_format = PCM16K_MONO
    frame_samples = FRAME

    def __init__(self, device: torch.device, *, helpers: int = 2) -> None:
        self.device = device
        self._espeak = Espeak.shared()
        self._fmt = self.audio_format.to_proto()
        self._pool = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="tts")

    def parse_options(self, params: Mapping[str, object]) -> TtsOptions:
        return TtsOptions.parse(params, TtsOptions())

    def create_state(self, session_id: str) -> TtsState:
        return TtsState(TtsOptions())

    def release_state(self, state: TtsState) -> None:
        self.cancel_response(state)

    def set_options(self, state: TtsState, options: object) -> None:
        assert isinstance(options, TtsOptions)
        state.options = options
        state.skip = options.skip_samples

    def commit(self, state: TtsState) -> int:
        raise BadEventError(ErrorCode.UNSUPPORTED_BY_MODEL, "tts: COMMIT: it takes text")

    def clear(self, state: TtsState) -> None:
        """The text given so far, and what it was saying, go (the next reply's text follows)."""
        self.cancel_response(state)

    def take_text(self, state: TtsState, text: str, final: bool) -> None:
        if state.final:
            raise bad_submission("tts: text after the final piece of the reply")
        if text.strip():
            state.sentences.append(text)
        state.final = final
        if state.responding:
            self._synthesize(state)

    def respond(self, state: TtsState) -> None:
        state.responding = True
        state.said = state.skip > 0  # after a failover the client heard the reply's start
        self._synthesize(state)

    def _synthesize(self, state: TtsState) -> None:
        opts = state.options
        while state.sentences:
            sentence = state.sentences.popleft()
            state.pending.append(
                (sentence, self._pool.submit(run_as_helper, lambda s=sentence: self._speak(s, opts)))
            )

    def _speak(self, sentence: str, opts: TtsOptions) -> FloatArray:
        voice = self._espeak.synthesize(sentence, voice=opts.voice, wpm=opts.wpm)
        out: FloatArray = resample(voice, self._espeak.sample_rate, self.audio_format.sample_rate_hz)
        return out

    def cancel_response(self, state: TtsState) -> None:
        for _, fut in state.pending:
            fut.cancel()
        state.sentences.clear()
        state.pending.clear()
        state.marks.clear()
        state.audio = np.zeros(0, np.float32)
        state.final = state.responding = state.started = state.said = False

    def is_responding(self, state: TtsState) -> bool:
        return state.responding

    def step(self, batch: StepBatch[TtsState]) -> StepResult:
        news: list[RequestNews | None] = [None] * len(batch.states)
        out = worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_AUDIO, sparse_audio=True)
        for i, st in enumerate(batch.states):
            if not st.responding:
                continue
            try:
                self._collect(st)
            except Exception as exc:  # this reply failed; the batch goes on
                news[i] = RequestNews(error=f"speech synthesis failed: {exc}")
                self.cancel_response(st)
                continue
            frame, text = self._next_frame(st)
            if frame is None:
                continue
            n = RequestNews(text=text)
            if not st.started:
                st.started = n.response_started = True
            if st.final and not st.pending and not len(st.audio):
                n.response_finished = True
                st.responding = st.started = st.final = False
            out.req_id.append(batch.req_ids[i])
            out.audio.append(common_pb2.AudioPayload(pcm=encode(frame, self.audio_format), format=self._fmt))
            news[i] = n
        return StepResult(outputs=out, news=news)

    @staticmethod
    def _collect(st: TtsState) -> None:
        """Synthesized sentences, in order, onto the audio to play (a skip leaves out what the
        client heard before)."""
        while st.pending and st.pending[0][1].done():
            sentence, fut = st.pending.popleft()
            audio = fut.result()
            drop = min(st.skip, len(audio))
            st.skip -= drop
            if drop < len(audio):
                if not drop:  # a sentence the client heard the start of has had its text
                    st.marks.append((len(st.audio), sentence))
                st.audio = np.concatenate([st.audio, audio[drop:]])

    def _next_frame(self, st: TtsState) -> tuple[FloatArray | None, str]:
        """The next frame to play and the text of the sentences starting in it; None while the
        next sentence is still being synthesized (or not given yet)."""
        n = self.frame_samples
        last = st.final and not st.pending
        if len(st.audio) < n and not last:
            return None, ""  # the next sentence is not ready: nothing this tick
        frame = np.zeros(n, np.float32)
        take = min(n, len(st.audio))
        frame[:take] = st.audio[:take]
        st.audio = st.audio[take:]
        text = []
        while st.marks and st.marks[0][0] < take:
            text.append(st.marks.popleft()[1])
        st.marks = deque((pos - take, s) for pos, s in st.marks)
        if not text:
            return frame, ""
        joined = (" " if st.said else "") + " ".join(text)
        st.said = True
        return frame, joined
