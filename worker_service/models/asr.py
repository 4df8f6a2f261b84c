"""A speech recognition stage: the parrot's turn detection (Silero VAD) with PocketSphinx
recognizing what the user says, streaming (a pipeline's first stage: ASR -> responder -> TTS).

Per session, a PocketSphinx decoder (``pocketsphinx`` ships its en-us acoustic model, language
model and dictionary in its wheel; nothing is fetched) hears each utterance: it starts at the
VAD's speech start (with a few frames before it), takes every frame until the turn ends, and
then gives the turn's transcript with the turn end (``RequestNews.user_transcript``). On the way,
every few frames, the words of its partial hypothesis that stood still since the last look go
out as the next piece of the turn's words (``RequestNews.user_text``; the last word is held back,
it may still change). Turn ends, VAD events and replay are the parrot's: only the reply differs
(there is none: this stage never answers, the next stages do).

A decoder costs about 90 MB and a third of a second to make (its dictionary), holding the GIL all
along, so decoders are pooled and a session holds one only while its user speaks: taken at the
utterance's start (with the cepstral mean the session's voice left, ``AsrState.cmn``), given back
at its end. The pool is as large as the most users who ever spoke at once, and a few spare ones
are made ahead on a helper thread (each stalls the engine for that third of a second: it grows
only when more users speak at once than ever before). PocketSphinx holds the GIL while it decodes
too, so its frames are decoded on the engine thread.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from duplex.errors import BadEventError, ErrorCode
from worker_service.model import SPEECH_STARTED, FloatArray, RequestNews
from worker_service.models.parrot import ParrotModel, ParrotState

logger = logging.getLogger(__name__)

PRE_ROLL_FRAMES: Final = 8
"""Frames before the VAD's speech start the recognizer hears too (its first phones)."""
PARTIAL_EVERY: Final = 4
"""Frames between two looks at the partial hypothesis (each look costs a search)."""
CMN_START: Final = "56,5.4,-5.5,23,-15,0.56,1.6,-19,-1.4,-13,12,-4.8,-5.3"
"""Where each session's cepstral mean starts. PocketSphinx normalizes features by a running mean
(live CMN) that adapts to the voice as it speaks; the model's own start (40,3,-1,0,...) is so far
from speech at a usual level that a fresh decoder misheard most of a first sentence (11 of 58
words of ten eSpeak NG sentences). This one, where a decoder settled after five sentences of
speech, got 30 of 58 right from the first sentence on; it adapts to each voice from there."""


def make_decoder() -> Any:
    """A PocketSphinx decoder of the wheel's en-us model at 16 kHz: one search pass (the second
    passes rewrote good partial hypotheses into worse finals on synthetic speech), pruned for real
    time (at most 3,000 HMMs and 5 word exits a frame: on 21 eSpeak NG sentences, CPU per second
    of audio 0.24 -> 0.11 and its slowest frame 59 -> 19 ms, for 74 of 108 words right instead of
    79)."""
    from pocketsphinx import Decoder

    decoder = Decoder(
        samprate=16000, bestpath=False, fwdflat=False, maxhmmpf=3000, maxwpf=5, loglevel="FATAL"
    )
    decoder.set_cmn(CMN_START)
    return decoder


@dataclass(slots=True, eq=False)
class AsrState(ParrotState):
    decoder: Any = None
    """Its decoder while its user speaks (None between utterances)."""
    cmn: str = CMN_START
    """Where its cepstral mean got to (its voice's: the next utterance's decoder starts there)."""
    recent: deque[FloatArray] = field(default_factory=lambda: deque(maxlen=PRE_ROLL_FRAMES))
    """The last frames heard (the pre-roll of the next utterance)."""
    in_utterance: bool = False
    frames: int = 0
    """Frames of the current utterance."""
    said: list[str] = field(default_factory=list)
    """Words of the current turn already sent as ``user_text``."""
    last_hyp: list[str] = field(default_factory=list)
    """The partial hypothesis of the last look."""
    heard: str = ""
    """The transcript of the utterance the last COMMIT ended."""


