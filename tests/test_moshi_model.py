"""The moshi model on the worker (``worker_service.models.moshi``), with Kyutai's real code and a
small random-weight checkpoint of the real layout: loading through moshi's ``CheckpointInfo``,
slots (a reset slot starts over, a masked slot does not advance, neighbours joining and leaving
change nothing), speech spans, sampling, and what it refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from duplex.errors import BadEventError, DuplexError, ErrorCode
from tests.moshi_helpers import FRAME, frames_of, small_checkpoint, voice_24k
from worker_service.model import StepBatch
from worker_service.models import create_model
from worker_service.models.moshi.checkpoint import checkpoint_info
from worker_service.models.moshi.model import MoshiModel, MoshiState, resolve_sampling
from worker_service.models.moshi.spans import SpanTracker

SLOTS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_checkpoint(tmp_path_factory.mktemp("moshi"))


@pytest.fixture
def model(checkpoint: Path) -> Iterator[MoshiModel]:
    torch.set_num_threads(1)
    yield MoshiModel(torch.device("cpu"), checkpoint=str(checkpoint), slots=SLOTS, temperature=0.0)


@dataclass
class Heard:
    """What one session got: text, and audio per step (None: no audio that step)."""

    text: list[str] = field(default_factory=list)
    audio: list[bytes | None] = field(default_factory=list)
    started: int = 0


def run(model: MoshiModel, plan: dict[str, list[np.ndarray | None]], steps: int) -> dict[str, Heard]:
    """Step ``model`` ``steps`` times; ``plan[session][k]``: its frame at step ``k`` (None: no
    frame; a session joins at its first entry that is not missing and leaves after its list)."""
    states: dict[str, MoshiState] = {}
    heard = {sid: Heard() for sid in plan}
    for k in range(steps):
        ids, frames = [], []
        for sid, frs in plan.items():
            if k < len(frs) and sid not in states and frs[k] is not None:
                states[sid] = model.create_state(sid)
            if k >= len(frs) and sid in states:
                model.release_state(states.pop(sid))
            if sid in states and frs[k] is not None:
                ids.append(sid)
                frames.append(frs[k])
        if not ids:
            continue
        batch = StepBatch(
            req_ids=ids,
            states=[states[i] for i in ids],
            frames=np.stack(frames).astype(np.float32),
            has_input=np.ones(len(ids), dtype=np.bool_),
        )
        result = model.step(batch)
        audio = dict(zip(result.outputs.req_id, (p.pcm for p in result.outputs.audio), strict=True))  # type: ignore[attr-defined]
        for i, sid in enumerate(ids):
            news = result.news[i]
            heard[sid].text.append(news.text if news is not None else "")
            heard[sid].started += int(news is not None and news.response_started)
            heard[sid].audio.append(audio.get(sid))
    for state in states.values():
        model.release_state(state)  # everyone leaves at the end
    return heard


def test_a_small_checkpoint_loads_through_moshis_own_loader(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    info = checkpoint_info(str(checkpoint))
    assert Path(info.moshi_weights) == checkpoint / config["moshi_name"]
    assert info.lm_config["dim"] == 64 and info.lm_config["num_layers"] == 2
    assert info.mimi_config["seanet"]["n_filters"] == 8
    tokenizer = info.get_text_tokenizer()
    assert tokenizer.get_piece_size() == config["text_card"]
    assert tokenizer.pad_id() == 3 and tokenizer.unk_id() == 0  # Moshi's silent text tokens
    with pytest.raises(ValueError, match="no such directory"):
        checkpoint_info(str(checkpoint / "missing"))
    with pytest.raises(ValueError, match=r"config\.json"):
        checkpoint_info(str(checkpoint / "config.json"))


def test_the_registry_builds_it_and_refuses_bad_options(checkpoint: Path) -> None:
    built = create_model("moshi", torch.device("cpu"), {"checkpoint": str(checkpoint), "slots": 2})
    assert isinstance(built, MoshiModel) and built.slots == 2 and built.model_native and built.fixed_batch
    with pytest.raises(DuplexError, match="dtype"):
        create_model("moshi", torch.device("cpu"), {"checkpoint": str(checkpoint), "dtype": "int8"})


def test_the_worker_temperature_overrides_the_checkpoints_own() -> None:
    own = {"temp": 0.8, "temp_text": 0.7, "top_k": 250, "top_k_text": 25}
    assert resolve_sampling(own, None, None).temperature_text == 0.7
    greedy = resolve_sampling(own, 0.0, None)
    assert (greedy.temperature, greedy.temperature_text, greedy.top_k) == (0.0, 0.0, 250)
    assert resolve_sampling(own, 0.5, 7).top_k_text == 7
    with pytest.raises(ValueError):
        resolve_sampling(own, -1.0, None)


def test_it_speaks_text_and_audio_from_what_it_hears(model: MoshiModel) -> None:
    a, b = frames_of(voice_24k(2.0, seed=0)), frames_of(voice_24k(2.0, seed=5))
    heard = run(model, {"a": list(a), "b": list(b)}, len(a))
    for h in heard.values():
        assert h.started == 1  # a random model says something from its first frames on
        assert sum(x is not None for x in h.audio) >= len(a) - 4
        assert "".join(h.text).strip()
        frame = next(x for x in h.audio if x is not None)
        assert len(frame) == 2 * FRAME  # one 80 ms frame of 24 kHz s16le per step
    # Different input, different speech: the codebooks hear it.
    assert heard["a"].audio != heard["b"].audio


def test_neighbours_joining_talking_and_leaving_change_nothing(model: MoshiModel, checkpoint: Path) -> None:
    x = list(frames_of(voice_24k(2.4, seed=1)))
    n = len(x)
    alone = run(model, {"a": x}, n)["a"]
    fresh = MoshiModel(torch.device("cpu"), checkpoint=str(checkpoint), slots=SLOTS, temperature=0.0)
    other = list(frames_of(voice_24k(2.4, seed=9)))
    crowd = run(
        fresh,
        {
            "a": x,
            "b": [None] * 5 + other[: n - 12],  # joins late, leaves early
            "c": other[:10],  # there from the start, leaves
            "d": [None] * 14 + other[: n - 14],  # takes the slot c left
        },
        n,
    )["a"]
    assert crowd.text == alone.text
    assert crowd.audio == alone.audio  # bit for bit


def test_a_reused_slot_starts_over_and_a_missed_frame_is_not_a_step(
    model: MoshiModel, checkpoint: Path
) -> None:
    x = list(frames_of(voice_24k(2.0, seed=2)))
    n = len(x)
    reference = run(model, {"a": x}, n)["a"]
    fresh = MoshiModel(torch.device("cpu"), checkpoint=str(checkpoint), slots=SLOTS, temperature=0.0)
    # Another session used every slot first: the one "a" gets is reset, so "a" hears as on a fresh model.
    warm = {f"w{i}": list(frames_of(voice_24k(1.0, seed=10 + i))) for i in range(SLOTS)}
    run(fresh, warm, 12)
    again = run(fresh, {"a": x}, n)["a"]
    assert again.text == reference.text and again.audio == reference.audio
    # Frames that do not come (the session sent nothing that tick) leave its state as it was.
    gaps = [x[0], None, None, *x[1:5], None, *x[5:]]
    gapped = run(
        MoshiModel(torch.device("cpu"), checkpoint=str(checkpoint), slots=SLOTS, temperature=0.0),
        {"a": gaps},
        len(gaps),
    )["a"]
    assert gapped.text == reference.text and gapped.audio == reference.audio


def test_turns_are_not_its_to_take(model: MoshiModel) -> None:
    state = model.create_state("s")
    for call in (model.commit, model.clear, model.respond):
        with pytest.raises(BadEventError) as err:
            call(state)
        assert err.value.code == ErrorCode.UNSUPPORTED_BY_MODEL
    assert not model.is_responding(state)
    with pytest.raises(BadEventError):
        model.parse_options({"temperature": 0.1})  # sampling is the worker's, not a session's
    for i in range(SLOTS - 1):
        model.create_state(f"s{i}")
    with pytest.raises(BadEventError) as full:
        model.create_state("one too many")
    assert full.value.code == ErrorCode.CAPACITY_EXHAUSTED


# ---- speech spans -------------------------------------------------------------------------------


def test_a_span_starts_at_a_word_and_ends_after_quiet_frames() -> None:
    spans = SpanTracker(2, quiet_frames=2, silent_tokens=(0, 3))
    slot = np.array([0])

    def step(token: int) -> tuple[bool, bool, bool]:
        s = spans.step(slot, np.array([token]))
        return bool(s.audible[0]), bool(s.started[0]), bool(s.finished[0])

    assert step(3) == (False, False, False)  # silent
    assert step(17) == (True, True, False)  # a word: speaking
    assert step(3) == (True, False, False)  # a pause within the span
    assert step(42) == (True, False, False)
    assert step(0) == (True, False, False)
    assert step(3) == (True, False, True)  # the second quiet frame ends it
    assert step(3) == (False, False, False)
    assert step(5) == (True, True, False)  # the next span


def test_a_muted_span_is_not_heard_until_the_model_falls_silent() -> None:
    spans = SpanTracker(2, quiet_frames=1, silent_tokens=(3,))
    both = np.array([0, 1])
    spans.step(both, np.array([7, 7]))
    assert spans.mute(0) and spans.mute(0)  # muted, and muting again says its span still runs
    s = spans.step(both, np.array([8, 8]))
    assert list(s.audible) == [False, True]  # slot 1 is not touched
    s = spans.step(both, np.array([3, 3]))
    assert list(s.finished) == [False, True]  # the muted span ends without a word
    s = spans.step(both, np.array([9, 3]))
    assert list(s.started) == [True, False] and list(s.audible) == [True, False]
    assert not spans.mute(1)  # nothing to mute while silent
