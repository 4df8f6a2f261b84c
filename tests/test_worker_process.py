"""The real ``duplex worker`` process: listening line, device selection, /metrics, SIGTERM."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.v1 import worker_pb2, worker_pb2_grpc
from tests.worker_helpers import worker_process

pytestmark = pytest.mark.process

METRIC_NAMES = (
    "duplex_worker_step_duration_seconds",
    "duplex_worker_batch_size",
    "duplex_worker_active_requests",
    "duplex_worker_queue_depth",
    "duplex_worker_fenced_total",
    "duplex_worker_submissions_total",
    "duplex_sparse_fail_closed_total",
)


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


def test_bad_device_is_refused() -> None:
    import subprocess
    import sys

    from tests.worker_helpers import ROOT

    res = subprocess.run(
        [sys.executable, "-m", "duplex", "worker", "--device", "tpu", "--listen", "127.0.0.1:0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "device" in res.stderr and res.stdout == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_runs_parrot_on_the_gpu() -> None:
    with worker_process("--model", "parrot", "--device", "cuda") as (proc, info):
        with grpc.insecure_channel(info["grpc"]) as channel:
            desc = worker_pb2_grpc.DuplexWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
        assert desc.device.startswith("cuda")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
