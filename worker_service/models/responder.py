"""A responder stage: text in, text out (a pipeline's middle: ASR -> responder -> TTS).

The session hands it the user's transcript (a TEXT submission, ``text_final``) and a RESPOND; it
writes the reply a word per tick (``RequestNews.text``), as a language model streams tokens, and
ends it with ``response_finished``. What it answers is a ``TextResponder``'s: the built-in
``EchoResponder`` is deterministic ("You said: ..."), for the demo and the tests; a language model
stage implements the same interface.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

import torch

from duplex.audio import PCM16K_MONO
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import worker_pb2
from worker_service.model import (
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    bad_submission,
    check_option_keys,
)

FRAME: Final = 512
"""Its tick: 32 ms (it has no audio; the frame clock paces its words)."""
MAX_INPUT_CHARS: Final = 16_384


class TextResponder(Protocol):
    """What answers a turn: the reply to ``text``, in pieces (words, tokens) as they are made."""

    def reply(self, text: str) -> Iterator[str]: ...


class EchoResponder:
    """Says back what it heard: "You said: <text>." and a second sentence, word by word."""

    def reply(self, text: str) -> Iterator[str]:
        heard = " ".join(text.split())
        words = (f"You said: {heard}." if heard else "I did not catch that.").split()
        words += "What else would you like to say?".split()
        for i, word in enumerate(words):
            yield word if i == 0 else " " + word


@dataclass(slots=True, eq=False)
class ResponderState:
    text: list[str] = field(default_factory=list)
    final: bool = False
    responding: bool = False
    words: Iterator[str] | None = None
    started: bool = False


class ResponderModel(StepModel[ResponderState]):
    """Text in, text out, a piece per tick; see the module docstring."""

    model_id = "responder"
    audio_format = PCM16K_MONO
    frame_samples = FRAME

    def __init__(self, device: torch.device, *, responder: TextResponder | None = None) -> None:
        self.device = device
        self._responder = responder or EchoResponder()

    def parse_options(self, params: Mapping[str, object]) -> object:
        check_option_keys(params, frozenset())
        return None

    def create_state(self, session_id: str) -> ResponderState:
        return ResponderState()

    def release_state(self, state: ResponderState) -> None:
        self.cancel_response(state)

    def set_options(self, state: ResponderState, options: object) -> None:
        del state, options

    def commit(self, state: ResponderState) -> int:
        raise BadEventError(ErrorCode.UNSUPPORTED_BY_MODEL, "responder: COMMIT: it takes text")

    def clear(self, state: ResponderState) -> None:
        """The text given so far, and any reply to it, go (the next turn's text follows)."""
        self.cancel_response(state)

    def take_text(self, state: ResponderState, text: str, final: bool) -> None:
        if state.final:
            raise bad_submission("responder: text after the final piece of the turn")
        if sum(map(len, state.text)) + len(text) > MAX_INPUT_CHARS:
            raise bad_submission(f"responder: a turn's text is at most {MAX_INPUT_CHARS} characters")
        state.text.append(text)
        state.final = final

    def respond(self, state: ResponderState) -> None:
        state.responding = True

    def cancel_response(self, state: ResponderState) -> None:
        state.text.clear()
        state.final = state.responding = state.started = False
        state.words = None

    def is_responding(self, state: ResponderState) -> bool:
        return state.responding

    def step(self, batch: StepBatch[ResponderState]) -> StepResult:
        news: list[RequestNews | None] = [None] * len(batch.states)
        for i, st in enumerate(batch.states):
            if not (st.responding and st.final):
                continue  # its input is not all there yet
            if st.words is None:
                st.words = self._responder.reply("".join(st.text))
            piece = next(st.words, None)
            n = RequestNews(text=piece or "")
            if not st.started:
                st.started = n.response_started = True
            if piece is None:
                n.response_finished = True
                self.cancel_response(st)
            news[i] = n
        text = worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_TEXT)
        return StepResult(outputs=text, news=news, output_type=worker_pb2.OUTPUT_TYPE_TEXT)
