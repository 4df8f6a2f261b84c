"""The real ``duplex worker`` process: listening line, device selection, /metrics, SIGTERM; and
the CLI's refusal of a bad device (in this process: it refuses before starting anything)."""

from __future__ import annotations

import asyncio
import logging
import signal
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.cli import main
from duplex.v1 import worker_pb2, worker_pb2_grpc
from tests.worker_helpers import worker_process

METRIC_NAMES = (
    "duplex_worker_step_duration_seconds",
    "duplex_worker_batch_size",
    "duplex_worker_model_cpu_seconds_total",
    "duplex_worker_active_requests",
    "duplex_worker_queue_depth",
    "duplex_worker_fenced_total",
    "duplex_worker_submissions_total",
    "duplex_sparse_fail_closed_total",
)


@pytest.mark.process
def test_process_serves_describes_exposes_metrics_and_exits_on_sigterm() -> None:
    with worker_process("--model", "parrot", "--device", "auto") as (proc, info):
        assert info["grpc"].startswith("127.0.0.1:") and info["metrics"].startswith("127.0.0.1:")
        with grpc.insecure_channel(info["grpc"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            desc = worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        expected = "cuda:0" if torch.cuda.is_available() else "cpu"
        assert (desc.model_id, desc.device) == ("parrot", expected)
        with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for name in METRIC_NAMES:
            assert name in text, name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stdout is not None and proc.stdout.read() == ""  # exactly one stdout line


def test_bad_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI's own refusal (``duplex worker``'s exit code and message), in this process: it
    # refuses before it binds, serves or announces anything.
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the CLI configures logging
    try:
        code = main(["worker", "--device", "tpu", "--listen", "127.0.0.1:0"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    assert code == 2 and "device" in err and out == ""


@pytest.mark.process
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_runs_parrot_on_the_gpu() -> None:
    with worker_process("--model", "parrot", "--device", "cuda") as (proc, info):
        with grpc.insecure_channel(info["grpc"]) as channel:
            desc = worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        assert desc.device.startswith("cuda")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


@pytest.mark.process
async def test_process_answers_reflection_and_a_scripted_parrot_conversation() -> None:
    """The issue's done-when, against the real process: reflection, Attach, and a Run
    conversation (speech, silence, turn end, RESPOND) that yields the parrot's reply."""
    import numpy as np
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from tests.worker_helpers import (
        APPEND,
        FRAME,
        RESPOND,
        RunClient,
        audio_of,
        load_speech,
        pad_frames,
        pcm,
        sub,
    )

    with worker_process("--model", "parrot", "--device", "cpu") as (proc, info):
        async with grpc.aio.insecure_channel(info["grpc"]) as channel:
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def ask() -> object:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for answer in refl.ServerReflectionInfo(ask()):
                names = {s.name for s in answer.list_services_response.service}
                break
            assert "duplex.v1.DuplexWorker" in names

            stub = worker_pb2_grpc.DuplexWorkerStub(channel)
            granted = await stub.Attach(
                worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5
            )
            assert granted.epoch == 1
            run = RunClient(stub, "o1")
            run.send(
                sub("r1", "s1", APPEND, seq=1, data=pcm(pad_frames(load_speech("hello.wav"), silence_s=0.8)))
            )
            msgs = await run.until(lambda m: any(u.turn_ended for u in m.updates), wait_s=30)
            committed = next(u.committed_samples for m in msgs for u in m.updates if u.turn_ended)
            # The parrot computes its reply off the engine thread and steps it in lockstep with
            # input: frames stepped before the reply is ready carry none. All the silence sent
            # at once could be stepped before a cold process's first pitch shift is done (seen:
            # 54 of 100 frames), leaving too few to finish on. So silence goes as a client sends
            # it, a few frames at a time, until the reply has started, then all it needs.
            # (A read is never timed out here: cancelling it would cancel the call.)
            run.send(sub("r1", "s1", RESPOND, turn=1))
            started = asyncio.ensure_future(
                run.until(lambda m: any(u.response_started for u in m.updates), 30)
            )
            seq = 1
            while not started.done() and seq < 300:
                seq += 1
                run.send(sub("r1", "s1", APPEND, turn=1, seq=seq, data=pcm(np.zeros(2 * FRAME))))
                await asyncio.wait([started], timeout=0.02)
            msgs = await started
            rest = pcm(np.zeros((committed // FRAME + 40) * FRAME))
            run.send(sub("r1", "s1", APPEND, turn=1, seq=seq + 1, data=rest))
            msgs += await run.until(lambda m: any(u.response_finished for u in m.updates), wait_s=30)
            assert len(audio_of(msgs, "r1")) == 2 * committed > 0
            run.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
