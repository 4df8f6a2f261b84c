"""The parrot model without gRPC: batched Silero VAD, turn detection, the pitch-shifted reply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from duplex.errors import BadEventError
from tests.worker_helpers import FRAME, load_speech, pad_frames
from worker_service.model import SPEECH_STARTED, SPEECH_STOPPED, StepBatch
from worker_service.models.parrot import ParrotModel, ParrotState, load_silero, parrot_reply

SPEECH = [f"speech_{i:02d}.wav" for i in range(16)] + ["hello.wav"]
#: Batched vs one-by-one VAD probability tolerance (see test_batched_vad_matches_one_by_one).
VAD_ATOL = 2e-4


@pytest.fixture(scope="module")
def model() -> ParrotModel:
    with torch.inference_mode():
        return ParrotModel(torch.device("cpu"))


@pytest.fixture(autouse=True)
def _inference_mode():
    # As on the engine thread: the model's state tensors are inference tensors.
    with torch.inference_mode():
        yield


def _run(model: ParrotModel, states: list[ParrotState], signals: list[np.ndarray]) -> list[list]:
    """Step every state through its signal (frame by frame, all in one batch); returns news per state."""
    n = max(len(s) for s in signals) // FRAME
    news: list[list] = [[] for _ in states]
    with torch.inference_mode():
        for k in range(n):
            frames = np.zeros((len(states), FRAME), np.float32)
            has = np.zeros(len(states), np.bool_)
            for i, s in enumerate(signals):
                if (k + 1) * FRAME <= len(s):
                    frames[i] = s[k * FRAME : (k + 1) * FRAME]
                    has[i] = True
            res = model.step(StepBatch([f"s{i}" for i in range(len(states))], states, frames, has))
            for i, item in enumerate(res.news):
                if item is not None:
                    news[i].append(item)
    return news


def test_batched_vad_matches_one_by_one(model: ParrotModel) -> None:
    signals = [pad_frames(load_speech(name))[: 40 * FRAME] for name in SPEECH[:6]]
    signals = [np.concatenate([s, np.zeros(40 * FRAME - len(s), np.float32)]) for s in signals]
    net = load_silero(torch.device("cpu"))
    with torch.inference_mode():
        # Reference: each session alone through the network, explicit state and 64-sample context.
        expected = np.zeros((len(signals), 40), np.float32)
        for i, s in enumerate(signals):
            state, ctx = torch.zeros(2, 1, 128), torch.zeros(1, 64)
            for k in range(40):
                x = torch.from_numpy(s[k * FRAME : (k + 1) * FRAME])[None]
                p, state = net(torch.cat([ctx, x], 1), state)
                ctx = x[:, -64:]
                expected[i, k] = float(p[0, 0])
        # Batched with per-session slots, in a shuffled slot order and with a session skipping steps.
        states = [model.create_state(f"s{i}") for i in range(len(signals))]
        got = np.zeros_like(expected)
        for k in range(40):
            order = np.random.default_rng(k).permutation(len(signals))
            slots = np.array([states[i].slot for i in order])
            frames = np.stack([signals[i][k * FRAME : (k + 1) * FRAME] for i in order])
            got[order, k] = model.vad(slots, frames)
        for st in states:
            model.release_state(st)
    # Batched and one-by-one float32 kernels sum in different orders (oneDNN/MKL pick other
    # GEMM blockings for B=6 than for B=1, and AVX-512 machines other ones again): each LSTM step
    # differs by a few ulp and 40 recurrent steps carry that into the probability. On an AVX-512
    # EPYC the worst case measured was 2.04e-5 (on AVX2 it stays under 1e-5), so the bound is
    # set an order of magnitude above that: far below what a wrong slot, a stale state or a
    # missing context would do (differences of 1e-2 and more).
    np.testing.assert_allclose(got, expected, atol=VAD_ATOL)
    # What the model acts on is the decision: it is the same wherever a probability is not
    # within that rounding of the threshold.
    threshold = 0.5
    clear = np.abs(expected - threshold) > VAD_ATOL
    np.testing.assert_array_equal((got > threshold)[clear], (expected > threshold)[clear])
    assert expected.max() > 0.5  # the comparison covers speech, not just silence


def test_vad_marks_speech_in_every_recording(model: ParrotModel) -> None:
    states = [model.create_state(name) for name in SPEECH]
    signals = [pad_frames(load_speech(name), silence_s=0.7) for name in SPEECH]
    news = _run(model, states, signals)
    for name, st, items, sig in zip(SPEECH, states, news, signals, strict=True):
        events = [e for n in items for e in n.vad]
        kinds = [k for k, _ in events]
        assert kinds[:2] == [SPEECH_STARTED, SPEECH_STOPPED], (name, events)
        start, stop = events[0][1], events[1][1]
        # Fixtures carry 100 ms of silence before the speech and 700+100 ms after it.
        assert 800 <= start <= 0.3 * len(sig), (name, start)
        assert stop > start + 4000, (name, events)
        turn = [n for n in items if n.turn_ended]
        assert len(turn) == 1 and turn[0].committed_samples >= stop - start, name
        model.release_state(st)


@pytest.mark.parametrize("level", [0.0, 0.003])
def test_vad_silent_on_silence_and_low_noise(model: ParrotModel, level: float) -> None:
    rng = np.random.default_rng(7)
    signals = [(rng.standard_normal(3 * 16000) * level).astype(np.float32) for _ in range(4)]
    states = [model.create_state(f"n{i}") for i in range(4)]
    news = _run(model, states, [pad_frames(s) for s in signals])
    assert all(not n.vad for items in news for n in items)
    for st in states:
        model.release_state(st)


def test_parrot_reply_keeps_duration_and_shifts_pitch() -> None:
    t = np.arange(16000) / 16000.0
    tone = (0.5 * np.sin(2 * np.pi * 200.0 * t)).astype(np.float32)
    out = parrot_reply(tone, 4.0)
    assert out.shape == tone.shape and out.dtype == np.float32
    spectrum = np.abs(np.fft.rfft(out[2000:14000] * np.hanning(12000)))
    peak_hz = np.argmax(spectrum) * 16000 / 12000
    assert abs(peak_hz - 200 * 2 ** (4 / 12)) < 6, peak_hz
    assert np.array_equal(parrot_reply(tone, 0.0), tone)
    for n in (0, 1, 100, 513, 5000):
        assert len(parrot_reply(np.ones(n, np.float32) * 0.1, -3.0)) == n


@pytest.mark.parametrize("hz", [200.0, 437.0, 1333.0])
def test_parrot_reply_of_a_steady_tone_is_steady(hz: float) -> None:
    # The phase vocoder keeps each bin's phase coherent from frame to frame (its deviation
    # wrapped to one turn): then the overlapping frames add up to the tone's own level. A phase
    # off by whole turns per frame makes them cancel in part, and the level wobbles.
    t = np.arange(16000) / 16000.0
    tone = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    out = parrot_reply(tone, 4.0)
    level = float(np.sqrt(np.mean(tone**2)))
    windows = np.sqrt(np.mean(out[2000:14000].reshape(-1, 400) ** 2, axis=1))  # 25 ms each
    assert np.all(np.abs(windows - level) < 0.05 * level), (windows.min(), windows.max(), level)


def test_options_are_validated(model: ParrotModel) -> None:
    opts = model.parse_options({"silence_ms": 300.0, "auto_commit": False})
    assert opts.silence_ms == 300.0 and not opts.auto_commit and opts.pitch_semitones == 4.0
    for bad in ({"nope": 1}, {"silence_ms": "x"}, {"threshold": 2.0}, {"auto_commit": 1.0}):
        with pytest.raises(BadEventError):
            model.parse_options(bad)


def test_manual_commit_respond_and_cancel(model: ParrotModel) -> None:
    st = model.create_state("m")
    model.set_options(st, model.parse_options({"auto_commit": False}))
    x = load_speech("speech_03.wav")[: 10 * FRAME]
    with torch.inference_mode():
        _run(model, [st], [x])
    with pytest.raises(BadEventError):
        model.respond(model.create_state("empty"))
    # Still in speech at the commit: from a frame before speech began to the end of the input.
    first = st.first_speech
    assert first is not None and st.in_speech
    assert model.commit(st) == 10 * FRAME - max(0, first - FRAME)
    model.respond(st)
    assert model.is_responding(st)
    model.cancel_response(st)
    assert not model.is_responding(st)
    model.release_state(st)


def test_manual_commit_trims_to_speech_and_keeps_all_input_without_speech(model: ParrotModel) -> None:
    st = model.create_state("trim")
    model.set_options(st, model.parse_options({"auto_commit": False, "silence_ms": 200.0}))
    speech = pad_frames(load_speech("speech_05.wav"))
    lead, tail = np.zeros(20 * FRAME, np.float32), np.zeros(40 * FRAME, np.float32)
    news = _run(model, [st], [np.concatenate([lead, speech, tail])])
    starts = [off for n in news[0] for kind, off in n.vad if kind == SPEECH_STARTED]
    stops = [off for n in news[0] for kind, off in n.vad if kind == SPEECH_STOPPED]
    assert starts and stops
    # Leading and trailing silence (e.g. fed to keep a reply going) are not part of the utterance.
    assert model.commit(st) == (stops[-1] + FRAME) - (starts[0] - FRAME)
    _run(model, [st], [np.zeros(10 * FRAME, np.float32)])
    assert model.commit(st) == 10 * FRAME  # nothing heard: everything appended is the input
    model.release_state(st)


def test_replies_are_clocked_by_input_frames(model: ParrotModel) -> None:
    """Lockstep: a reply advances one frame per consumed input frame, never without input."""
    st = model.create_state("clock")
    model.set_options(st, model.parse_options({"auto_commit": False}))
    _run(model, [st], [pad_frames(load_speech("speech_01.wav"))])
    n = model.commit(st)
    model.respond(st)
    assert model.is_responding(st)  # while the reply is computed off the engine thread
    assert st.pending is not None
    st.pending.result(timeout=10)
    frames = np.zeros((1, FRAME), np.float32)
    idle = model.step(StepBatch(["clock"], [st], frames, np.zeros(1, np.bool_)))
    assert list(idle.outputs.req_id) == []  # no input, no reply frame
    got = 0
    for _ in range(n // FRAME + 2):
        res = model.step(StepBatch(["clock"], [st], frames, np.ones(1, np.bool_)))
        got += sum(len(a.pcm) for a in res.outputs.audio) // 2
        assert len(res.outputs.audio) <= 1
    assert got == n and not model.is_responding(st)
    model.release_state(st)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vad_on_cuda_matches_cpu(model: ParrotModel) -> None:
    gpu = ParrotModel(torch.device("cuda"))
    signals = np.stack([pad_frames(load_speech(n))[:FRAME] for n in SPEECH[:8]])
    cpu_states = [model.create_state(f"c{i}") for i in range(8)]
    gpu_states = [gpu.create_state(f"g{i}") for i in range(8)]
    for _ in range(3):
        a = model.vad(np.array([s.slot for s in cpu_states]), signals)
        b = gpu.vad(np.array([s.slot for s in gpu_states]), signals)
        np.testing.assert_allclose(a, b, atol=1e-3)
    assert gpu.state_device.type == "cuda"


def test_a_failed_reply_fails_its_request_only(model: ParrotModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply is computed off the engine thread; its failure must come back as that request's
    error, not as an exception out of the batched step (which would take the worker down)."""
    import worker_service.models.parrot as parrot

    good, bad = model.create_state("good"), model.create_state("bad")
    for st in (good, bad):
        model.set_options(st, model.parse_options({"auto_commit": False}))
        st.committed = np.full(4 * FRAME, 0.1, np.float32)
    model.respond(good)
    assert good.pending is not None
    good.pending.result(timeout=10)

    def boom(utterance: np.ndarray, pitch: float) -> np.ndarray:
        raise MemoryError("boom")

    monkeypatch.setattr(parrot, "parrot_reply", boom)
    model.respond(bad)
    assert bad.pending is not None
    with pytest.raises(MemoryError):
        bad.pending.result(timeout=10)
    frames = np.zeros((2, FRAME), np.float32)
    res = model.step(StepBatch(["good", "bad"], [good, bad], frames, np.ones(2, np.bool_)))
    assert res.news[1] is not None and res.news[1].error
    assert bad.pending is None and not model.is_responding(bad)
    assert list(res.outputs.req_id) == ["good"]  # the other request's reply goes on
    model.release_state(good)
    model.release_state(bad)


def test_a_reply_s_synthesis_counts_as_the_model_s_helper_cpu(model: ParrotModel) -> None:
    before = REGISTRY.get_sample_value("duplex_worker_model_cpu_seconds_total", {"part": "helpers"}) or 0.0
    st = model.create_state("helper")
    model.set_options(st, model.parse_options({"auto_commit": False}))
    _run(model, [st], [pad_frames(load_speech("speech_01.wav"))])
    model.commit(st)
    model.respond(st)
    assert st.pending is not None
    st.pending.result(timeout=10)
    after = REGISTRY.get_sample_value("duplex_worker_model_cpu_seconds_total", {"part": "helpers"})
    assert after is not None and after > before
    model.release_state(st)
