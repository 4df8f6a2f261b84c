"""The parrot: Silero VAD turn detection, and a reply that plays the last utterance back pitch-shifted.

Per step, every request with an input frame goes through ONE batched VAD forward; per-session
LSTM state and the 64-sample context Silero v5+ prepends live in two device tensors indexed by a
per-session slot (gathered and scattered with index ops). Everything else per request is a few
scalar updates; the audio work is numpy vector ops, never a Python loop over samples.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from duplex.audio import PCM16K_MONO, encode
from duplex.v1 import common_pb2, worker_pb2
from worker_service.model import (
    SPEECH_STARTED,
    SPEECH_STOPPED,
    FloatArray,
    InputBuffer,
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    bool_option,
    check_option_keys,
    float_option,
    no_committed_input,
    run_as_helper,
)

logger = logging.getLogger(__name__)

FRAME = 512
"""Silero's chunk at 16 kHz: 32 ms."""
MAX_UTTERANCE_S = 15.0
"""Longest committed utterance: longer input keeps its last 15 s."""
_NEG_MARGIN = 0.15
"""Silero's hysteresis: speech ends when the probability drops below threshold - 0.15."""
_TURN = np.float32(2.0 * np.pi)
"""One turn of phase, in radians."""
_OPTION_KEYS = frozenset({"silence_ms", "auto_commit", "pitch_semitones", "threshold"})


@dataclass(frozen=True, slots=True)
class ParrotOptions:
    """Per-session options (submission ``params``)."""

    silence_ms: float = 500.0
    """Silence after speech that ends the turn."""
    auto_commit: bool = True
    """Commit the speech span when the turn ends (``turn_ended``)."""
    pitch_semitones: float = 4.0
    """Pitch shift of the reply."""
    threshold: float = 0.5
    """VAD speech probability threshold."""

    @classmethod
    def parse(cls, params: Mapping[str, object], base: ParrotOptions) -> ParrotOptions:
        check_option_keys(params, _OPTION_KEYS)
        return replace(
            base,
            silence_ms=float_option(params, "silence_ms", base.silence_ms, 32.0, 10_000.0),
            auto_commit=bool_option(params, "auto_commit", base.auto_commit),
            pitch_semitones=float_option(params, "pitch_semitones", base.pitch_semitones, -24.0, 24.0),
            threshold=float_option(params, "threshold", base.threshold, 0.05, 0.99),
        )


def parrot_reply(utterance: np.ndarray, pitch_semitones: float) -> FloatArray:
    """The parrot's reply: ``utterance`` pitch-shifted by ``pitch_semitones``, same length.

    Resample by ``2**(s/12)`` (pitch and tempo change together), then phase-vocoder
    time-stretch back to the original length (tempo restored, pitch kept). Pure, deterministic,
    vectorized (FFTs over all frames at once; the phase accumulates a frame's row of bins at a time).
    """
    x = np.asarray(utterance, dtype=np.float32).reshape(-1)
    n = len(x)
    if n == 0 or pitch_semitones == 0.0:
        return x.copy()
    ratio = 2.0 ** (pitch_semitones / 12.0)
    m = max(2, round(n / ratio))
    y = np.interp(np.linspace(0.0, n - 1.0, m), np.arange(n, dtype=np.float64), x).astype(np.float32)
    return _stretch(y, n)


