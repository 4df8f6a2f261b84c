"""The Grafana dashboard (``deploy/grafana/duplex.json``) queries only metrics the running
services export: every metric name in its expressions is one a live in-process stack (a worker
and a session replica) has registered, so a renamed metric cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from tests.session_helpers import InProcessStack

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "duplex.json"
NAME = re.compile(r"\bduplex_[a-z0-9_]+")


#: The series names each metric type exposes (a labelled counter with no sample yet still
#: declares its family on /metrics).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count"),
}


def _exported() -> set[str]:
    """Every series name the process exports (``_total``, ``_bucket``, ... included)."""
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_queried_metric_is_exported_by_the_services(stack: InProcessStack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in NAME.findall(expr)}
    assert len(queried) >= 10  # the dashboard covers sessions, latency, batching and safety
    exported = _exported()
    missing = sorted(queried - exported)
    assert missing == [], f"the dashboard queries metrics no service exports: {missing}"


def test_the_dashboard_has_the_panels_an_operator_looks_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    text = json.dumps(dashboard)
    for needle in (
        "duplex_session_active_sessions",
        'stage=\\"ack\\"',
        'stage=\\"first_audio\\"',
        "duplex_worker_batch_size",
        "duplex_worker_step_duration_seconds",
        "duplex_sparse_fail_closed_total",
        "duplex_worker_fenced_total",
        "duplex_session_worker_stalls_total",
    ):
        assert needle in text, needle
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
