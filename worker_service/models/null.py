"""The null model: a lockstep model whose compute is near zero, to measure what the worker costs.

Everything a step does beyond the engine's own work is one pass over the batch that moves a few
integers per request; it never reads the samples. It keeps the submission semantics of the other
models so a benchmark (``benchmarks.worker_ceiling``) or a test can drive it like any of them:
COMMIT takes the input consumed since the last commit (its length only), RESPOND starts a reply of
``reply_frames`` frames of a fixed quiet tone, one frame per input frame (``lockstep``, as the
parrot), sent as a typed sparse ``MultimodalOutputs`` (``req_id`` = the replying requests only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from duplex.audio import PCM16K_MONO, encode
from duplex.v1 import common_pb2, worker_pb2
from worker_service.model import (
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    check_option_keys,
    float_option,
    no_committed_input,
)

FRAME = 512
"""32 ms at 16 kHz, as the parrot's."""
TONE_HZ = 440.0
TONE_AMPLITUDE = 0.05
_OPTION_KEYS = frozenset({"reply_frames"})


@dataclass(frozen=True, slots=True)
class NullOptions:
    """Per-session options (submission ``params``)."""

    reply_frames: int = 25
    """Frames in one reply (800 ms at the default)."""

    @classmethod
    def parse(cls, params: Mapping[str, object], base: NullOptions) -> NullOptions:
        check_option_keys(params, _OPTION_KEYS)
        return replace(
            base, reply_frames=int(float_option(params, "reply_frames", base.reply_frames, 1, 100_000))
        )


@dataclass(slots=True, eq=False)
class NullState:
    """One session: counts of samples, nothing else."""

    options: NullOptions
    uncommitted: int = 0
    """Input samples consumed since the last commit or clear."""
    committed: int = 0
    """Length of the committed utterance in samples (0: none)."""
    reply_left: int = 0
    """Reply frames still to emit."""
    reply_started: bool = False


def tone_frame() -> bytes:
    """One frame of the reply's tone, as s16le: the same bytes in every reply frame."""
    t = np.arange(FRAME, dtype=np.float32) / np.float32(PCM16K_MONO.sample_rate_hz)
    wave = (TONE_AMPLITUDE * np.sin(2.0 * np.pi * TONE_HZ * t)).astype(np.float32)
    return encode(wave, PCM16K_MONO)


class NullModel(StepModel[NullState]):
    """Near-zero compute, lockstep; replies with a fixed tone. See the module docstring."""

    model_id = "null"
    audio_format = PCM16K_MONO
    frame_samples = FRAME
    lockstep = True

    def __init__(self, device: torch.device, **defaults: object) -> None:
        self.device = device
        self.defaults = NullOptions.parse(defaults, NullOptions())
        self._payload = common_pb2.AudioPayload(pcm=tone_frame(), format=self.audio_format.to_proto())
        self._replying = 0
        """Requests with reply frames left: a step skips its reply pass when there are none."""

    def parse_options(self, params: Mapping[str, object]) -> NullOptions:
        return NullOptions.parse(params, self.defaults)

    def create_state(self, session_id: str) -> NullState:
        return NullState(options=self.defaults)

    def release_state(self, state: NullState) -> None:
        self.cancel_response(state)

    def set_options(self, state: NullState, options: object) -> None:
        assert isinstance(options, NullOptions)
        state.options = options

    def commit(self, state: NullState) -> int:
        state.committed, state.uncommitted = state.uncommitted, 0
        return state.committed

    def clear(self, state: NullState) -> None:
        state.uncommitted = 0

    def respond(self, state: NullState) -> None:
        if state.committed == 0:
            raise no_committed_input()
        if state.reply_left == 0:
            self._replying += 1
        state.reply_left = state.options.reply_frames
        state.reply_started = False

    def cancel_response(self, state: NullState) -> None:
        if state.reply_left:
            self._replying -= 1
        state.reply_left = 0

    def is_responding(self, state: NullState) -> bool:
        return state.reply_left > 0

    def step(self, batch: StepBatch[NullState]) -> StepResult:
        states = batch.states
        news: list[RequestNews | None] = [None] * len(states)
        out = worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_AUDIO, sparse_audio=True)
        has_input: list[bool] = batch.has_input.tolist()
        for st, fed in zip(states, has_input, strict=True):
            if fed:
                st.uncommitted += FRAME
        if not self._replying:
            return StepResult(outputs=out, news=news)
        for i, (st, fed) in enumerate(zip(states, has_input, strict=True)):
            if not (fed and st.reply_left):
                continue  # lockstep: a reply frame only for an input frame
            n = news[i] = RequestNews()
            if not st.reply_started:
                st.reply_started = n.response_started = True
            st.reply_left -= 1
            if st.reply_left == 0:
                self._replying -= 1
                n.response_finished = True
            out.req_id.append(batch.req_ids[i])
            out.audio.append(self._payload)
        return StepResult(outputs=out, news=news)
