"""A real Prometheus in the loop: Debian's ``prometheus`` scrapes a real local stack (a worker
process and a session-service process) with the project's alert rules, and a worker whose model
emits invalid sparse declarations makes the fail-closed counter rise and its alert fire. Read
back through Prometheus's HTTP API: the alert rules meet the metrics they are written for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from duplex.client import DuplexClient
from tests.procs import REPO, ServiceProcess, start_service
from tests.session_helpers import session_args, worker_args

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus"),
]

RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
SYNTHETIC = "session_service.plugins.synthetic:SyntheticPlugin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _api(base: str, path: str, **query: str) -> Any:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


def _wait(pred: Any, *, within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, AssertionError):
            last = pred()
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError(f"{what} (last seen: {last})")


@contextlib.contextmanager
def _prometheus(tmp: Path, targets: dict[str, str]) -> Iterator[str]:
    """Prometheus on loopback scraping ``{tier: host:port}`` every second, with the project's rules."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "duplex",
                "static_configs": [
                    {"targets": [address], "labels": {"tier": tier}} for tier, address in targets.items()
                ],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    for _attempt in range(3):
        # Prometheus takes no port 0: a free port is picked first, and another process may
        # bind it in between. Prometheus then exits at once, and another port is tried.
        port = _free_port()
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            if _ready(proc, base):
                yield base
                return
        finally:
            _stop(proc)
    raise AssertionError(f"prometheus exited at start three times (exit {proc.returncode})")


def _ready(proc: subprocess.Popen[bytes], base: str) -> bool:
    """Whether Prometheus answers ready at ``base``; False once it has exited instead."""

    def up() -> bool:
        return proc.poll() is not None or urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200

    _wait(up, within=30, what="ready")
    return proc.poll() is None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def _talk(target: str) -> None:
    """One synthetic turn: its reply's audio steps are the ones the broken model declares."""
    async with DuplexClient(target) as client:
        session = await client.open_session(model="synthetic")
        await session.stream_audio([b"\x10\x00" * 512 * 4], realtime=False)
        await session.commit()
        await session.create_response()
        await session.wait_for("response_done", timeout_s=20)
        await session.close()


def test_prometheus_scrapes_both_tiers_and_the_fail_closed_alert_fires(tmp_path: Path) -> None:
    started: list[ServiceProcess] = []
    try:
        worker = start_service(worker_args("--inject-invalid-sparse", model="synthetic", device="cpu"))
        started.append(worker)
        session = start_service(session_args([worker.grpc], plugin=SYNTHETIC))
        started.append(session)
        with _prometheus(tmp_path, {"worker": worker.metrics, "session": session.metrics}) as prom:
            # Both targets are up (the session tier's metrics reach Prometheus too).
            def both_up() -> bool:
                active = _api(prom, "targets")["activeTargets"]
                return {t["labels"]["tier"] for t in active if t["health"] == "up"} == {"worker", "session"}

            _wait(both_up, within=30, what="both tiers scraped")
            # Nothing failed closed yet: the alert is inactive, the counter exists at 0.
            zero = _api(prom, "query", query='sum(duplex_sparse_fail_closed_total{tier="worker"})')
            assert zero["result"] and float(zero["result"][0]["value"][1]) == 0.0
            asyncio.run(_talk(session.grpc))

            def rose() -> float:
                res = _api(prom, "query", query='sum(duplex_sparse_fail_closed_total{tier="worker"})')
                return float(res["result"][0]["value"][1]) if res["result"] else 0.0

            assert _wait(rose, within=30, what="duplex_sparse_fail_closed_total rose") > 0

            def alert() -> str:
                for a in _api(prom, "alerts")["alerts"]:
                    if a["labels"]["alertname"] == "DuplexSparseFailClosed":
                        assert a["labels"]["tier"] == "worker" and a["labels"]["cause"] == "illegal_marker"
                        return str(a["state"])
                return ""

            assert _wait(alert, within=30, what="DuplexSparseFailClosed pending or firing") in (
                "pending",
                "firing",
            )
    finally:
        for proc in reversed(started):
            proc.terminate(timeout=10)
