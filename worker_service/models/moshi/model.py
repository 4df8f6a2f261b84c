"""The Moshi family on the worker, on Kyutai's ``moshi`` package: model-native full duplex.

Moshi (and PersonaPlex-class models of the same layout) hears and speaks at once, one 80 ms frame
at 24 kHz in and one out, and decides itself when to speak; beside its audio it streams an inner
monologue, one text token per frame. Each tick, for every slot in one batch: Mimi encodes the
frame, ``LMGen`` takes one step, Mimi decodes what it said (moshi-server's shape).

**Slots.** The batch is a fixed set of ``slots`` (the worker's ``--max-sessions``): a session takes
a free slot, whose streaming state is reset (``reset_streaming(mask)`` on Mimi and ``LMGen``);
it is masked (``set_exec_mask``) in a step where it has no frame, so its state does not advance,
and its slot is freed on release. Joining or leaving never restarts streaming or changes
another slot's state, and the batch size never changes, so greedy output does not depend on who
else is there (greedy output depends on the batch size: bit-identical across slots and
neighbours at a fixed size, not across sizes). Masked slots still cost compute.

What moshi needs that is not obvious: ``LMGen(..., support_out_of_sync=True)`` (otherwise one
slot's reset zeroes a shared step counter and ``step()`` returns None for the whole batch); a
reset turns the slot's exec mask back on (so masks are set every step); a slot's first steps
after joining yield no audio codes yet (-2), so the decoder is masked apart for those slots; as
moshi's server does, a session's first frame is encoded and then the encoder's state is reset and
the frame is not given to the LM (to the model it is in the past, its padding is not real).

**Speech spans.** The model's speech spans (``spans.SpanTracker``, from its text tokens) are
what the session makes responses of: audio and text go out only within a span, with
``response_started`` / ``response_finished`` news at its ends. ``cancel_response`` (a client's
cancel) mutes the current span until the model falls silent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from duplex.audio import S16LE, PcmFormat, encode
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import common_pb2, worker_pb2
from worker_service.model import RequestNews, StepBatch, StepModel, StepResult, check_option_keys
from worker_service.models.moshi.checkpoint import RANDOM_7B, checkpoint_info
from worker_service.models.moshi.spans import SpanTracker

logger = logging.getLogger(__name__)

PCM24K_MONO: Final = PcmFormat(S16LE, 24000, 1)
FRAME: Final = 1920
"""80 ms at 24 kHz: Mimi's frame."""
DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUIET_FRAMES: Final = 6
"""Frames of padding (text) that end a speech span: about half a second."""


@dataclass(slots=True, eq=False)
class MoshiState:
    """One session: its slot."""

    slot: int


@dataclass(frozen=True, slots=True)
class Sampling:
    """The worker's sampling (every session's: the batch shares one ``LMGen``)."""

    temperature: float
    """Audio and text temperature; 0 = greedy (argmax)."""
    temperature_text: float
    top_k: int
    top_k_text: int


def resolve_sampling(
    lm_gen_config: Mapping[str, Any], temperature: float | None, top_k: int | None
) -> Sampling:
    """The checkpoint's own ``lm_gen_config``, overridden by the worker's ``--temperature`` (both
    temperatures) and ``--top-k`` (both)."""

    def number(key: str, default: float) -> float:
        value = lm_gen_config.get(key, default)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default

    temp = number("temp", 0.8) if temperature is None else temperature
    temp_text = number("temp_text", 0.7) if temperature is None else temperature
    k = int(number("top_k", 250)) if top_k is None else top_k
    k_text = int(number("top_k_text", 25)) if top_k is None else top_k
    if temp < 0 or temp_text < 0:
        raise ValueError("temperature must be >= 0")
    if k < 1 or k_text < 1:
        raise ValueError("top_k must be >= 1")
    return Sampling(temp, temp_text, k, k_text)


