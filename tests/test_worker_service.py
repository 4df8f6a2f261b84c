"""The worker over gRPC, in process (grpc.aio, ephemeral port): batching, sparse outputs, fencing,
the parrot turn, bad submissions, health and reflection."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duplex.errors import from_rpc_error
from duplex.fence import MAX_REQUESTED_EPOCH
from duplex.v1 import worker_pb2, worker_pb2_grpc
from tests.session_helpers import sample
from tests.worker_helpers import (
    APPEND,
    CLEAR,
    COMMIT,
    FRAME,
    RESPOND,
    STARTED,
    STOPPED,
    RunClient,
    acks_of,
    audio_of,
    batch_ids,
    error_codes,
    fence,
    load_speech,
    pad_frames,
    pcm,
    quantize,
    sub,
    updates_of,
    wait_until,
    worker,
)
from worker_service.config import WorkerConfig
from worker_service.models.parrot import ParrotModel, parrot_reply
from worker_service.server import WorkerServer
from worker_service.servicer import SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def attach(stub, session: str, owner: str, epoch: int = 1, takeover: bool = False) -> int:
    resp = await stub.Attach(
        worker_pb2.AttachRequest(session_id=session, epoch=epoch, owner=owner, takeover=takeover), timeout=5
    )
    return int(resp.epoch)


def noise(frames: int, seed: int = 0, level: float = 0.2) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * level).astype(np.float32)


async def test_describe() -> None:
    async with worker() as (_, stub):
        d = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
    assert (d.model_id, d.device, d.frame_samples, d.max_batch) == ("parrot", "cpu", 512, 256)
    assert (d.audio_format.sample_rate_hz, d.audio_format.channels) == (16000, 1)
    assert d.worker_id


async def test_two_sessions_share_one_step_and_listeners_are_not_in_sparse_ids() -> None:
    async with worker() as (_, stub):
        for s in ("s1", "s2"):
            await attach(stub, s, "o1")
        run = RunClient(stub, "o1")
        x = pcm(noise(3))
        run.send(sub("r1", "s1", APPEND, seq=1, data=x), sub("r2", "s2", APPEND, seq=1, data=x))
        msgs = await run.until(lambda m: m.step > 0)
        first = msgs[-1]
        assert [e.request_id for e in first.batch] == ["r1", "r2"]
        assert first.outputs.output_type == worker_pb2.OUTPUT_TYPE_AUDIO
        # Both only listen: sparse, no ids, no payloads.
        assert first.outputs.sparse_audio and not first.outputs.req_id and not first.outputs.audio
        msgs += await run.until(lambda m: any(u.input_seq == 1 for u in m.updates) and len(m.batch) == 2)
        # One frame per request per step: three steps for three frames.
        assert sum(1 for m in msgs if m.step) == 3
        run.close()


def _send_utterance(run: RunClient, signal: np.ndarray) -> list[np.ndarray]:
    """Send ``signal`` as request r1 of session s1: frames in several commands, several frames
    per message, as the session service sends them. Returns the chunks sent (seqs 1...)."""
    chunks = [signal[i : i + 8 * FRAME] for i in range(0, len(signal), 8 * FRAME)]
    for seq, chunk in enumerate(chunks, 1):
        run.send(sub("r1", "s1", APPEND, seq=seq, data=pcm(chunk)))
    return chunks


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
async def test_full_parrot_turn_over_grpc(columns: bool) -> None:
    speech = load_speech("hello.wav")
    signal = pad_frames(speech, silence_s=0.8)
    async with worker() as (_, stub):
        await attach(stub, "s1", "o1")
        run = RunClient(stub, "o1", columns=columns)
        chunks = _send_utterance(run, signal)
        msgs = await run.until(lambda m: any(u.turn_ended for u in m.updates))
        if len(chunks) not in acks_of(msgs, "r1"):
            msgs += await run.until(lambda m: len(chunks) in acks_of([m], "r1"))
        # Every chunk acknowledged once consumed, in order, in either form.
        assert acks_of(msgs, "r1") == list(range(1, len(chunks) + 1))
        ups = updates_of(msgs, "r1")
        start = next(v.sample_offset for u in ups for v in u.vad if v.kind == STARTED)
        committed = next(u.committed_samples for u in ups if u.turn_ended)
        assert 0.5 * len(speech) < committed <= len(signal)
        # The parrot is lockstep: reply frames come one per input frame, so feed silence as the
        # session service does while a response plays.
        # (Extra frames: the reply is computed off the engine thread and starts a few steps later.)
        clock = np.zeros((committed // FRAME + 40) * FRAME, np.float32)
        run.send(
            sub("r1", "s1", RESPOND, turn=1),
            sub("r1", "s1", APPEND, turn=1, seq=len(chunks) + 1, data=pcm(clock)),
        )
        msgs += await run.until(lambda m: any(u.response_finished for u in m.updates))
        reply_ups = [u for u in updates_of(msgs, "r1") if u.response_started or u.response_finished]
        assert [u.fence.turn_id for u in reply_ups] == [1, 1]
        reply = np.frombuffer(audio_of(msgs, "r1"), dtype="<i2").astype(np.float32) / 32768.0
        assert len(reply) == committed
        # The committed utterance is the speech span padded by one frame before its start.
        utterance = quantize(signal)[start - FRAME : start - FRAME + committed]
        expected = parrot_reply(utterance, 4.0)
        assert np.max(np.abs(reply - expected)) < 2e-4
        assert np.corrcoef(reply, utterance)[0, 1] < 0.9  # recognisably altered
        # Every reply frame is a sparse payload of r1 alone, one per step.
        payload_steps = [m for m in msgs if m.outputs.req_id]
        assert all(list(m.outputs.req_id) == ["r1"] and len(m.outputs.audio) == 1 for m in payload_steps)
        assert len(payload_steps) == -(-committed // FRAME)
        steps = [m for m in msgs if m.step]
        if columns:  # the batch and the acks in arrays, never a message per request
            assert all(not m.batch and list(m.columns.request_id) == ["r1"] for m in steps)
            assert all(m.columns.session_id[0] == "s1" and m.columns.epoch[0] == 1 for m in steps)
            assert not any(u.input_seq for m in msgs for u in m.updates)
        else:
            assert all(not m.HasField("columns") and batch_ids(m) == ["r1"] for m in steps)
        run.close()


async def test_stale_epoch_is_rejected_and_its_work_never_runs() -> None:
    async with worker() as (_, stub):
        await attach(stub, "s1", "o1", epoch=3)
        run = RunClient(stub, "o1")
        run.send(sub("r1", "s1", APPEND, epoch=2, seq=1, data=pcm(noise(2))))
        msgs = await run.until(lambda m: m.step == 0)
        assert error_codes(msgs, "r1") == ["stale_epoch"]
        assert msgs[-1].updates[0].fence.epoch == 2
        # Queued work of an older epoch is dropped when a newer epoch arrives. One command, so
        # the newer epoch is there before the engine could have run all 300 frames (two
        # commands leave that to how soon the second one arrives).
        run.send(
            sub("r1", "s1", APPEND, epoch=3, seq=1, data=pcm(noise(300))),
            sub("r1", "s1", APPEND, epoch=4, seq=1, data=pcm(noise(2))),
        )
        msgs = await run.until(lambda m: any(e.fence.epoch == 4 for e in m.batch))
        msgs += await run.quiet(0.3)
        epochs = [e.fence.epoch for m in msgs for e in m.batch]
        assert epochs.count(3) < 300 and epochs.count(4) == 2
        first4 = epochs.index(4)
        assert all(ep == 4 for ep in epochs[first4:])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attach(stub, "s1", "o1", epoch=3)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        run.close()


async def test_newer_epoch_aborts_a_running_reply() -> None:
    utterance = noise(300, level=0.1)  # ~10 s: the reply is still running when the abort arrives
    async with worker() as (_, stub):
        await attach(stub, "s1", "o1")
        run = RunClient(stub, "o1")
        run.send(
            sub("r1", "s1", APPEND, seq=1, data=pcm(utterance), params={"auto_commit": False}),
            sub("r1", "s1", COMMIT),
            sub("r1", "s1", RESPOND, turn=1),
            sub("r1", "s1", APPEND, turn=1, seq=2, data=pcm(np.zeros(300 * FRAME, np.float32))),
        )
        msgs = await run.until(lambda m: any(u.response_started for u in m.updates))
        run.send(
            sub("r1", "s1", APPEND, epoch=2, turn=1, seq=1, data=pcm(noise(1))),
            aborts=(worker_pb2.Abort(request_id="r1", fence=fence("s1", 2, 1), reason="barge_in"),),
        )
        after = await run.until(lambda m: any(e.fence.epoch == 2 for e in m.batch))
        after += await run.quiet(0.3)
        all_msgs = msgs + after
        assert not any(u.response_finished for u in updates_of(all_msgs, "r1"))
        assert len(audio_of(all_msgs, "r1")) < 2 * len(utterance)
        first2 = next(i for i, m in enumerate(after) if any(e.fence.epoch == 2 for e in m.batch))
        for m in after[first2:]:
            assert not m.outputs.audio and all(e.fence.epoch == 2 for e in m.batch)
        run.close()


async def test_a_cancel_keeping_input_aborts_the_reply_and_consumes_the_input_under_the_new_epoch() -> None:
    """A barge-in heard while input is still queued (after a move, seconds of it): the owner's
    abort with ``keep_input`` stops the reply, and the input queued at the worker, and input of
    the old epoch still on its way (in the abort's own command here), is consumed under the new
    epoch, its VAD news and turn end told: none of what the user said is lost."""
    speech = pad_frames(load_speech("hello.wav"))
    said = pad_frames(load_speech("speech_03.wav"))  # what the user says, deep in the queue
    queued = np.concatenate([np.zeros(200 * FRAME, np.float32), said, np.zeros(40 * FRAME, np.float32)])
    async with worker() as (_, stub):
        await attach(stub, "s1", "o1")
        run = RunClient(stub, "o1")
        run.send(
            sub("r1", "s1", APPEND, seq=1, data=pcm(speech), params={"auto_commit": False}),
            sub("r1", "s1", COMMIT),
            sub("r1", "s1", RESPOND, turn=1),
            sub("r1", "s1", APPEND, turn=1, seq=2, data=pcm(queued), params={"auto_commit": True}),
        )
        msgs = await run.until(lambda m: any(u.response_started for u in m.updates))
        run.send(
            sub("r1", "s1", APPEND, epoch=1, turn=1, seq=3, data=pcm(np.zeros(5 * FRAME, np.float32))),
            sub("r1", "s1", APPEND, epoch=2, turn=1, seq=4, data=pcm(np.zeros(2 * FRAME, np.float32))),
            aborts=(
                worker_pb2.Abort(
                    request_id="r1", fence=fence("s1", 2, 1), reason="barge_in", keep_input=True
                ),
            ),
        )
        after = await run.until(lambda m: 4 in acks_of([m], "r1"))
        run.close()
    all_msgs = msgs + after
    assert error_codes(all_msgs, "r1") == []
    # Every input frame was stepped, one per step, and told: the utterance, all of the queue,
    # the 5 of the old epoch that were on their way, the 2 of the new one.
    stepped = [e for m in all_msgs for e in m.batch if e.request_id == "r1"]
    assert len(stepped) == (len(speech) + len(queued)) // FRAME + 5 + 2
    # What the user said in the queue was heard and its turn ended, under either epoch.
    ups = updates_of(after, "r1")
    assert [v.kind for u in ups for v in u.vad if v.sample_offset >= len(speech)] == [STARTED, STOPPED]
    ended = [u for u in ups if u.turn_ended and u.vad[0].sample_offset >= len(speech)]
    # (the VAD's span of it, padded a frame each side: most of the fixture, never more)
    assert len(ended) == 1 and 0.75 * len(said) <= ended[0].committed_samples <= len(said) + 2 * FRAME
    # Nothing of the reply after the abort: no audio, no end.
    first2 = next(i for i, m in enumerate(after) if any(e.fence.epoch == 2 for e in m.batch))
    assert not any(m.outputs.audio for m in after[first2:])
    assert not any(u.response_finished or u.response_started for u in updates_of(after[first2:], "r1"))
    assert not any(u.response_finished for u in updates_of(all_msgs, "r1"))
    assert acks_of(all_msgs, "r1")[-1] == 4


async def test_owners_see_only_their_own_requests() -> None:
    async with worker() as (_, stub):
        await attach(stub, "sa", "A")
        await attach(stub, "sb", "B")
        a, b = RunClient(stub, "A"), RunClient(stub, "B")
        for run, sid, rid in ((a, "sa", "ra"), (b, "sb", "rb")):
            run.send(
                sub(rid, sid, APPEND, seq=1, data=pcm(noise(20)), params={"auto_commit": False}),
                sub(rid, sid, COMMIT),
                sub(rid, sid, RESPOND, turn=1),
                sub(rid, sid, APPEND, turn=1, seq=2, data=pcm(np.zeros(60 * FRAME, np.float32))),
            )
        got_a = await a.until(lambda m: any(u.response_finished for u in m.updates))
        got_b = await b.until(lambda m: any(u.response_finished for u in m.updates))
        for got, mine in ((got_a, "ra"), (got_b, "rb")):
            ids = {e.request_id for m in got for e in m.batch}
            ids |= {u.request_id for m in got for u in m.updates}
            ids |= {r for m in got for r in m.outputs.req_id}
            assert ids == {mine}
            assert len(audio_of(got, mine)) == 20 * FRAME * 2
        a.close()
        b.close()


async def test_takeover_fences_the_old_owner() -> None:
    async with worker() as (_, stub):
        assert await attach(stub, "s1", "old", epoch=5) == 5
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attach(stub, "s1", "new", epoch=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        old = RunClient(stub, "old")
        old.send(
            sub("r1", "s1", APPEND, epoch=5, seq=1, data=pcm(noise(200)), params={"auto_commit": False}),
        )
        await old.until(lambda m: m.step > 0)
        granted = await attach(stub, "s1", "new", epoch=1, takeover=True)
        assert granted == 6
        resp = await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=6, owner="new"), timeout=5)
        assert resp.resumed
        old.send(
            sub("r1", "s1", COMMIT, epoch=5),
            sub("r1", "s1", COMMIT, epoch=6),
        )
        got = await old.until(lambda m: len(error_codes([m], "r1")) == 2)
        assert error_codes(got, "r1")[-2:] == ["stale_epoch", "not_owner"]
        # Nothing of epoch 5 is stepped for the old owner once the takeover is processed (the
        # rejection proves it was). Steps it got before the rejection may be of input queued
        # before the takeover: the worker steps that as fast as it can, later on a busy machine.
        after = await old.quiet(0.3)
        assert not any(m.step for m in after), [str(m)[:300] for m in after]
        new = RunClient(stub, "new")
        new.send(sub("n1", "s1", APPEND, epoch=6, seq=1, data=pcm(noise(2))))
        got_new = await new.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        assert {e.request_id for m in got_new for e in m.batch} == {"n1"}
        old.close()
        new.close()


async def _turn_ended_then_taken_over(*, answered: bool) -> list[worker_pb2.RequestUpdate]:
    """Owner "old" streams an utterance until the model ends the turn; it answers it or not
    (an owner killed after the news left the worker, or while it was on its way); owner "new"
    takes the session over and appends silence. Returns the updates "new" got."""
    signal = pad_frames(load_speech("hello.wav"), silence_s=0.8)
    async with worker() as (_, stub):
        await attach(stub, "s1", "old")
        old = RunClient(stub, "old")
        chunks = _send_utterance(old, signal)
        msgs = await old.until(lambda m: any(u.turn_ended for u in m.updates))
        committed = next(u.committed_samples for u in updates_of(msgs, "r1") if u.turn_ended)
        if answered:
            # The parrot is lockstep: its reply steps with input frames.
            clock = pcm(np.zeros(40 * FRAME, np.float32))
            old.send(
                sub("r1", "s1", RESPOND, turn=1),
                sub("r1", "s1", APPEND, turn=1, seq=len(chunks) + 1, data=clock),
            )
            await old.until(lambda m: any(u.response_started for u in m.updates))
        old.close()
        assert await attach(stub, "s1", "new", takeover=True) == 2
        new = RunClient(stub, "new")
        new.send(sub("n1", "s1", APPEND, epoch=2, seq=1, data=pcm(np.zeros(4 * FRAME, np.float32))))
        got = await new.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        new.close()
    ups = updates_of(got, "n1")
    ended = [u for u in ups if u.turn_ended]
    if ended:
        assert ended[0].committed_samples == committed
    return ups


async def test_a_turn_ended_and_unanswered_is_told_to_the_owner_that_takes_over() -> None:
    """Found by tests/test_fault_load.py (a lost turn about one CI run in six): a session
    service replica was killed ~40 ms before its sessions were taken over, and the worker,
    stepping on meanwhile, heard a turn end and sent the news to the dead replica. The new
    owner never learnt of it: the input was consumed, the model does not end a turn twice,
    and the user's turn went unanswered."""
    ups = await _turn_ended_then_taken_over(answered=False)
    ended = [u for u in ups if u.turn_ended]
    assert len(ended) == 1 and ended[0].fence.epoch == 2, [str(u) for u in ups]
    assert sample("duplex_worker_turns_handed_over_total") >= 1


async def test_a_turn_already_answered_is_not_told_again_after_a_takeover() -> None:
    ups = await _turn_ended_then_taken_over(answered=True)
    assert not any(u.turn_ended for u in ups), [str(u) for u in ups]


async def test_a_takeover_of_a_session_at_the_highest_epoch_is_stale_not_an_overflow() -> None:
    """Found by tests/live_fuzz.py: a takeover of a session at epoch 2^64-1 was granted 2^64,
    which no message can carry: the Attach ended with UNKNOWN (a traceback in the worker's log)
    and the session's fence held an epoch no submission could name."""
    top = 2**64 - 1
    async with worker() as (server, stub):
        # No caller may ask for the top (nor anything above 2^63-1) any more: issue 26.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attach(stub, "s1", "old", epoch=top)
        assert (err.value.code(), from_rpc_error(err.value).code) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_event",
        )
        # Only 2^63 takeovers could bring a session to the top; should one get there, a
        # takeover is stale, never an overflow.
        assert await attach(stub, "s1", "old", epoch=MAX_REQUESTED_EPOCH) == MAX_REQUESTED_EPOCH
        server.fences._sessions["s1"].epoch = top  # the state 2^63 takeovers would leave
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attach(stub, "s1", "new", epoch=1, takeover=True)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert from_rpc_error(err.value).code == "stale_epoch"
        assert server.fences.current("s1") == (top, "old")
        # Below the top a takeover still gets the next epoch.
        server.fences._sessions["s1"].epoch = top - 1
        assert await attach(stub, "s1", "new", epoch=1, takeover=True) == top


