"""A synthetic model with a configurable compute cost, for load tests and benchmarks.

Each step runs a batched tanh-RNN of ``layers`` ``hidden_size`` x ``hidden_size`` matmuls over the
requests in the batch, with per-session hidden state in one device tensor (slot-indexed, like
the parrot's VAD state). A RESPOND makes the request emit ``reply_frames`` frames of audio, one
every ``emit_every``-th step of that request, so steps are sparse by construction.

Its outputs use the legacy ``multimodal_outputs`` dict form (``audio`` + ``meta.sparse_audio`` /
``meta.req_id``), so the engine's adapter path is exercised by every load test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from duplex.audio import PCM16K_MONO
from worker_service.model import (
    FloatArray,
    InputBuffer,
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    check_option_keys,
    float_option,
    no_committed_input,
)

FRAME = 512
_OPTION_KEYS = frozenset({"emit_every", "reply_frames"})


@dataclass(frozen=True, slots=True)
class SyntheticOptions:
    """Per-session options (submission ``params``)."""

    emit_every: int = 1
    """A replying request emits audio on every k-th of its steps."""
    reply_frames: int = 25
    """Frames in one reply."""

    @classmethod
    def parse(cls, params: Mapping[str, object], base: SyntheticOptions) -> SyntheticOptions:
        check_option_keys(params, _OPTION_KEYS)
        return replace(
            base,
            emit_every=int(float_option(params, "emit_every", base.emit_every, 1, 1000)),
            reply_frames=int(float_option(params, "reply_frames", base.reply_frames, 1, 100_000)),
        )


@dataclass(slots=True, eq=False)
class SyntheticState:
    slot: int
    options: SyntheticOptions
    buffer: InputBuffer
    steps: int = 0
    committed: int = 0
    reply_left: int = 0
    reply_started: bool = False


class SyntheticModel(StepModel[SyntheticState]):
    """Random-weight RNN with a tunable cost; replies with generated audio."""

    model_id = "synthetic"
    audio_format = PCM16K_MONO
    frame_samples = FRAME

    def __init__(
        self,
        device: torch.device,
        *,
        hidden_size: int = 256,
        layers: int = 2,
        seed: int = 0,
        initial_slots: int = 64,
        invalid_sparse: bool = False,
        **defaults: object,
    ) -> None:
        """``invalid_sparse``: fault injection for alerting tests: every audio step declares its
        sparse marker with an illegal carrier, so the worker fails it closed (no audio routed,
        counted in ``duplex_sparse_fail_closed_total``)."""
        if hidden_size < 1 or layers < 1:
            raise ValueError("hidden_size and layers must be >= 1")
        if not isinstance(invalid_sparse, bool):
            raise ValueError("invalid_sparse must be a bool")
        self._invalid_sparse = invalid_sparse
        self.device = device
        self.defaults = SyntheticOptions.parse(defaults, SyntheticOptions())
        gen = torch.Generator().manual_seed(seed)
        scale = 1.0 / hidden_size**0.5
        self._w_in = (torch.randn(FRAME, hidden_size, generator=gen) / FRAME**0.5).to(device)
        self._w = [
            (torch.randn(hidden_size, hidden_size, generator=gen) * scale).to(device) for _ in range(layers)
        ]
        self._w_out = (torch.randn(hidden_size, FRAME, generator=gen) * scale).to(device)
        self._hidden = hidden_size
        self._h = torch.zeros(0, hidden_size, device=device)
        self._free: list[int] = []
        self._grow(initial_slots)
        self._max_input = 15 * self.audio_format.sample_rate_hz

    def _grow(self, capacity: int) -> None:
        old = self._h.shape[0]
        self._h = torch.cat([self._h, torch.zeros(capacity - old, self._hidden, device=self.device)])
        self._free.extend(range(capacity - 1, old - 1, -1))

    def parse_options(self, params: Mapping[str, object]) -> SyntheticOptions:
        return SyntheticOptions.parse(params, self.defaults)

    def create_state(self, session_id: str) -> SyntheticState:
        if not self._free:
            self._grow(max(64, 2 * self._h.shape[0]))
        slot = self._free.pop()
        self._h[slot].zero_()
        return SyntheticState(slot=slot, options=self.defaults, buffer=InputBuffer())

    def release_state(self, state: SyntheticState) -> None:
        self._free.append(state.slot)

    def set_options(self, state: SyntheticState, options: object) -> None:
        assert isinstance(options, SyntheticOptions)
        state.options = options

    def commit(self, state: SyntheticState) -> int:
        state.committed = len(state.buffer)
        state.buffer.clear()
        return state.committed

    def clear(self, state: SyntheticState) -> None:
        state.buffer.clear()

    def respond(self, state: SyntheticState) -> None:
        if state.committed == 0:
            raise no_committed_input()
        state.reply_left = state.options.reply_frames
        state.reply_started = False

    def cancel_response(self, state: SyntheticState) -> None:
        state.reply_left = 0

    def is_responding(self, state: SyntheticState) -> bool:
        return state.reply_left > 0

    def step(self, batch: StepBatch[SyntheticState]) -> StepResult:
        states = batch.states
        slots = torch.from_numpy(np.fromiter((s.slot for s in states), np.int64, len(states))).to(self.device)
        x = torch.from_numpy(batch.frames).to(self.device) @ self._w_in
        h = self._h.index_select(0, slots)
        for w in self._w:
            h = torch.tanh(h @ w + x)
        self._h.index_copy_(0, slots, h)
        emit = [i for i, s in enumerate(states) if s.reply_left > 0 and s.steps % s.options.emit_every == 0]
        audio: list[FloatArray] = []
        if emit:
            sel = torch.tensor(emit, dtype=torch.int64, device=self.device)
            wave = torch.tanh(h.index_select(0, sel) @ self._w_out) * 0.1
            audio = list(wave.float().cpu().numpy())
        news: list[RequestNews | None] = [None] * len(states)
        for i, s in enumerate(states):
            s.steps += 1
            if batch.has_input[i]:
                s.buffer.append(batch.frames[i], self._max_input)
        for i in emit:
            s = states[i]
            n = news[i] = RequestNews()
            if not s.reply_started:
                s.reply_started = True
                n.response_started = True
            s.reply_left -= 1
            n.response_finished = s.reply_left == 0
        # An int is not a legal marker carrier (a list of str or a str is): fault injection.
        marker: object = 1 if self._invalid_sparse else ["1"]
        outputs = {
            "audio": audio,
            "meta": {"sparse_audio": marker, "req_id": [batch.req_ids[i] for i in emit]},
        }
        return StepResult(outputs=outputs, news=news)