class MoshiModel(StepModel[MoshiState]):
    """A Moshi-layout checkpoint served in fixed batch slots; see the module docstring."""

    model_id = "moshi"
    audio_format = PCM24K_MONO
    frame_samples = FRAME
    lockstep = True
    model_native = True
    fixed_batch = True

    def __init__(
        self,
        device: torch.device,
        *,
        checkpoint: str,
        slots: int = 8,
        temperature: float | None = None,
        top_k: int | None = None,
        dtype: str = "auto",
        quiet_frames: int = QUIET_FRAMES,
    ) -> None:
        if slots < 1:
            raise ValueError("slots (--max-sessions) must be >= 1")
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}")
        from moshi.models.lm import LMGen
        from moshi.utils.compile import no_compile

        if device.type != "cuda":
            # torch.compile of moshi's kernels gains nothing on a CPU (measured: 15 ms a step of 8
            # slots without, 18 with) and costs seconds at start and a C++ toolchain in the image.
            no_compile().__enter__()
        self.device = device
        self.slots = slots
        # float32 on a CPU (bfloat16 there is several times slower), bfloat16 on a GPU.
        lm_dtype = (
            DTYPES[dtype] if dtype != "auto" else torch.float32 if device.type == "cpu" else torch.bfloat16
        )
        info = checkpoint_info(checkpoint)
        self.sampling = resolve_sampling(info.lm_gen_config, temperature, top_k)
        with torch.no_grad():
            self._mimi = info.get_mimi(device)
            lm = info.get_moshi(device, dtype=lm_dtype, load_weight=checkpoint != RANDOM_7B)
        s = self.sampling
        self._gen = LMGen(
            lm,
            use_sampling=s.temperature > 0 or s.temperature_text > 0,
            temp=s.temperature,
            temp_text=s.temperature_text,
            top_k=s.top_k,
            top_k_text=s.top_k_text,
            support_out_of_sync=True,
        )
        tokenizer = info.get_text_tokenizer()
        pad, end_pad = lm.existing_text_padding_id, lm.existing_text_end_padding_id
        self._pieces = [
            ""
            if i in (pad, end_pad) or i >= tokenizer.get_piece_size() or tokenizer.is_control(i)
            else tokenizer.id_to_piece(i).replace("\u2581", " ")
            for i in range(lm.text_card)
        ]
        self._spans = SpanTracker(slots, quiet_frames=quiet_frames, silent_tokens=(pad, end_pad))
        self._mimi.streaming_forever(slots)
        self._gen.streaming_forever(slots)
        self._warm_up()
        self._free = list(range(slots - 1, -1, -1))
        self._join = np.zeros(slots, dtype=np.bool_)
        """Slots taken since the last step: reset before it."""
        self._first = np.zeros(slots, dtype=np.bool_)
        """Slots whose next frame is their session's first (encoded, then not given to the LM)."""
        self._fmt = self.audio_format.to_proto()
        self._frame = torch.zeros(slots, 1, FRAME, device=device)
        logger.info(
            "moshi: %d slots on %s (LM %s, %.1fM parameters), sampling %s",
            slots,
            device,
            lm_dtype,
            sum(p.numel() for p in lm.parameters()) / 1e6,
            self.sampling,
        )

    @torch.no_grad()
    def _warm_up(self) -> None:
        """A few steps of every slot before serving, then every slot reset: the first steps of a
        fresh process (allocation, kernels chosen, graphs captured on a GPU) take seconds, which
        a session would see as a worker that hangs."""
        silence = torch.zeros(self.slots, 1, FRAME, device=self.device)
        for _ in range(3):
            out = self._gen.step(self._mimi.encode(silence))
            assert out is not None
            self._mimi.decode(out[:, 1:].clamp(min=0))
        self._mimi.reset_streaming()
        self._gen.reset_streaming()

    # -- state -----------------------------------------------------------------------------------

    def parse_options(self, params: Mapping[str, object]) -> object:
        check_option_keys(params, frozenset())
        return None

    def create_state(self, session_id: str) -> MoshiState:
        if not self._free:
            raise BadEventError(ErrorCode.CAPACITY_EXHAUSTED, f"all {self.slots} slots are taken")
        slot = self._free.pop()
        self._join[slot] = True
        self._first[slot] = True
        self._spans.reset(slot)
        return MoshiState(slot)

    def release_state(self, state: MoshiState) -> None:
        self._spans.reset(state.slot)
        self._join[state.slot] = False
        self._first[state.slot] = False
        self._free.append(state.slot)

    def set_options(self, state: MoshiState, options: object) -> None:
        del state, options

    def commit(self, state: MoshiState) -> int:
        raise _unsupported("COMMIT")

    def clear(self, state: MoshiState) -> None:
        raise _unsupported("CLEAR")

    def respond(self, state: MoshiState) -> None:
        raise _unsupported("RESPOND")

    def cancel_response(self, state: MoshiState) -> None:
        self._spans.mute(state.slot)

    def is_responding(self, state: MoshiState) -> bool:
        del state
        return False  # it speaks in lockstep with its input, never on its own

    # -- step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: StepBatch[MoshiState]) -> StepResult:
        n = len(batch.states)
        slots = np.fromiter((st.slot for st in batch.states), dtype=np.int64, count=n)
        stepping = np.zeros(self.slots, dtype=np.bool_)
        stepping[slots[batch.has_input]] = True
        dev = self.device
        if self._join.any():
            joined = torch.from_numpy(self._join.copy()).to(dev)
            self._mimi.reset_streaming(joined)
            self._gen.reset_streaming(joined)
            self._join[:] = False
        frame = self._frame
        frame.zero_()
        rows = torch.from_numpy(np.ascontiguousarray(batch.frames[batch.has_input])).to(dev)
        frame[torch.from_numpy(slots[batch.has_input]).to(dev), 0] = rows
        self._mimi.set_exec_mask(torch.from_numpy(stepping).to(dev))
        codes = self._mimi.encode(frame)
        first = self._first & stepping
        if first.any():
            self._mimi.reset_streaming(torch.from_numpy(first).to(dev))
            self._first[first] = False
        to_lm = stepping & ~first
        self._gen.set_exec_mask(torch.from_numpy(to_lm).to(dev))
        out = self._gen.step(codes)
        assert out is not None  # support_out_of_sync: a step always answers
        text = out[:, 0, 0]
        audio = out[:, 1:, :]
        valid_t = torch.from_numpy(to_lm).to(dev) & (audio >= 0).all(dim=1).all(dim=1)
        valid = valid_t.cpu().numpy()
        pcm = None
        if valid.any():
            self._mimi.set_exec_mask(valid_t)
            pcm = self._mimi.decode(audio.clamp(min=0)).float().clamp(-1.0, 1.0)[:, 0].cpu().numpy()
        return self._results(batch, slots, valid, text.cpu().numpy(), pcm)

    def _results(
        self,
        batch: StepBatch[MoshiState],
        slots: np.ndarray,
        valid: np.ndarray,
        text: np.ndarray,
        pcm: np.ndarray | None,
    ) -> StepResult:
        """Span news, text and (sparse) audio for the batch's requests."""
        news: list[RequestNews | None] = [None] * len(batch.states)
        out = worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_AUDIO, sparse_audio=True)
        heard = np.flatnonzero(valid[slots])
        if not len(heard) or pcm is None:
            return StepResult(outputs=out, news=news)
        span = self._spans.step(slots[heard], text[slots[heard]].astype(np.int64))
        for j, i in enumerate(heard):
            if not span.audible[j]:
                continue
            slot = slots[i]
            n = RequestNews(
                text=self._pieces[int(text[slot])],
                response_started=bool(span.started[j]),
                response_finished=bool(span.finished[j]),
            )
            news[i] = n
            out.req_id.append(batch.req_ids[i])
            out.audio.append(
                common_pb2.AudioPayload(pcm=encode(pcm[slot], self.audio_format), format=self._fmt)
            )
        return StepResult(outputs=out, news=news)


def _unsupported(kind: str) -> BadEventError:
    return BadEventError(
        ErrorCode.UNSUPPORTED_BY_MODEL, f"{kind}: the moshi model takes turns itself (model-native duplex)"
    )
