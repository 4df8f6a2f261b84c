"""Replayed input at the worker (``Submission.replay``), over gRPC in process with the parrot.

A session that moved off a lost worker replays its turn's input on the new one. Input the lost
worker had reported consumed is sent with ``replay``: the new worker consumes it like any input
(its model state, the VAD's and the committed utterance, is rebuilt, and ``input_seq`` counts
it), but its news (VAD events, turn ends) were reported already and are not reported again.
Input sent without ``replay`` reports its news as always.
"""

from __future__ import annotations

import numpy as np

from duplex.v1 import worker_pb2, worker_pb2_grpc
from tests.session_helpers import speech
from tests.worker_helpers import (
    APPEND,
    FRAME,
    RESPOND,
    STARTED,
    STOPPED,
    RunClient,
    audio_of,
    pad_frames,
    pcm,
    quantize,
    sub,
    updates_of,
    worker,
)
from worker_service.models.parrot import parrot_reply

CHUNK_FRAMES = 8
PITCH = 4.0  # the parrot's default


def utterance(i: int) -> np.ndarray:
    """Fixture speech ``i`` with a little silence before it and enough after it to end a turn."""
    lead = np.zeros(int(0.2 * 16000), np.float32)
    return pad_frames(np.concatenate([lead, speech(i)]), silence_s=1.0)


def chunks(signal: np.ndarray) -> list[bytes]:
    step = CHUNK_FRAMES * FRAME
    return [pcm(signal[i : i + step]) for i in range(0, len(signal), step)]


def append(rid: str, seq: int, data: bytes, *, replay: bool) -> worker_pb2.Submission:
    s = sub(rid, rid, APPEND, seq=seq, data=data)
    s.replay = replay
    return s


async def attach(stub: worker_pb2_grpc.DuplexWorkerStub, session: str, owner: str) -> None:
    await stub.Attach(worker_pb2.AttachRequest(session_id=session, epoch=1, owner=owner), timeout=5)


def vad_kinds(ups: list[worker_pb2.RequestUpdate]) -> list[int]:
    return [v.kind for u in ups for v in u.vad]


def consumed(msgs: list[worker_pb2.StepOutput], rid: str) -> int:
    return max((u.input_seq for u in updates_of(msgs, rid)), default=0)


async def test_replayed_speech_is_consumed_without_its_news() -> None:
    signal = utterance(1)
    parts = chunks(signal)
    async with worker() as (_, stub):
        for rid in ("replayed", "fresh", "tail"):
            await attach(stub, rid, "o1")
        run = RunClient(stub, "o1")
        try:
            # The same input three ways: all replayed; none replayed; the speech replayed and the
            # silence that ends the turn not (a worker lost just before it heard the turn end).
            split = len(parts) // 2  # within the speech: its start replayed, its end not
            for seq, data in enumerate(parts, 1):
                run.send(
                    append("replayed", seq, data, replay=True),
                    append("fresh", seq, data, replay=False),
                    append("tail", seq, data, replay=seq <= split),
                )
            last = len(parts)
            msgs = await run.until(
                lambda _m: all(consumed(run.received, rid) == last for rid in ("replayed", "fresh", "tail")),
                wait_s=30,
            )
            msgs += await run.quiet(0.3)
            msgs = run.received

            fresh = updates_of(msgs, "fresh")
            assert vad_kinds(fresh)[:2] == [STARTED, STOPPED]
            ended = [u for u in fresh if u.turn_ended]
            assert len(ended) == 1 and ended[0].committed_samples > len(speech(1)) // 2

            replayed = updates_of(msgs, "replayed")
            # Consumed, and counted as such (what the session acks and replays by) ...
            assert consumed(msgs, "replayed") == last
            assert [u.input_seq for u in replayed if u.input_seq] == sorted(
                u.input_seq for u in replayed if u.input_seq
            )
            # ... but nothing the first worker reported already.
            assert vad_kinds(replayed) == []
            assert not any(u.turn_ended or u.committed_samples or u.text for u in replayed)
            assert not any(u.HasField("error") for u in replayed)

            # Only the news of the input not replayed: the speech's end and the turn end, at the
            # same point as for the session that heard it all first-hand.
            tail = updates_of(msgs, "tail")
            assert STARTED not in vad_kinds(tail)
            assert STOPPED in vad_kinds(tail)
            tail_ended = [u for u in tail if u.turn_ended]
            assert [u.committed_samples for u in tail_ended] == [ended[0].committed_samples]
        finally:
            run.close()


async def test_a_respond_after_a_replayed_utterance_answers_that_utterance() -> None:
    signal = utterance(2)
    parts = chunks(signal)
    async with worker() as (_, stub):
        for rid in ("replayed", "fresh"):
            await attach(stub, rid, "o1")
        run = RunClient(stub, "o1")
        try:
            for seq, data in enumerate(parts, 1):
                run.send(append("replayed", seq, data, replay=True), append("fresh", seq, data, replay=False))
            msgs = await run.until(lambda m: any(u.turn_ended for u in m.updates), wait_s=30)
            msgs += await run.until(
                lambda _m: (
                    consumed(run.received, "replayed") == len(parts)
                    and consumed(run.received, "fresh") == len(parts)
                ),
                wait_s=30,
            )
            fresh = updates_of(msgs, "fresh")
            start = next(v.sample_offset for u in fresh for v in u.vad if v.kind == STARTED)
            committed = next(u.committed_samples for u in fresh if u.turn_ended)
            assert not any(u.turn_ended for u in updates_of(msgs, "replayed"))

            # The replayed session's model committed the same utterance (its turn detection ran on
            # the replayed input): a RESPOND answers it. The parrot is lockstep: reply frames come
            # one per input frame, so silence follows as the session service feeds it.
            clock = pcm(np.zeros((committed // FRAME + 40) * FRAME, np.float32))
            seq = len(parts) + 1
            for rid in ("replayed", "fresh"):
                run.send(sub(rid, rid, RESPOND, turn=1), sub(rid, rid, APPEND, turn=1, seq=seq, data=clock))
            done: set[str] = set()

            def finished(m: worker_pb2.StepOutput) -> bool:
                done.update(u.request_id for u in m.updates if u.response_finished)
                return done == {"replayed", "fresh"}

            msgs += await run.until(finished, wait_s=30)
            replayed_ups = updates_of(msgs, "replayed")
            assert not any(u.HasField("error") for u in replayed_ups)
            assert sum(u.response_started for u in replayed_ups) == 1  # a reply's own news stay
            reply = np.frombuffer(audio_of(msgs, "replayed"), dtype="<i2").astype(np.float32) / 32768.0
            assert len(reply) == committed
            utterance_span = quantize(signal)[start - FRAME : start - FRAME + committed]
            expected = parrot_reply(utterance_span, PITCH)
            assert np.max(np.abs(reply - expected)) < 2e-4
            assert audio_of(msgs, "replayed") == audio_of(msgs, "fresh")
        finally:
            run.close()
