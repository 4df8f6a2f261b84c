"""The cascade as a user runs it: ``duplex up --pipeline cascade --realtime-port`` (an ASR, a
responder and a TTS pool of two workers each, a session service and the Realtime edge, all
processes) and the official ``openai`` SDK: a WAV of eSpeak NG speech gets the user's words, then
the reply's text, then its audio; a barge-in stops every stage and the next turn is answered; a
TTS worker killed mid-reply, and the reply completes from the other one, none of it twice."""

from __future__ import annotations

import asyncio
import os
import signal
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duplex.audio import decode, resample
from duplex.client import load_wav_as
from duplex.stack import Child, LocalStack
from realtime_service.session_config import PCM24K
from tests.realtime_helpers import audio_of, read_until, sdk, sending, types
from tests.session_helpers import metric_sum, metric_value, metrics_text
from worker_service.models.espeak import Espeak

pytestmark = pytest.mark.process

SAID = "i would like a cup of coffee please"
AGAIN = "open the door please"


def espeak_wav(path: Path, text: str) -> Path:
    """``text`` spoken by eSpeak NG (175 words a minute) into a 16 kHz WAV, as a user records one."""
    es = Espeak.shared()
    voice = resample(es.synthesize(text, voice="en-us", wpm=175), es.sample_rate, 16000)
    pcm = (np.clip(np.concatenate([np.zeros(4000, np.float32), voice]), -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return path


def utterance(path: Path, trailing_silence_ms: int = 1200) -> bytes:
    """The WAV in the API's ``audio/pcm`` (24 kHz), then the silence that ends the turn."""
    return load_wav_as(path, PCM24K) + bytes(PCM24K.bytes_for_ms(trailing_silence_ms))


@pytest.fixture(scope="module")
def cascade() -> Iterator[LocalStack]:
    with LocalStack(pipeline="cascade", workers=2, realtime_port=0) as stack:
        yield stack


@pytest.fixture(scope="module")
def wavs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("speech")
    return {text: espeak_wav(tmp / f"{i}.wav", text) for i, text in enumerate((SAID, AGAIN))}


def heard(transcript: str, said: str) -> int:
    """How many of the words said are in the transcript."""
    return sum(1 for word in said.split() if word in transcript.lower().split())


def rms(pcm: bytes) -> float:
    samples = decode(pcm, PCM24K)
    return float(np.sqrt(np.mean(np.square(samples)))) if len(samples) else 0.0


def stage_total(stack: LocalStack, stage: str, name: str) -> float:
    return sum(
        metric_sum(metrics_text(w.metrics), name) for w in stack.stage_workers(stage) if w.proc.poll() is None
    )


async def test_the_sdk_gets_the_users_words_then_the_replys_text_then_its_audio(
    cascade: LocalStack, wavs: dict[str, Path]
) -> None:
    async with sdk(cascade.realtime_url).realtime.connect(model="cascade") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.audio.input.transcription.model == "cascade"  # its own recognizer
        async with sending(conn, utterance(wavs[SAID]), PCM24K):
            events = await read_until(conn, lambda e: e.type == "response.done", timeout_s=40)
    kinds = types(events)
    done = events[-1]
    assert done.response.status == "completed", done
    # The user's words: as they are heard (before the turn is committed), then whole.
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    assert deltas and kinds.index(deltas[0].type) < kinds.index("input_audio_buffer.committed")
    completed = events[kinds.index("conversation.item.input_audio_transcription.completed")]
    committed = events[kinds.index("input_audio_buffer.committed")]
    assert completed.item_id == committed.item_id == deltas[0].item_id
    assert heard(completed.transcript, SAID) >= 6, completed.transcript
    # Then the reply's text, then its audio.
    first_text = kinds.index("response.output_audio_transcript.delta")
    first_audio = kinds.index("response.output_audio.delta")
    assert kinds.index("conversation.item.input_audio_transcription.completed") < first_text <= first_audio
    reply_text = events[kinds.index("response.output_audio_transcript.done")].transcript
    assert reply_text == f"You said: {completed.transcript}. What else would you like to say?"
    reply = audio_of(events)
    assert PCM24K.duration_ms(len(reply)) > 2000 and rms(reply) > 0.02  # speech, not silence


async def test_a_barge_in_stops_every_stage_and_the_next_turn_is_answered(
    cascade: LocalStack, wavs: dict[str, Path]
) -> None:
    aborted = {
        stage: stage_total(cascade, stage, "duplex_worker_fenced_total") for stage in ("responder", "tts")
    }
    async with sdk(cascade.realtime_url).realtime.connect(model="cascade") as conn:
        assert (await conn.recv()).type == "session.created"
        first: list[Any] = []
        async with sending(conn, utterance(wavs[SAID], trailing_silence_ms=700), PCM24K):
            await read_until(
                conn, lambda e: e.type == "response.output_audio.delta", seen=first, timeout_s=40
            )
        cut = first[-1].response_id
        rest: list[Any] = []
        async with sending(conn, utterance(wavs[AGAIN]), PCM24K):  # the user talks over the reply
            await read_until(
                conn,
                lambda e: (
                    e.type == "response.done" and e.response.id != cut and e.response.status == "completed"
                ),
                seen=rest,
                timeout_s=40,
            )
    kinds = types(rest)
    cancelled = next(e for e in rest if e.type == "response.done" and e.response.id == cut)
    assert cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "turn_detected"
    after = rest[rest.index(cancelled) :]
    assert not any(
        getattr(e, "response_id", None) == cut for e in after if e.type.startswith("response.output")
    )
    # The next turn: its own words, its own reply.
    transcribed = [e for e in rest if e.type == "conversation.item.input_audio_transcription.completed"]
    assert heard(transcribed[-1].transcript, AGAIN) >= 3, transcribed[-1].transcript
    assert kinds[-1] == "response.done" and audio_of(rest, rest[-1].response.id)
    # Every later stage's worker dropped the cancelled reply's work (a newer epoch reached each).
    for stage, before in aborted.items():
        assert stage_total(cascade, stage, "duplex_worker_fenced_total") > before, stage


def tts_redone(stack: LocalStack) -> float:
    """Replies whose TTS part the session service redid on another worker."""
    assert stack.session is not None
    text = metrics_text(stack.session.metrics)
    value = metric_value(text, "duplex_session_stage_failovers_total", 'stage="tts",result="redone"')
    return value or 0.0


def holding(stack: LocalStack, stage: str) -> Child:
    """The worker of ``stage`` that holds a session now."""
    for w in stack.stage_workers(stage):
        if (
            w.proc.poll() is None
            and (metric_sum(metrics_text(w.metrics), "duplex_worker_active_requests") or 0) > 0
        ):
            return w
    raise AssertionError(f"no {stage} worker holds a session")


async def test_a_tts_worker_killed_mid_reply_and_the_reply_completes_from_the_other_once(
    cascade: LocalStack, wavs: dict[str, Path]
) -> None:
    assert cascade.session is not None
    redone = 'duplex_session_stage_failovers_total{result="redone",stage="tts"}'
    before = (
        metric_value(metrics_text(cascade.session.metrics), redone.split("{")[0], redone.split("{")[1][:-1])
        or 0
    )
    async with sdk(cascade.realtime_url).realtime.connect(model="cascade") as conn:
        assert (await conn.recv()).type == "session.created"
        events: list[Any] = []
        async with sending(conn, utterance(wavs[SAID]), PCM24K):
            await read_until(
                conn, lambda e: e.type == "response.output_audio.delta", seen=events, timeout_s=40
            )
            await asyncio.sleep(0.6)  # a little of the reply played
            victim = holding(cascade, "tts")
            os.kill(victim.pid, signal.SIGKILL)
            await read_until(conn, lambda e: e.type == "response.done", seen=events, timeout_s=40)
    done = events[-1]
    assert done.response.status == "completed", done
    text = events[types(events).index("response.output_audio_transcript.done")].transcript
    sentences = [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]
    assert len(sentences) == len(set(sentences)) == 2  # each sentence's text once
    # All of the reply, once: as long as the reply's text spoken once (to within a few frames).
    es = Espeak.shared()
    once = sum(len(es.synthesize(s, voice="en-us", wpm=160)) / es.sample_rate for s in sentences)
    got = PCM24K.duration_ms(len(audio_of(events))) / 1000
    assert abs(got - once) < 0.25, (got, once, text)
    # Redone on the other TTS worker (not, say, finished by the victim before the kill).
    after = metric_value(
        metrics_text(cascade.session.metrics), redone.split("{")[0], redone.split("{")[1][:-1]
    )
    assert after == before + 1