class AsrModel(ParrotModel):
    """Turns by Silero VAD, words by PocketSphinx; see the module docstring."""

    model_id = "asr"
    lockstep = False  # it never replies: nothing to clock

    def __init__(self, device: torch.device, *, spare_decoders: int = 2, **defaults: object) -> None:
        super().__init__(device, **defaults)  # type: ignore[arg-type]  # the parrot checks its options
        self._spare = spare_decoders
        self._decoders: deque[Any] = deque(make_decoder() for _ in range(spare_decoders))
        self._making: Future[Any] | None = None
        self._maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr-decoder")

    def _decoder(self) -> Any:
        """A spare decoder (made now only when none is ready), and another started if few are."""
        if self._making is not None and self._making.done():
            self._decoders.append(self._making.result())
            self._making = None
        decoder = self._decoders.popleft() if self._decoders else make_decoder()
        if len(self._decoders) < self._spare and self._making is None:
            self._making = self._maker.submit(make_decoder)
        return decoder

    def create_state(self, session_id: str) -> AsrState:
        base = super().create_state(session_id)
        return AsrState(slot=base.slot, options=base.options, buffer=base.buffer)

    def release_state(self, state: ParrotState) -> None:
        super().release_state(state)
        assert isinstance(state, AsrState)
        self._end_utterance(state)

    def _give_back(self, st: AsrState) -> None:
        """The utterance ended: its decoder goes back to the pool, the session keeps its voice's
        mean (nothing of it carries over to the next user of the decoder)."""
        decoder, st.decoder = st.decoder, None
        st.cmn = decoder.get_cmn()
        self._decoders.append(decoder)

    def respond(self, state: ParrotState) -> None:
        raise BadEventError(ErrorCode.UNSUPPORTED_BY_MODEL, "asr: RESPOND: the next stages answer")

    def clear(self, state: ParrotState) -> None:
        super().clear(state)
        assert isinstance(state, AsrState)
        self._end_utterance(state)
        state.said = []

    def commit(self, state: ParrotState) -> int:
        """The client's commit: the utterance so far ends here, its transcript goes with the
        COMMIT's answer (``committed_transcript``)."""
        n = super().commit(state)
        assert isinstance(state, AsrState)
        state.heard = self._end_utterance(state)
        state.said = []
        return n

    def committed_transcript(self, state: ParrotState) -> str | None:
        assert isinstance(state, AsrState)
        return state.heard

    def _listen(self, st: ParrotState, frame: FloatArray, prob: float) -> RequestNews | None:
        assert isinstance(st, AsrState)
        news = super()._listen(st, frame, prob)
        speech_started = news is not None and any(kind == SPEECH_STARTED for kind, _ in news.vad)
        if speech_started and not st.in_utterance:
            st.decoder = self._decoder()
            st.decoder.set_cmn(st.cmn)
            st.decoder.start_utt()
            st.in_utterance, st.frames, st.said, st.last_hyp = True, 0, [], []
            for past in st.recent:
                self._hear(st, past)
        st.recent.append(frame.copy())
        if not st.in_utterance:
            return news
        self._hear(st, frame)
        st.frames += 1
        if news is not None and news.turn_ended:
            news.user_transcript = self._end_utterance(st)
            rest = news.user_transcript.split()[len(st.said) :]
            if rest and news.user_transcript.split()[: len(st.said)] == st.said:
                news.user_text = _piece(st.said, rest)
            st.said = []
            return news
        if st.frames % PARTIAL_EVERY:
            return news
        words = self._stable_words(st)
        if not words:
            return news
        out = news or RequestNews()
        out.user_text = _piece(st.said, words)
        st.said.extend(words)
        return out

    @staticmethod
    def _hear(st: AsrState, frame: FloatArray) -> None:
        pcm = (np.clip(frame, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        st.decoder.process_raw(pcm, False, False)

    @staticmethod
    def _stable_words(st: AsrState) -> list[str]:
        """Words of the partial hypothesis past those sent that stood still since the last look
        (and are not its last word: that one may still grow); none when the hypothesis no longer
        starts with what was sent (the transcript at the turn's end says it right)."""
        hyp = st.decoder.hyp()
        words = hyp.hypstr.split() if hyp is not None else []
        last, st.last_hyp = st.last_hyp, words
        stable = 0
        while stable < min(len(words) - 1, len(last)) and words[stable] == last[stable]:
            stable += 1
        if words[: len(st.said)] != st.said:
            return []
        return words[len(st.said) : stable]

    def _end_utterance(self, st: AsrState) -> str:
        if not st.in_utterance:
            return ""
        hyp = st.decoder.hyp()  # the last partial: before end_utt's final search rewrites it
        st.decoder.end_utt()
        st.in_utterance = False
        self._give_back(st)
        return " ".join(hyp.hypstr.split()) if hyp is not None else ""


def _piece(said: list[str], words: list[str]) -> str:
    """The next piece of the turn's words: a space before it unless it is the first."""
    return (" " if said else "") + " ".join(words)
