"""deploy/: the manifests render, validate against the Kubernetes schema offline, keep the
restricted security profile, and the alert rules pass their promtool unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.32"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_every_resource_validates_against_the_schema(rendered: list[dict[str, Any]]) -> None:
    for doc in rendered:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds


def test_schema_validation_catches_a_broken_manifest(rendered: list[dict[str, Any]]) -> None:
    broken = _kind(rendered, "Deployment")[0]
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["ports"][0]["containerPortt"] = container["ports"][0].pop("containerPort")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_pods_run_restricted_with_grpc_probes(rendered: list[dict[str, Any]]) -> None:
    workloads = _kind(rendered, "Deployment") + _kind(rendered, "StatefulSet")
    assert len(workloads) == 2
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"]


def test_workers_are_behind_a_headless_service_and_take_a_gpu(rendered: list[dict[str, Any]]) -> None:
    svc = next(s for s in _kind(rendered, "Service") if s["metadata"]["name"] == "duplex-worker")
    assert svc["spec"]["clusterIP"] == "None"
    worker = _kind(rendered, "StatefulSet")[0]
    assert worker["spec"]["serviceName"] == "duplex-worker"
    limits = worker["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    session = _kind(rendered, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    workers_arg = session["args"][session["args"].index("--workers") + 1]
    replicas = worker["spec"]["replicas"]
    assert workers_arg.split(",") == [f"worker-{i}.duplex-worker:50052" for i in range(replicas)]


def test_alert_rules_pass_promtool_unit_tests() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    subprocess.run(
        ["promtool", "check", "rules", "alerts.yaml"], cwd=DEPLOY / "prometheus", check=True, timeout=60
    )
    subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yaml"], cwd=DEPLOY / "prometheus", check=True, timeout=60
    )


def _args(container: dict[str, Any]) -> dict[str, str]:
    args = container["args"]
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}


def test_the_tiers_use_tls_and_credentials_from_secrets_and_probe_a_health_port(
    rendered: list[dict[str, Any]],
) -> None:
    worker = _kind(rendered, "StatefulSet")[0]["spec"]["template"]["spec"]
    session = _kind(rendered, "Deployment")[0]["spec"]["template"]["spec"]
    w, s = worker["containers"][0], session["containers"][0]
    wa, sa = _args(w), _args(s)
    # Mutual TLS on the worker, with the session tier as the one identity that may take over.
    assert {"--tls-cert", "--tls-key", "--tls-client-ca", "--takeover-identities"} <= wa.keys()
    assert {"--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key"} <= sa.keys()
    # Callers: TLS and a token file; never --insecure.
    assert {"--tls-cert", "--tls-key", "--auth-tokens"} <= sa.keys()
    assert "--insecure" not in w["args"] and "--insecure" not in s["args"]
    for pod, c, a in ((worker, w, wa), (session, s, sa)):
        # Every file the flags name comes from a mounted Secret.
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        for flag, path in a.items():
            if path.startswith("/etc/duplex/"):
                volume = next(n for n, m in mounts.items() if path.startswith(m + "/"))
                assert volume in secrets, (flag, path)
        # Probes reach the plaintext health-only listener, not the TLS API port.
        health = int(a["--health-listen"].rsplit(":", 1)[1])
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == health