async def test_a_run_stream_dropped_while_the_worker_waits_to_write_leaves_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by tests/live_fuzz.py: an owner that stops reading its Run stream (the worker then
    waits in a write: the transport's window is full) and drops it: the write failed inside
    gRPC's handling of the response stream, which logged "ExecuteBatchError raised in core by
    servicer method" with a traceback. The client keeps its window at 64 KiB (no BDP probing;
    a gRPC client otherwise grows it and buffers what nobody reads)."""
    async with worker() as (server, _):
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(server.address, options=options) as ch:
            stub = worker_pb2_grpc.DuplexWorkerStub(ch)
            await attach(stub, "s1", "deaf")
            # An utterance, its reply, and silence that steps about 300 KB of reply out.
            subs = [sub("s1", "s1", APPEND, seq=i + 1, data=pcm(noise(8, i, 0.3))) for i in range(8)]
            subs += [sub("s1", "s1", COMMIT), sub("s1", "s1", RESPOND, turn=1)]
            silence = b"\x00" * 8 * FRAME * 2
            subs += [sub("s1", "s1", APPEND, turn=1, seq=9 + i, data=silence) for i in range(40)]

            async def commands() -> AsyncIterator[worker_pb2.WorkerCommand]:
                yield worker_pb2.WorkerCommand(owner="deaf", submit=subs)
                await asyncio.sleep(30)

            call = stub.Run(commands())
            # The worker's writer waits: its steps for the owner queue up.
            await wait_until(lambda: sample("duplex_worker_queue_depth", {"queue": "output"}) > 20)
            call.cancel()
            await wait_until(lambda: server.owners() == [])
            await asyncio.sleep(0.2)
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert failed == [], [f"{r.name}: {r.getMessage()}" for r in failed]


async def test_bad_submissions_get_errors_and_others_go_on() -> None:
    async with worker(max_queued_frames=50) as (_, stub):
        for s in ("s1", "s2", "s3", "s4", "s5"):
            await attach(stub, s, "o1")
        run = RunClient(stub, "o1")
        run.send(
            sub("r1", "s1", APPEND, seq=7, data=pcm(noise(2))),
            sub("r2", "s2", APPEND, seq=1, data=b"\x00" * 1000),  # partial frame
            sub("r3", "s3", 99),  # unknown kind
            sub("r4", "s4", COMMIT, params={"silence_ms": "soon"}),
            sub("r5", "s5", APPEND, seq=1, data=pcm(noise(51))),  # over the queue bound
            sub("r6", "nope", CLEAR),  # not attached
            sub("r1", "s1", RESPOND, turn=1),  # nothing committed
        )
        msgs = await run.until(lambda m: any(u.input_seq == 7 for u in m.updates))
        msgs += await run.quiet(0.2)
        assert error_codes(msgs, "r2") == ["bad_submission"]
        assert error_codes(msgs, "r3") == ["bad_submission"]
        assert error_codes(msgs, "r4") == ["bad_submission"]
        assert error_codes(msgs, "r5") == ["capacity"]
        assert error_codes(msgs, "r6") == ["unknown_session"]
        assert error_codes(msgs, "r1") == ["no_committed_input"]
        assert sum(1 for m in msgs for e in m.batch if e.request_id == "r1") == 2
        run.close()


async def test_health_goes_serving_once_the_model_is_loaded() -> None:
    gate = threading.Event()

    def slow_model(device):
        assert gate.wait(10)
        return ParrotModel(device)

    server = WorkerServer(WorkerConfig(metrics_port=-1, drain_grace_s=0.1), model_factory=slow_model)
    await server.start(wait_ready=False)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE_NAME):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await attach(worker_pb2_grpc.DuplexWorkerStub(channel), "s1", "o1")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
            gate.set()
            await asyncio.wait_for(server.wait_ready(), 10)
            # The next status the watch reports: SERVING, once the model is loaded.
            assert (await asyncio.wait_for(watch.read(), 10)).status == SERVING
            watch.cancel()
            await server.drain()
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == NOT_SERVING
    finally:
        gate.set()
        await server.stop(grace=0.1)


async def test_reflection_lists_the_service() -> None:
    async with worker() as (server, _):
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for resp in stub.ServerReflectionInfo(requests(), timeout=5):
                names = {s.name for s in resp.list_services_response.service}
                break
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


async def test_orphaned_sessions_are_released_after_the_grace() -> None:
    """A crashed session-service replica must not pin model state and capacity forever."""
    streams = "duplex_worker_owner_streams"  # this worker is the only one in the process
    released = "duplex_worker_orphaned_sessions_released_total"
    released_before = sample(released)
    async with worker(orphan_grace_s=2.0, max_sessions=3) as (_, stub):
        await attach(stub, "gone1", "crashed")
        await attach(stub, "gone2", "crashed")
        await attach(stub, "kept", "alive")
        run = RunClient(stub, "crashed")
        run.send(sub("r1", "gone1", APPEND, seq=1, data=pcm(noise(2))))
        await run.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        alive = RunClient(stub, "alive")
        alive.send(sub("k", "kept", APPEND, seq=1, data=pcm(noise(1))))
        await alive.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        assert sample(streams) == 2
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await attach(stub, "new1", "alive")
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        run.close()
        await wait_until(lambda: sample(streams) == 1)  # the worker saw the stream end: grace runs
        # Within the grace the owner may come back and carry on with its sessions.
        back = RunClient(stub, "crashed")
        back.send(sub("r1", "gone1", APPEND, seq=2, data=pcm(noise(1))))
        await back.until(lambda m: any(u.input_seq == 2 for u in m.updates))
        assert sample(released) == released_before  # nothing was released meanwhile
        back.close()
        # Past the grace: its two sessions are released, capacity is back, the live owner's stays.
        await wait_until(lambda: sample(released) - released_before == 2)
        await attach(stub, "new1", "alive")
        await attach(stub, "new2", "alive")
        resp = await stub.Attach(
            worker_pb2.AttachRequest(session_id="kept", epoch=1, owner="alive"), timeout=5
        )
        assert resp.resumed
        alive.close()


async def test_a_displaced_owner_is_told_at_once() -> None:
    """After a takeover the old owner's queued work is gone; it hears so without submitting
    again (otherwise it would wait for output that never comes)."""
    async with worker() as (_, stub):
        await attach(stub, "s1", "old")
        old = RunClient(stub, "old")
        old.send(sub("r1", "s1", APPEND, seq=1, data=pcm(noise(2))))
        await old.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        assert await attach(stub, "s1", "new", takeover=True) == 2
        got = await old.until(lambda m: bool(error_codes([m], "r1")))
        assert error_codes(got, "r1") == ["not_owner"]
        assert got[-1].step == 0 and got[-1].updates[0].fence.epoch == 2
        old.close()
