"""When a model-native speaker speaks: its speech spans, from the text it thinks aloud.

Moshi-class models stream an inner monologue beside their audio: one text token per frame, a
padding token (Moshi: 0 and 3) when it says nothing. A span starts at a frame whose token is a
word and ends after ``quiet_frames`` frames of padding; its frames are the model's speech. The
session service makes each span a response (``response_started`` with its first frame,
``response_finished`` with its last), so when to speak is the model's decision, not a turn
detector's.

A span can be muted (a client's ``response.cancel``): its frames are not heard any more, and the
next span the model starts after falling silent is a new response. All of it is per slot, over
arrays: one vectorised update per step for the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class SpanStep:
    """One step's span news, aligned to the slots stepped."""

    audible: BoolArray
    """The frame is part of a span that is heard (its audio and text go to the session)."""
    started: BoolArray
    """A heard span starts with this frame."""
    finished: BoolArray
    """A heard span ends with this frame."""


class SpanTracker:
    """The speaking state of ``slots`` slots."""

    def __init__(self, slots: int, *, quiet_frames: int, silent_tokens: Iterable[int]) -> None:
        if quiet_frames < 1:
            raise ValueError("quiet_frames must be >= 1")
        self.quiet_frames = quiet_frames
        self._silent = np.array(sorted(set(silent_tokens)), dtype=np.int64)
        self.speaking = np.zeros(slots, dtype=np.bool_)
        self.quiet = np.zeros(slots, dtype=np.int64)
        """Frames of padding since the last word, per speaking slot."""
        self.muted = np.zeros(slots, dtype=np.bool_)
        """The slot's current span is not heard (cancelled); cleared when it ends."""

    def reset(self, slot: int) -> None:
        """A session takes (or leaves) the slot: it is silent and heard."""
        self.speaking[slot] = False
        self.quiet[slot] = 0
        self.muted[slot] = False

    def mute(self, slot: int) -> bool:
        """Stop hearing the slot's current span until it ends; returns whether one was running."""
        if not self.speaking[slot]:
            return False
        self.muted[slot] = True
        return True

    def step(self, slots: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64]) -> SpanStep:
        """The text tokens of ``slots`` for one frame each: update their spans and say which frames
        are heard, and where heard spans start and end."""
        word = ~np.isin(tokens, self._silent)
        was = self.speaking[slots]
        quiet = np.where(word, 0, self.quiet[slots] + 1)
        now = np.where(was, quiet < self.quiet_frames, word)
        muted = self.muted[slots]
        heard = ~muted
        started = now & ~was & heard
        finished = was & ~now & heard
        audible = (now | finished) & heard
        self.speaking[slots] = now
        self.quiet[slots] = np.where(now, quiet, 0)
        self.muted[slots] = muted & now  # a muted span that ended: the next one is heard
        return SpanStep(audible=audible, started=started, finished=finished)