def _stretch(y: FloatArray, n: int, win: int = 1024, overlap: int = 4) -> FloatArray:
    """Time-stretch ``y`` to ``n`` samples with a phase vocoder (synthesis hop = win / overlap)."""
    m = len(y)
    if n <= win or m <= win:
        # Too short for a window: plain interpolation (a few tens of ms of audio).
        out = np.interp(np.linspace(0.0, m - 1.0, n), np.arange(m, dtype=np.float64), y)
        return out.astype(np.float32)
    hop = win // overlap
    k = math.ceil((n - win) / hop) + 1  # synthesis frames covering n samples
    starts = np.round(np.linspace(0.0, m - win, k)).astype(np.int64)
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(win) / win)).astype(np.float32)
    spec = np.fft.rfft(y[starts[:, None] + np.arange(win)[None, :]] * window, axis=1)  # (k, bins)
    omega = (2.0 * np.pi * np.arange(win // 2 + 1) / win).astype(np.float32)  # phase advance/sample
    phase = np.angle(spec).astype(np.float32)
    step = np.maximum(np.diff(starts), 1).astype(np.float32)[:, None]
    dev = phase[1:] - phase[:-1] - omega * step
    # Wrapped to [-pi, pi] by the nearest whole turn: a multiply and a round, where the float
    # remainder (``%``) costs about twenty times as much.
    dev -= _TURN * np.rint(dev * (1.0 / _TURN))
    inst_freq = omega + dev / step  # true frequency of each bin, radians per sample
    # Accumulated in float64: thousands of frames of phase would lose precision in float32. A
    # row at a time (each row one vector add): ``np.cumsum`` down the frames axis strides across
    # rows and costs several times as much for the same running sums.
    synth_phase = np.empty((k, win // 2 + 1), dtype=np.float64)
    synth_phase[0] = phase[0]
    synth_phase[1:] = inst_freq * hop
    for j in range(1, k):
        synth_phase[j] += synth_phase[j - 1]
    synth_phase = (synth_phase - 2.0 * np.pi * np.floor(synth_phase * (0.5 / np.pi))).astype(np.float32)
    mag = np.abs(spec)
    rebuilt = (mag * np.cos(synth_phase)) + 1j * (mag * np.sin(synth_phase))
    frames = np.fft.irfft(rebuilt.astype(np.complex64), n=win, axis=1).astype(np.float32)
    frames *= window
    # Overlap-add without np.add.at: frame j covers blocks j .. j+overlap-1 of `hop` samples.
    blocks = frames.reshape(k, overlap, hop)
    wsq = (window * window).reshape(overlap, hop)
    out = np.zeros((k + overlap - 1, hop), dtype=np.float32)
    norm = np.zeros((k + overlap - 1, hop), dtype=np.float32)
    for r in range(overlap):
        out[r : r + k] += blocks[:, r, :]
        norm[r : r + k] += wsq[r]
    flat = out.reshape(-1) / np.maximum(norm.reshape(-1), 0.1)
    return np.ascontiguousarray(np.clip(flat[:n], -1.0, 1.0), dtype=np.float32)


@dataclass(slots=True, eq=False)
class ParrotState:
    """One session: its VAD slot, uncommitted input, turn detector and reply cursor."""

    slot: int
    options: ParrotOptions
    buffer: InputBuffer
    offset: int = 0
    """Samples of input consumed so far (the session's input position)."""
    in_speech: bool = False
    speech_start: int = 0
    silence_start: int | None = None
    first_speech: int | None = None
    """Where the first speech since the last commit began (manual COMMIT trims to speech)."""
    last_speech_end: int | None = None
    committed: FloatArray | None = None
    reply: bytes = b""
    reply_pos: int = 0
    reply_started: bool = False
    pending: Future[bytes] | None = None
    """The reply being computed off the engine thread (RESPOND); its frames start once done."""


def load_silero(device: torch.device) -> torch.jit.ScriptModule:
    """The 16 kHz Silero VAD network (``_model`` of the packaged TorchScript module)."""
    import silero_vad

    path = os.path.join(os.path.dirname(silero_vad.__file__), "data", "silero_vad.jit")
    # torch.jit.load has no annotations in torch's own typing.
    module = torch.jit.load(path, map_location=device)  # type: ignore[no-untyped-call]
    module.eval()
    net: torch.jit.ScriptModule = module._model
    return net


class ParrotModel(StepModel[ParrotState]):
    """Silero VAD + pitch-shifted echo; see docs/worker-protocol.md."""

    model_id = "parrot"
    audio_format = PCM16K_MONO
    frame_samples = FRAME
    # Full duplex: one reply frame per input frame, so a reply plays out at the pace audio
    # (client speech, or the session's real-time silence) comes in, and barge-in lands mid-reply.
    lockstep = True

    def __init__(self, device: torch.device, *, initial_slots: int = 64, **defaults: object) -> None:
        self.device = device
        self.defaults = ParrotOptions.parse(defaults, ParrotOptions())
        self._net = load_silero(device)
        self._ctx_len = int(self._net.context_size_samples)
        self._capacity = 0
        self._state = torch.zeros(2, 0, 128, device=device)
        self._context = torch.zeros(0, self._ctx_len, device=device)
        self._free: list[int] = []
        self._grow(initial_slots)
        self._fmt = self.audio_format.to_proto()
        self._replies = ThreadPoolExecutor(max_workers=2, thread_name_prefix="parrot-reply")

    # -- state ---------------------------------------------------------------------------------

    @property
    def state_device(self) -> torch.device:
        """Where the batched VAD state lives: the model's device, so a step makes no host round
        trip for it."""
        return self._state.device

    def _grow(self, capacity: int) -> None:
        extra = capacity - self._capacity
        self._state = torch.cat([self._state, torch.zeros(2, extra, 128, device=self.device)], dim=1)
        self._context = torch.cat([self._context, torch.zeros(extra, self._ctx_len, device=self.device)])
        self._free.extend(range(capacity - 1, self._capacity - 1, -1))
        self._capacity = capacity

    def parse_options(self, params: Mapping[str, object]) -> ParrotOptions:
        return ParrotOptions.parse(params, self.defaults)

    def create_state(self, session_id: str) -> ParrotState:
        if not self._free:
            self._grow(max(64, self._capacity * 2))
        slot = self._free.pop()
        self._state[:, slot].zero_()
        self._context[slot].zero_()
        return ParrotState(slot=slot, options=self.defaults, buffer=InputBuffer())

    def release_state(self, state: ParrotState) -> None:
        self.cancel_response(state)
        self._free.append(state.slot)

    def set_options(self, state: ParrotState, options: object) -> None:
        assert isinstance(options, ParrotOptions)
        state.options = options

    def commit(self, state: ParrotState) -> int:
        """The uncommitted input, trimmed to its speech (padded a frame each side) when the VAD
        heard any: silence the session fed to keep a reply going is not part of what was said."""
        buf = state.buffer
        lo, hi = buf.start, buf.end
        if state.first_speech is not None:
            end = state.offset if state.in_speech or state.last_speech_end is None else state.last_speech_end
            lo, hi = state.first_speech - self.frame_samples, end + self.frame_samples
        utterance = buf.take(lo, hi, self._max_utterance)
        self._forget_speech(state)
        state.committed = utterance
        return len(utterance)

    def clear(self, state: ParrotState) -> None:
        state.buffer.clear()
        self._forget_speech(state)

    @staticmethod
    def _forget_speech(state: ParrotState) -> None:
        # Speech still going on at a commit starts the next utterance where the buffer now starts.
        state.first_speech = state.buffer.start if state.in_speech else None
        state.last_speech_end = None

    def respond(self, state: ParrotState) -> None:
        if state.committed is None or len(state.committed) == 0:
            raise no_committed_input()
        # The pitch shift of a long utterance takes tens of ms: computed on a helper thread so
        # the engine keeps stepping every other session meanwhile (numpy's FFTs release the GIL).
        committed, pitch = state.committed, state.options.pitch_semitones
        state.pending = self._replies.submit(
            run_as_helper, lambda: encode(parrot_reply(committed, pitch), self.audio_format)
        )
        state.reply = b""
        state.reply_pos = 0
        state.reply_started = False

    def cancel_response(self, state: ParrotState) -> None:
        if state.pending is not None:
            state.pending.cancel()
            state.pending = None
        state.reply = b""
        state.reply_pos = 0

    def is_responding(self, state: ParrotState) -> bool:
        return state.pending is not None or state.reply_pos < len(state.reply)

    # -- step ----------------------------------------------------------------------------------

    @property
    def _max_utterance(self) -> int:
        return int(MAX_UTTERANCE_S * self.audio_format.sample_rate_hz)

    def vad(self, slots: np.ndarray, frames: FloatArray) -> FloatArray:
        """Speech probabilities for ``frames`` (B, 512), advancing the sessions in ``slots``."""
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)
        x = torch.from_numpy(frames).to(self.device)
        state = self._state.index_select(1, idx)
        context = self._context.index_select(0, idx)
        prob, new_state = self._net(torch.cat([context, x], dim=1), state)
        self._state.index_copy_(1, idx, new_state)
        self._context.index_copy_(0, idx, x[:, -self._ctx_len :])
        out: FloatArray = prob[:, 0].float().cpu().numpy()
        return out

    def step(self, batch: StepBatch[ParrotState]) -> StepResult:
        states = batch.states
        with_input = np.flatnonzero(batch.has_input)
        probs = np.zeros(len(states), dtype=np.float32)
        if len(with_input):
            slots = np.fromiter((states[i].slot for i in with_input), dtype=np.int64, count=len(with_input))
            probs[with_input] = self.vad(slots, np.ascontiguousarray(batch.frames[with_input]))
        news: list[RequestNews | None] = [None] * len(states)
        out = worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_AUDIO, sparse_audio=True)
        frame_bytes = self.frame_samples * self.audio_format.frame_bytes
        for i, st in enumerate(states):
            n: RequestNews | None = None
            if batch.has_input[i]:
                n = self._listen(st, batch.frames[i], float(probs[i]))
            if st.pending is not None and st.pending.done():
                done, st.pending = st.pending, None
                try:
                    st.reply = done.result()
                except Exception as exc:  # this request's reply failed; the batch goes on
                    logger.exception("parrot reply failed", exc_info=exc)
                    news[i] = RequestNews(error="the reply could not be computed")
                    continue
            if batch.has_input[i] and st.reply_pos < len(st.reply):
                chunk = st.reply[st.reply_pos : st.reply_pos + frame_bytes]
                st.reply_pos += len(chunk)
                out.req_id.append(batch.req_ids[i])
                out.audio.append(common_pb2.AudioPayload(pcm=chunk, format=self._fmt))
                if n is None:
                    n = RequestNews()
                if not st.reply_started:
                    st.reply_started = True
                    n.response_started = True
                if st.reply_pos >= len(st.reply):
                    n.response_finished = True
                    st.reply, st.reply_pos = b"", 0
            news[i] = n
        return StepResult(outputs=out, news=news)

    def _listen(self, st: ParrotState, frame: FloatArray, prob: float) -> RequestNews | None:
        opts = st.options
        start = st.offset
        st.offset += len(frame)
        rate = self.audio_format.sample_rate_hz
        silence = int(opts.silence_ms * rate / 1000.0)
        # A copy: ``frame`` is a row of the step's whole batch, which a view would keep alive
        # for as long as the utterance is buffered (seconds of batches, megabytes each).
        st.buffer.append(frame.copy(), self._max_utterance + silence + 4 * self.frame_samples)
        if prob >= opts.threshold:
            st.silence_start = None
            if not st.in_speech:
                st.in_speech = True
                st.speech_start = start
                if st.first_speech is None:
                    st.first_speech = start
                return RequestNews(vad=[(SPEECH_STARTED, start)])
            return None
        if not st.in_speech or prob >= opts.threshold - _NEG_MARGIN:
            return None
        if st.silence_start is None:
            st.silence_start = start
        if st.offset - st.silence_start < silence:
            return None
        end = st.silence_start
        st.in_speech = False
        st.silence_start = None
        st.last_speech_end = end
        news = RequestNews(vad=[(SPEECH_STOPPED, end)])
        if opts.auto_commit:
            pad = self.frame_samples
            utterance = st.buffer.take(st.speech_start - pad, end + pad, self._max_utterance)
            self._forget_speech(st)
            st.committed = utterance
            news.turn_ended = True
            news.committed_samples = len(utterance)
        return news
