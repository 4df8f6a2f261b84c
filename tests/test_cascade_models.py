"""The cascade's worker models (``worker_service.models.asr``, ``responder``, ``tts``), with the real
PocketSphinx and eSpeak NG: what each takes and gives, step by step, as the engine drives them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from duplex.audio import decode, resample
from duplex.errors import BadEventError
from duplex.v1 import worker_pb2
from worker_service.commands import MAX_TEXT_CHARS, parse_submission
from worker_service.engine_types import TEXT
from worker_service.model import RequestNews, StepBatch, StepModel
from worker_service.models.asr import CMN_START, AsrModel, AsrState
from worker_service.models.espeak import Espeak
from worker_service.models.responder import ResponderModel, ResponderState
from worker_service.models.tts import TtsModel, TtsState

FRAME = 512
SAID = "i would like a cup of coffee please"


def step(
    model: StepModel[object], state: object, frame: np.ndarray | None = None
) -> tuple[RequestNews | None, bytes]:
    """One step of one session: its news and its audio (b"" without)."""
    frames = np.zeros((1, FRAME), np.float32) if frame is None else frame[None].astype(np.float32)
    with torch.inference_mode():
        result = model.step(StepBatch(["s"], [state], frames, np.array([frame is not None])))
    audio = result.outputs.audio[0].pcm if len(result.outputs.req_id) else b""
    return result.news[0], audio


def speech(text: str, wpm: int = 175) -> np.ndarray:
    """``text`` spoken by eSpeak NG at 16 kHz, with a little silence before it."""
    es = Espeak.shared()
    voice = resample(es.synthesize(text, voice="en-us", wpm=wpm), es.sample_rate, 16000)
    return np.concatenate([np.zeros(4000, np.float32), voice]).astype(np.float32)


# ---- the responder ---------------------------------------------------------------------------


def reply_of(model: ResponderModel, state: ResponderState, limit: int = 100) -> list[RequestNews]:
    out = []
    for _ in range(limit):
        news, _ = step(model, state)  # type: ignore[arg-type]
        if news is not None:
            out.append(news)
            if news.response_finished:
                break
    return out


def test_the_responder_answers_what_it_was_given_a_word_per_step() -> None:
    model = ResponderModel(torch.device("cpu"))
    st = model.create_state("s")
    model.respond(st)
    assert step(model, st)[0] is None  # nothing until its input is all there  # type: ignore[arg-type]
    model.take_text(st, "call my ", False)
    model.take_text(st, "mother", True)
    news = reply_of(model, st)
    assert news[0].response_started and news[-1].response_finished
    assert "".join(n.text for n in news) == "You said: call my mother. What else would you like to say?"
    assert len([n for n in news if n.text]) == 12  # a word per step, as tokens stream
    # The next turn starts from nothing; a CLEAR drops a reply half written.
    model.take_text(st, "hi", True)
    model.respond(st)
    step(model, st)  # type: ignore[arg-type]
    model.clear(st)
    model.respond(st)
    model.take_text(st, "", True)
    assert (
        "".join(n.text for n in reply_of(model, st))
        == "I did not catch that. What else would you like to say?"
    )


def test_the_responder_refuses_text_after_the_last_piece_and_too_much_text() -> None:
    model = ResponderModel(torch.device("cpu"))
    st = model.create_state("s")
    model.take_text(st, "done", True)
    with pytest.raises(BadEventError):
        model.take_text(st, "more", False)
    model.clear(st)
    with pytest.raises(BadEventError):
        for _ in range(6):
            model.take_text(st, "x" * 4000, False)


# ---- the speech synthesizer ------------------------------------------------------------------


def play(
    model: TtsModel, state: TtsState, limit_s: float = 20.0
) -> tuple[np.ndarray, list[tuple[int, str]], list[RequestNews]]:
    """Step until the reply is done: its audio, (frame index, text) of each text news, all news."""
    frames: list[np.ndarray] = []
    marks: list[tuple[int, str]] = []
    news: list[RequestNews] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        n, audio = step(model, state)  # type: ignore[arg-type]
        if audio:
            if n is not None and n.text:
                marks.append((len(frames), n.text))
            frames.append(decode(audio, model.audio_format).reshape(-1))
        if n is not None:
            news.append(n)
            if n.response_finished:
                break
        if not audio:
            time.sleep(0.002)  # a sentence is being synthesized on a helper thread
    return (np.concatenate(frames) if frames else np.zeros(0, np.float32)), marks, news


def synthesized(*sentences: str, wpm: int = 160) -> np.ndarray:
    es = Espeak.shared()
    return np.concatenate(
        [resample(es.synthesize(s, voice="en-us", wpm=wpm), es.sample_rate, 16000) for s in sentences]
    )


@pytest.fixture
def tts() -> Iterator[TtsModel]:
    yield TtsModel(torch.device("cpu"))


def test_tts_speaks_each_sentence_as_it_comes_with_its_text_at_its_first_frame(tts: TtsModel) -> None:
    st = tts.create_state("s")
    tts.respond(st)
    tts.take_text(st, "Hello there.", False)
    tts.take_text(st, "How are you?", True)
    audio, marks, news = play(tts, st)
    want = synthesized("Hello there.", "How are you?")
    # Both sentences, in order, the last frame padded: nothing lost or added (eSpeak NG varies a
    # synthesis by a few samples from one call to the next).
    assert abs(len(audio) - len(want)) <= FRAME + 64
    assert float(np.sqrt(np.mean(audio**2))) > 0.01  # speech, not silence
    first_len = len(synthesized("Hello there."))
    assert [text for _, text in marks] == ["Hello there.", " How are you?"]  # the reply's text, whole
    assert marks[0][0] == 0 and abs(marks[1][0] - first_len // FRAME) <= 1
    assert news[0].response_started and news[-1].response_finished


def test_tts_leaves_out_what_a_client_heard_from_a_lost_worker(tts: TtsModel) -> None:
    whole = synthesized("Hello there.", "How are you?")
    skip = 10 * FRAME  # inside the first sentence (about 12,500 samples)
    st = tts.create_state("s")
    tts.set_options(st, tts.parse_options({"skip_samples": skip}))
    tts.respond(st)
    tts.take_text(st, "Hello there.", False)
    tts.take_text(st, "How are you?", True)
    audio, marks, _ = play(tts, st)
    # What is left of the reply, from where the client was (to within eSpeak NG's few samples).
    assert abs(len(audio) - (len(whole) - skip)) <= FRAME + 64
    # The sentence heard in part had its text; only the next one's goes out.
    assert [text for _, text in marks] == [" How are you?"]


def test_tts_ends_a_reply_with_nothing_to_say_and_a_clear_drops_a_reply(tts: TtsModel) -> None:
    st = tts.create_state("s")
    tts.respond(st)
    tts.take_text(st, "  ", True)
    audio, _, news = play(tts, st)
    assert len(audio) == FRAME and not audio.any() and news[-1].response_finished
    tts.respond(st)
    tts.take_text(st, "A long sentence that will not be heard at all.", False)
    tts.clear(st)
    assert not tts.is_responding(st)
    tts.respond(st)
    tts.take_text(st, "Short.", True)
    audio, marks, _ = play(tts, st)
    assert [text for _, text in marks] == ["Short."]
    with pytest.raises(BadEventError):
        tts.parse_options({"voice": "../../etc"})


def test_a_text_submission_is_bounded() -> None:
    model = ResponderModel(torch.device("cpu"))
    sub = worker_pb2.Submission(request_id="s", kind=TEXT, text="x" * MAX_TEXT_CHARS, text_final=True)
    sub.fence.session_id = "s"
    work, pcm = parse_submission(model, "owner", sub, FRAME * 2)
    assert pcm is None and work.text_final and len(work.text) == MAX_TEXT_CHARS
    sub.text += "x"
    with pytest.raises(BadEventError, match="at most"):
        parse_submission(model, "owner", sub, FRAME * 2)


# ---- speech recognition ----------------------------------------------------------------------


def listen(model: AsrModel, state: AsrState, audio: np.ndarray) -> list[RequestNews]:
    out = []
    for k in range(len(audio) // FRAME):
        news, reply = step(model, state, audio[k * FRAME : (k + 1) * FRAME])  # type: ignore[arg-type]
        assert reply == b""  # it never answers
        if news is not None:
            out.append(news)
    return out


def overlap(heard: str) -> int:
    return sum(1 for word in SAID.split() if word in heard.split())


@pytest.fixture(scope="module")
def asr() -> AsrModel:
    torch.set_num_threads(1)
    return AsrModel(torch.device("cpu"), spare_decoders=1)


def test_asr_gives_the_words_as_they_are_heard_and_the_transcript_at_the_turn_end(asr: AsrModel) -> None:
    st = asr.create_state("s")
    asr.set_options(st, asr.parse_options({"silence_ms": 500, "auto_commit": True}))
    news = listen(asr, st, np.concatenate([speech(SAID), np.zeros(16000, np.float32)]))
    ends = [n for n in news if n.turn_ended]
    assert len(ends) == 1
    transcript = ends[0].user_transcript
    assert transcript is not None and overlap(transcript) >= 6, transcript
    pieces = "".join(n.user_text for n in news)
    assert pieces.split()[:2] == transcript.split()[:2] and pieces.strip()  # heard on the way
    assert sum(1 for n in news if n.user_text) >= 3  # streamed, not all at the end
    asr.release_state(st)


def test_asr_gives_the_transcript_with_a_commit_and_forgets_the_voice_between_sessions(asr: AsrModel) -> None:
    st = asr.create_state("s")
    asr.set_options(st, asr.parse_options({"silence_ms": 2000, "auto_commit": False}))
    news = listen(asr, st, speech(SAID))
    assert not any(n.turn_ended for n in news)
    assert asr.commit(st) > 0
    heard = asr.committed_transcript(st)
    assert heard is not None and overlap(heard) >= 6, heard
    # The decoder went back to the pool with the utterance; the session keeps its voice's mean,
    # which another session does not start from.
    assert st.decoder is None and st.cmn != CMN_START
    other = asr.create_state("t")
    assert other.cmn == CMN_START
    asr.release_state(st)
    with pytest.raises(BadEventError):
        asr.respond(other)
