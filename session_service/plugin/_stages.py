"""Stages: a model served as a pipeline of worker models, each on its own pool of workers.

A plugin that declares ``stages`` is served in stages (ASR -> responder -> TTS; Thinker ->
Talker): the first stage is the model the session's input goes to (the plugin's own
``model_id``, placed as every session is); each later stage runs on workers of its own model
(``--stage-workers NAME=...``), placed from its own pool, fenced under the session's epoch.
The session runner orchestrates (``session_service.session.stages``): what a stage gives comes
back to it, and the plugin says what the next stage gets (``forward_text``, sentence by sentence
by default) and whether the client sees it on the way (``Stage.project_text``). Hand-offs are text
through the session tier; a stage fed tensors (a Talker fed a Thinker's hidden states) would get
them from its upstream worker directly, with the session tier still handing on the fences (see
``docs/serving-your-model.md``, "Models in stages").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class Flow(StrEnum):
    """What goes into or comes out of a stage."""

    AUDIO = "audio"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a model served in stages."""

    name: str
    """Its name (``--stage-workers NAME=...``, metric labels): lower case letters, digits, ``_``."""
    model_id: str
    """The worker model it needs (a worker of another model is refused, ``model_mismatch``)."""
    takes: Flow
    """What it is given: the session's input audio (the first stage), or text."""
    gives: Flow
    """What it gives: text (handed on to the next stage), or the reply's audio (the last)."""
    project_text: bool = False
    """Its text is the reply's text the client sees (``text_delta``); the last stage's always is.
    Off for a stage whose text is only the next stage's input (a responder before a TTS stage
    that sends the text with its audio); on for a Thinker whose text the client reads while the
    Talker speaks it."""
    responds: bool = True
    """It runs a reply for each response (RESPOND); a first stage that only listens (speech
    recognition: its part of a turn is the transcript at the turn's end) does not."""


#: A stage's name: what ``--stage-workers`` and metric labels carry.
STAGE_NAME: Final = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

#: Where a sentence ends: its mark, closing quotes or brackets, then white space.
_SENTENCE_END: Final = re.compile(r"[.!?]+[\"')\]]*\s+")


def split_sentences(text: str, final: bool) -> tuple[list[str], str]:
    """``text`` cut into whole sentences to hand on now and the rest, kept until it ends (all of
    it goes when ``final``). Each sentence keeps its marks; white space between them goes."""
    pieces: list[str] = []
    start = 0
    for end in _SENTENCE_END.finditer(text):
        piece = text[start : end.end()].strip()
        if piece:
            pieces.append(piece)
        start = end.end()
    rest = text[start:]
    if final:
        if rest.strip():
            pieces.append(rest.strip())
        rest = ""
    return pieces, rest
