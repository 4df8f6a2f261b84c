"""deploy/: every overlay renders, validates against the Kubernetes schemas offline and passes
``make deploy-check`` (deploy/check.py, run here under ``make test`` too); the images' Containerfiles
keep their promises; the alert rules pass their promtool tests. And the check is worth something:
each test below breaks one rendered object (or one Containerfile) the way a careless edit would,
and sees the check fail."""

from __future__ import annotations

import copy
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import check
from duplex.cli import SUBCOMMANDS
from duplex.serving import LIVENESS_SERVICE

Doc = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    return {path.name: check.render(path) for path in check.overlay_dirs()}


def obj(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def container(docs: list[Doc], kind: str = "Deployment", name: str = "session") -> Doc:
    found: Doc = obj(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return found


def pod(docs: list[Doc], kind: str = "Deployment", name: str = "session") -> Doc:
    found: Doc = obj(docs, kind, name)["spec"]["template"]["spec"]
    return found


def set_arg(c: Doc, flag: str, value: str) -> None:
    c["args"][c["args"].index(flag) + 1] = value


def drop_arg(c: Doc, flag: str) -> None:
    i = c["args"].index(flag)
    del c["args"][i : i + 2]


# -- what the overlays are ------------------------------------------------------------------------


def test_the_overlays_render_and_pass_every_check(rendered: dict[str, list[Doc]]) -> None:
    assert {"cpu", "gpu", "gpu-full"} <= rendered.keys()
    for name, docs in rendered.items():
        assert check.schema_problems(docs) == [], name
        assert check.object_problems(docs) == [], name


def test_what_each_overlay_holds(rendered: dict[str, list[Doc]]) -> None:
    cpu, gpu, full = rendered["cpu"], rendered["gpu"], rendered["gpu-full"]
    # CPU: no GPU anywhere, --device cpu, the CPU worker image.
    w = container(cpu, "StatefulSet", "worker")
    assert "nvidia.com/gpu" not in w["resources"]["limits"] and check.args_map(w)["--device"] == "cpu"
    assert "/worker-cpu@sha256:" in w["image"]
    # GPU: one GPU, GPU nodes, --device cuda, the CUDA image.
    w = container(gpu, "StatefulSet", "worker")
    assert w["resources"]["limits"]["nvidia.com/gpu"] == 1 and check.args_map(w)["--device"] == "cuda"
    assert pod(gpu, "StatefulSet", "worker")["nodeSelector"] == {"duplex.dev/gpu": "true"}
    assert "/worker-cuda@sha256:" in w["image"]
    # Everything optional: Prometheus Operator, cert-manager, the active-sessions autoscaler.
    kinds = {d["kind"] for d in full}
    assert {"PodMonitor", "PrometheusRule", "Certificate", "Issuer"} <= kinds
    hpa = obj(full, "HorizontalPodAutoscaler", "session")
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}
    # WebRTC: the edge's media range, announced on the pod's IP and opened to browsers.
    edge = container(full, "Deployment", "realtime")
    assert check.args_map(edge)["--webrtc-ports"] == "40000-40063"
    assert check.args_map(edge)["--webrtc-address"] == "$(POD_IP)"
    media = obj(full, "NetworkPolicy", "realtime-media")["spec"]["ingress"][0]["ports"]
    assert media == [{"protocol": "UDP", "port": 40000, "endPort": 40063}]
    for docs in (cpu, gpu):
        assert "/realtime@sha256:" in container(docs, "Deployment", "realtime")["image"]
        assert "--webrtc-ports" not in container(docs, "Deployment", "realtime")["args"]
    for docs in rendered.values():
        # The liveness probes ask for the service Health serves for them.
        for kind, name in (("Deployment", "session"), ("StatefulSet", "worker")):
            assert container(docs, kind, name)["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE


def test_release_mode_refuses_the_placeholder_images(rendered: dict[str, list[Doc]]) -> None:
    problems = check.object_problems(rendered["gpu"], release=True)
    assert problems and all("placeholder" in p for p in problems)
    docs = copy.deepcopy(rendered["gpu"])
    container(docs)["image"] = "registry.corp/duplex/session@sha256:" + "ab" * 32
    container(docs, "StatefulSet", "worker")["image"] = "registry.corp/duplex/worker-cuda@sha256:" + "cd" * 32
    container(docs, "Deployment", "realtime")["image"] = "registry.corp/duplex/realtime@sha256:" + "ef" * 32
    assert check.object_problems(docs, release=True) == []


# -- the check fails on what it must --------------------------------------------------------------

Mutation = Callable[[list[Doc]], object]


def _liveness_typo(docs: list[Doc]) -> None:
    container(docs)["livenessProbe"]["grpc"]["service"] = "duplex.v1.Livenes"


def _liveness_on_readiness(docs: list[Doc]) -> None:
    del container(docs)["livenessProbe"]["grpc"]["service"]


def _readiness_on_liveness(docs: list[Doc]) -> None:
    container(docs, "StatefulSet", "worker")["readinessProbe"]["grpc"]["service"] = LIVENESS_SERVICE


def _session_startup_on_workers(docs: list[Doc]) -> None:
    del container(docs)["startupProbe"]["grpc"]["service"]


def _probe_port_typo(docs: list[Doc]) -> None:
    container(docs, "StatefulSet", "worker")["readinessProbe"]["grpc"]["port"] = 50026


def _no_startup_probe(docs: list[Doc]) -> None:
    del container(docs, "StatefulSet", "worker")["startupProbe"]


def _writable_root(docs: list[Doc]) -> None:
    del container(docs)["securityContext"]["readOnlyRootFilesystem"]


def _escalation(docs: list[Doc]) -> None:
    container(docs, "StatefulSet", "worker")["securityContext"]["allowPrivilegeEscalation"] = True


def _capabilities(docs: list[Doc]) -> None:
    container(docs)["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}


def _root(docs: list[Doc]) -> None:
    del pod(docs)["securityContext"]["runAsNonRoot"]


def _no_seccomp(docs: list[Doc]) -> None:
    del pod(docs, "StatefulSet", "worker")["securityContext"]["seccompProfile"]


def _token(docs: list[Doc]) -> None:
    del pod(docs)["automountServiceAccountToken"]


def _sa_token(docs: list[Doc]) -> None:
    obj(docs, "ServiceAccount", "duplex-worker")["automountServiceAccountToken"] = True


def _host_network(docs: list[Doc]) -> None:
    pod(docs, "StatefulSet", "worker")["hostNetwork"] = True


def _unbounded_tmp(docs: list[Doc]) -> None:
    pod(docs, "StatefulSet", "worker")["volumes"][0]["emptyDir"] = {}


def _no_memory_limit(docs: list[Doc]) -> None:
    del container(docs)["resources"]["limits"]["memory"]


def _latest(docs: list[Doc]) -> None:
    container(docs)["image"] = "registry.example.com/duplex/session:latest"


def _latest_with_digest(docs: list[Doc]) -> None:
    container(docs)["image"] = "registry.example.com/duplex/session:latest@sha256:" + "0" * 64


def _no_default_deny(docs: list[Doc]) -> None:
    docs.remove(obj(docs, "NetworkPolicy", "default-deny"))


def _ingress_from_anywhere(docs: list[Doc]) -> None:
    del obj(docs, "NetworkPolicy", "session")["spec"]["ingress"][0]["from"]


def _every_namespace(docs: list[Doc]) -> None:
    obj(docs, "NetworkPolicy", "session")["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}}]


def _every_namespace_by_expression(docs: list[Doc]) -> None:
    expr = {"key": "kubernetes.io/metadata.name", "operator": "Exists"}
    obj(docs, "NetworkPolicy", "session")["spec"]["ingress"][0]["from"] = [
        {"namespaceSelector": {"matchExpressions": [expr]}}
    ]


def _policy_port_typo(docs: list[Doc]) -> None:
    obj(docs, "NetworkPolicy", "worker")["spec"]["ingress"][0]["ports"][0]["port"] = 50025


def _egress_anywhere(docs: list[Doc]) -> None:
    del obj(docs, "NetworkPolicy", "session")["spec"]["egress"][0]["to"]


def _egress_to_the_internet(docs: list[Doc]) -> None:
    obj(docs, "NetworkPolicy", "session")["spec"]["egress"].append(
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    )


def _no_dns(docs: list[Doc]) -> None:
    docs.remove(obj(docs, "NetworkPolicy", "dns-egress"))


def _metrics_on_loopback(docs: list[Doc]) -> None:
    set_arg(container(docs), "--metrics-host", "127.0.0.1")


def _worker_on_loopback(docs: list[Doc]) -> None:
    set_arg(container(docs, "StatefulSet", "worker"), "--listen", "127.0.0.1:50052")


def _no_pre_stop(docs: list[Doc]) -> None:
    del container(docs)["lifecycle"]


def _short_grace(docs: list[Doc]) -> None:
    pod(docs)["terminationGracePeriodSeconds"] = 20


def _long_drain(docs: list[Doc]) -> None:
    set_arg(container(docs, "StatefulSet", "worker"), "--drain-grace-s", "60")


def _no_worker_id(docs: list[Doc]) -> None:
    drop_arg(container(docs, "StatefulSet", "worker"), "--worker-id")


def _static_workers(docs: list[Doc]) -> None:
    set_arg(container(docs), "--workers", "worker-0.duplex-worker:50052")


def _insecure(docs: list[Doc]) -> None:
    container(docs, "StatefulSet", "worker")["args"].append("--insecure")


def _key_not_from_a_secret(docs: list[Doc]) -> None:
    set_arg(container(docs), "--tls-key", "/etc/duplex/keys/tls.key")


def _flag_typo(docs: list[Doc]) -> None:
    c = container(docs)
    c["args"][c["args"].index("--drain-grace-s")] = "--drian-grace-s"


def _flag_abbreviated(docs: list[Doc]) -> None:
    c = container(docs)
    c["args"][c["args"].index("--drain-grace-s")] = "--drain-grace"


def _worker_flag_typo(docs: list[Doc]) -> None:
    c = container(docs, "StatefulSet", "worker")
    c["args"][c["args"].index("--takeover-identities")] = "--takeover-identity"


def _subcommand_twice(docs: list[Doc]) -> None:
    container(docs)["args"].insert(0, "session")


def _replicas_and_hpa(docs: list[Doc]) -> None:
    obj(docs, "Deployment", "session")["spec"]["replicas"] = 3


def _no_hpa(docs: list[Doc]) -> None:
    docs.remove(obj(docs, "HorizontalPodAutoscaler", "session"))


def _gpu_on_cpu(docs: list[Doc]) -> None:
    set_arg(container(docs, "StatefulSet", "worker"), "--device", "cpu")


def _threads_for_the_node(docs: list[Doc]) -> None:
    drop_arg(container(docs, "StatefulSet", "worker"), "--torch-threads")


def _no_gpu_toleration(docs: list[Doc]) -> None:
    del pod(docs, "StatefulSet", "worker")["tolerations"]


def _scrape_port(docs: list[Doc]) -> None:
    obj(docs, "StatefulSet", "worker")["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"
    ] = "9101"


def _pod_monitor_port(docs: list[Doc]) -> None:
    obj(docs, "PodMonitor", "duplex")["spec"]["podMetricsEndpoints"][0]["port"] = "metric"


def _rule_drift(docs: list[Doc]) -> None:
    obj(docs, "PrometheusRule", "duplex")["spec"]["groups"][0]["rules"][0]["expr"] = "vector(1)"


def _secret_not_issued(docs: list[Doc]) -> None:
    docs.remove(obj(docs, "Certificate", "duplex-worker-tls"))


def _headless_publishes_unready(docs: list[Doc]) -> None:
    obj(docs, "Service", "duplex-worker")["spec"]["publishNotReadyAddresses"] = True


def _not_restricted(docs: list[Doc]) -> None:
    del obj(docs, "Namespace", "duplex")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]


def _service_target_typo(docs: list[Doc]) -> None:
    obj(docs, "Service", "duplex-session")["spec"]["ports"][0]["targetPort"] = "grcp"


def _edge(docs: list[Doc]) -> Doc:
    return container(docs, "Deployment", "realtime")


def _edge_on_the_session_image(docs: list[Doc]) -> None:
    _edge(docs)["image"] = container(docs)["image"]


def _edge_command(docs: list[Doc]) -> None:
    _edge(docs)["command"] = ["duplex", "realtime"]


def _media_policy_range(docs: list[Doc]) -> None:
    obj(docs, "NetworkPolicy", "realtime-media")["spec"]["ingress"][0]["ports"][0]["port"] = 40001


def _no_media_policy(docs: list[Doc]) -> None:
    docs.remove(obj(docs, "NetworkPolicy", "realtime-media"))


def _media_range_to_the_session(docs: list[Doc]) -> None:
    obj(docs, "NetworkPolicy", "realtime-media")["spec"]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"
    ] = "session"


def _more_calls_than_ports(docs: list[Doc]) -> None:
    set_arg(_edge(docs), "--max-calls", "100")


def _one_public_address(docs: list[Doc]) -> None:
    _edge(docs)["args"] += ["--webrtc-public-address", "203.0.113.7"]


def _address_not_the_pods(docs: list[Doc]) -> None:
    _edge(docs)["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] = "status.hostIP"


def _no_client_secret_keys(docs: list[Doc]) -> None:
    drop_arg(_edge(docs), "--client-secret-keys")


def _media_ports_typo(docs: list[Doc]) -> None:
    set_arg(_edge(docs), "--webrtc-ports", "40000:40063")


# (test id, overlay, mutation, a substring of the problem the check must report)
MUTATIONS: list[tuple[str, str, Mutation, str]] = [
    (
        "liveness-service-typo",
        "gpu-full",
        _liveness_typo,
        "livenessProbe asks for service 'duplex.v1.Livenes'",
    ),
    ("liveness-on-readiness", "gpu-full", _liveness_on_readiness, "livenessProbe asks for service ''"),
    ("readiness-on-liveness", "gpu-full", _readiness_on_liveness, "readinessProbe asks for service"),
    (
        "session-startup-waits-for-workers",
        "cpu",
        _session_startup_on_workers,
        "startupProbe asks for service ''",
    ),
    ("probe-port-typo", "gpu", _probe_port_typo, "readinessProbe port 50026 is not the health port 50062"),
    ("no-startup-probe", "cpu", _no_startup_probe, "no gRPC startupProbe"),
    ("writable-root", "gpu-full", _writable_root, "readOnlyRootFilesystem is not true"),
    ("privilege-escalation", "cpu", _escalation, "allowPrivilegeEscalation is not false"),
    ("capabilities-kept", "gpu", _capabilities, "capabilities.drop is not [ALL]"),
    ("may-run-as-root", "gpu", _root, "runAsNonRoot is not true"),
    ("no-seccomp", "cpu", _no_seccomp, "seccompProfile is not RuntimeDefault"),
    ("token-mounted", "gpu", _token, "automountServiceAccountToken is not false"),
    ("service-account-token", "cpu", _sa_token, "ServiceAccount/duplex-worker: automountServiceAccountToken"),
    ("host-network", "gpu", _host_network, "hostNetwork is set"),
    ("unbounded-tmp", "cpu", _unbounded_tmp, "emptyDir volume 'tmp' has no sizeLimit"),
    ("no-memory-limit", "gpu", _no_memory_limit, "no memory limit"),
    ("image-latest", "gpu", _latest, "is not pinned by digest"),
    ("image-latest-with-digest", "cpu", _latest_with_digest, "names :latest"),
    ("no-default-deny", "gpu", _no_default_deny, "no default-deny NetworkPolicy"),
    ("ingress-from-anywhere", "cpu", _ingress_from_anywhere, "no from: open to every source"),
    ("every-namespace", "gpu-full", _every_namespace, "is open to every namespace"),
    ("every-namespace-by-expression", "gpu", _every_namespace_by_expression, "is open to every namespace"),
    ("policy-port-typo", "gpu", _policy_port_typo, "flow pods:session -> worker:50052/TCP is not allowed"),
    ("egress-anywhere", "cpu", _egress_anywhere, "no to: open to every source"),
    ("egress-to-the-internet", "gpu", _egress_to_the_internet, "ipBlock 0.0.0.0/0 is open to every address"),
    ("no-dns", "gpu", _no_dns, "flow session -> kube-dns:53/UDP is not allowed"),
    ("metrics-on-loopback", "gpu-full", _metrics_on_loopback, "/metrics binds 127.0.0.1"),
    ("worker-on-loopback", "cpu", _worker_on_loopback, "/metrics binds 127.0.0.1"),
    ("no-pre-stop", "gpu", _no_pre_stop, "no preStop pause"),
    ("grace-shorter-than-drain", "gpu", _short_grace, "terminationGracePeriodSeconds 20 <"),
    ("drain-longer-than-grace", "cpu", _long_drain, "terminationGracePeriodSeconds 45 <"),
    ("no-worker-id", "gpu", _no_worker_id, "--worker-id is ''"),
    ("static-worker-list", "gpu", _static_workers, "--workers is 'worker-0.duplex-worker:50052'"),
    ("insecure", "cpu", _insecure, "runs with --insecure"),
    ("key-not-from-a-secret", "gpu", _key_not_from_a_secret, "--tls-key /etc/duplex/keys/tls.key is not on"),
    ("session-flag-typo", "gpu", _flag_typo, "duplex session refuses its args"),
    ("session-flag-abbreviated", "cpu", _flag_abbreviated, "duplex session has no option --drain-grace "),
    ("worker-flag-typo", "cpu", _worker_flag_typo, "duplex worker refuses its args"),
    ("subcommand-twice", "cpu", _subcommand_twice, "args start with 'session'"),
    ("replicas-fight-the-autoscaler", "gpu", _replicas_and_hpa, "sets spec.replicas"),
    ("no-autoscaler", "cpu", _no_hpa, "no HorizontalPodAutoscaler"),
    ("gpu-on-cpu", "gpu", _gpu_on_cpu, "takes a GPU but runs --device cpu"),
    ("no-gpu-toleration", "gpu", _no_gpu_toleration, "does not tolerate the nvidia.com/gpu taint"),
    ("torch-threads-per-node-core", "cpu", _threads_for_the_node, "--torch-threads 0 does not fit"),
    ("scrape-annotation-port", "cpu", _scrape_port, "prometheus.io/port '9101' is not the metrics port 9102"),
    ("pod-monitor-port", "gpu-full", _pod_monitor_port, "port 'metric' is not a port of"),
    ("prometheus-rule-drift", "gpu-full", _rule_drift, "differ from deploy/prometheus/alerts.yaml"),
    (
        "secret-not-issued",
        "gpu-full",
        _secret_not_issued,
        "reads Secret duplex-worker-tls, which no Certificate",
    ),
    ("dns-publishes-unready-workers", "cpu", _headless_publishes_unready, "publishes not-ready workers"),
    ("namespace-not-restricted", "gpu", _not_restricted, "restricted Pod Security Standard"),
    ("service-target-typo", "cpu", _service_target_typo, "targets 'grcp'"),
    ("edge-on-the-session-image", "cpu", _edge_on_the_session_image, "is not the realtime image"),
    ("edge-command", "gpu", _edge_command, "overrides the image's entry point"),
    ("media-policy-range", "gpu-full", _media_policy_range, "UDP 40001-40063 is not"),
    ("no-media-policy", "gpu-full", _no_media_policy, "no NetworkPolicy lets UDP 40000-40063"),
    (
        "media-range-to-the-session",
        "gpu-full",
        _media_range_to_the_session,
        "to pods other than the Realtime",
    ),
    ("more-calls-than-ports", "gpu-full", _more_calls_than_ports, "--max-calls 100 exceeds the 64 media"),
    ("one-public-address", "gpu-full", _one_public_address, "one address for every replica"),
    ("address-not-the-pods", "gpu-full", _address_not_the_pods, "--webrtc-address is not the pod's IP"),
    ("no-client-secret-keys", "gpu-full", _no_client_secret_keys, "no --client-secret-keys"),
    ("media-ports-typo", "gpu-full", _media_ports_typo, "is not LOW-HIGH"),
]


@pytest.mark.parametrize(
    ("overlay", "mutation", "expected"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS]
)
def test_the_check_fails_on_a_broken_object(
    rendered: dict[str, list[Doc]], overlay: str, mutation: Mutation, expected: str
) -> None:
    docs = copy.deepcopy(rendered[overlay])
    assert check.object_problems(docs) == []
    mutation(docs)
    problems = check.object_problems(docs)
    assert any(expected in p for p in problems), problems


def test_a_cpu_worker_asking_for_cuda_fails(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["cpu"])
    set_arg(container(docs, "StatefulSet", "worker"), "--device", "cuda")
    assert any("runs --device cuda without an nvidia.com/gpu limit" in p for p in check.object_problems(docs))


def test_the_schema_check_fails_on_a_misspelt_field(rendered: dict[str, list[Doc]]) -> None:
    for version in check.K8S_VERSIONS:
        docs = copy.deepcopy(rendered["gpu"])
        c = container(docs)
        c["livenesProbe"] = c.pop("livenessProbe")  # a probe typo the API server would reject
        problems = check.schema_problems(docs, [version])
        assert any("'livenesProbe' was unexpected" in p for p in problems), problems
        # ... and the object check misses the probe on its own account.
        assert any("no gRPC livenessProbe" in p for p in check.object_problems(docs))
        docs = copy.deepcopy(rendered["cpu"])
        c = container(docs, "StatefulSet", "worker")
        c["ports"][0]["containerPortt"] = c["ports"][0].pop("containerPort")
        problems = check.schema_problems(docs, [version])
        assert any("'containerPort' is a required property" in p for p in problems), problems


def test_custom_resources_are_shape_checked_and_unknown_kinds_fail(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["gpu-full"])
    del obj(docs, "PodMonitor", "duplex")["spec"]["selector"]
    obj(docs, "Issuer", "duplex-tier-ca")["spec"]["selfSigned"] = {}  # two issuer types
    obj(docs, "Certificate", "duplex-session-tls")["apiVersion"] = "cert-manager.io/v1alpha2"
    docs.append({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}})
    problems = check.schema_problems(docs)
    for expected in (
        "PodMonitor/duplex: spec.selector missing",
        "Issuer/duplex-tier-ca: needs exactly one of",
        "Certificate/duplex-session-tls: apiVersion 'cert-manager.io/v1alpha2'",
        "Widget/w: Kubernetes 1.30 has no example.com/v1 Widget",
    ):
        assert any(expected in p for p in problems), (expected, problems)


def test_make_deploy_check_exits_non_zero_on_a_broken_tree(tmp_path: Path) -> None:
    """The command CI runs, on a copy of deploy/ whose base has a liveness probe typo."""
    if shutil.which("kubectl") is None or shutil.which("promtool") is None:
        pytest.skip("kubectl and promtool are needed")
    assert check.main([]) == 0
    tree = tmp_path / "deploy"
    shutil.copytree(check.DEPLOY, tree, ignore=shutil.ignore_patterns("__pycache__"))
    session = tree / "base" / "session.yaml"
    text = session.read_text()
    assert text.count("service: duplex.v1.Liveness}") == 2
    session.write_text(text.replace("service: duplex.v1.Liveness}", "service: duplex.v1.liveness}", 2))
    assert check.main([str(tree / "overlays" / "cpu")]) == 1


# -- images ---------------------------------------------------------------------------------------


def _containerfile(name: str) -> str:
    return (check.IMAGES / name).read_text()


def _problems(name: str, text: str) -> list[str]:
    return check.containerfile_problems(name, text, PYPROJECT, SUBCOMMANDS, {10001})


def test_the_images_keep_their_promises() -> None:
    assert sorted(p.name for p in check.IMAGES.glob("*.Containerfile")) == [
        "realtime.Containerfile",
        "session.Containerfile",
        "worker-cpu.Containerfile",
        "worker-cuda.Containerfile",
    ]
    assert check.image_problems({10001}) == []


def test_the_session_image_installs_no_torch() -> None:
    """What pip installs in the session image, derived from its commands and pyproject's
    dependencies: the base install, no torch; the worker images' sets hold torch."""
    stages = check.parse_containerfile(_containerfile("session.Containerfile"))
    targets = [t for s in stages for c in check.pip_calls(s) for t in c.targets]
    installed = check.install_set(targets, PYPROJECT)
    assert "duplex-serving" in installed and "grpcio" in installed
    assert not installed & {"torch", "silero-vad"}
    assert "aiortc" not in check.install_set(
        [t for c in check.pip_calls(stages[-1]) for t in c.targets], PYPROJECT
    )
    for name in ("worker-cpu.Containerfile", "worker-cuda.Containerfile"):
        final = check.parse_containerfile(_containerfile(name))[-1]
        targets = [t for c in check.pip_calls(final) for t in c.targets]
        assert {"torch", "silero-vad"} <= check.install_set(targets, PYPROJECT)
    # The edge's image: the session image's install with the webrtc extra, no torch either.
    final = check.parse_containerfile(_containerfile("realtime.Containerfile"))[-1]
    installed = check.install_set([t for c in check.pip_calls(final) for t in c.targets], PYPROJECT)
    assert {"duplex-serving", "aiortc", "aiohttp"} <= installed and not installed & {"torch", "silero-vad"}


def test_each_image_runs_a_duplex_subcommand_as_a_non_root_user() -> None:
    for name, sub in (
        ("session", "session"),
        ("realtime", "realtime"),
        ("worker-cpu", "worker"),
        ("worker-cuda", "worker"),
    ):
        final = check.parse_containerfile(_containerfile(f"{name}.Containerfile"))[-1]
        entry = [i.value for i in final.instructions if i.keyword == "ENTRYPOINT"][-1]
        assert yaml.safe_load(entry) == ["duplex", sub] and sub in SUBCOMMANDS
        assert [i.value for i in final.instructions if i.keyword == "USER"][-1] == "10001:10001"


IMAGE_MUTATIONS = [
    (
        "session-with-the-worker-extra",
        "session",
        ("duplex-serving \\\n", '"duplex-serving[worker]" \\\n'),
        "installs ['silero-vad', 'torch']",
    ),
    (
        "session-adds-torch",
        "session",
        ("duplex-serving \\\n", "duplex-serving torch \\\n"),
        "installs ['torch']",
    ),
    ("root-user", "session", ("USER 10001:10001", "USER root"), "runs as root"),
    ("no-user", "worker-cpu", ("USER 10001:10001\n", ""), "runs as root"),
    ("other-uid", "worker-cuda", ("USER 10001:10001", "USER 1000:1000"), "is not the pods' runAsUser"),
    (
        "unknown-subcommand",
        "session",
        ('["duplex", "session"]', '["duplex", "serve"]'),
        "'serve' is not one of duplex's",
    ),
    (
        "wrong-subcommand",
        "worker-cpu",
        ('["duplex", "worker"]', '["duplex", "session"]'),
        "expected duplex worker",
    ),
    ("shell-entrypoint", "session", ('["duplex", "session"]', "duplex session"), "not the exec form"),
    (
        "compiler-in-final",
        "worker-cuda",
        ("python3.12 python3.12-venv \\", "python3.12 python3.12-venv gcc \\"),
        "installs build tools ['gcc']",
    ),
    (
        "final-from-builder",
        "session",
        ("FROM ${PYTHON_IMAGE}\nENV", "FROM builder\nENV"),
        "starts from the builder stage",
    ),
    (
        "final-reaches-an-index",
        "worker-cpu",
        ("install --no-index --find-links", "install --find-links"),
        "reaches an index",
    ),
    (
        "cuda-pairing",
        "worker-cuda",
        ("12.8.1-base", "12.6.3-base"),
        "'cu128' does not match the image's CUDA 12.6",
    ),
    (
        "cpu-torch-unpinned",
        "worker-cpu",
        ('"torch==${TORCH_VERSION}+cpu"\n', '"torch"\n'),
        "torch is not pinned",
    ),
    ("single-stage", "session", ("FROM ${PYTHON_IMAGE}\nENV", "ENV"), "not multi-stage"),
    (
        "realtime-without-webrtc",
        "realtime",
        ("'duplex-serving[webrtc]'", "duplex-serving"),
        "does not install aiortc",
    ),
    (
        "realtime-with-torch",
        "realtime",
        ("'duplex-serving[webrtc]'", "'duplex-serving[webrtc,worker]'"),
        "the realtime image installs ['silero-vad', 'torch']",
    ),
]


@pytest.mark.parametrize(
    ("image", "edit", "expected"), [m[1:] for m in IMAGE_MUTATIONS], ids=[m[0] for m in IMAGE_MUTATIONS]
)
def test_the_image_check_fails_on_a_broken_containerfile(
    image: str, edit: tuple[str, str], expected: str
) -> None:
    name = f"{image}.Containerfile"
    text = _containerfile(name)
    assert _problems(name, text) == []
    old, new = edit
    assert old in text, old
    problems = _problems(name, text.replace(old, new))
    assert any(expected in p for p in problems), problems


def test_the_session_and_realtime_images_share_their_builder(tmp_path: Path) -> None:
    session, realtime = (check.IMAGES / f"{n}.Containerfile" for n in ("session", "realtime"))
    assert check.same_builder_problems(session, realtime) == []
    drifted = tmp_path / "realtime.Containerfile"
    drifted.write_text(realtime.read_text().replace("'.[webrtc]'", "'.[webrtc,dev]'"))
    assert "builder stages differ" in check.same_builder_problems(session, drifted)[0]


# -- Prometheus -----------------------------------------------------------------------------------


def test_alert_rules_pass_promtool_and_the_scrape_config_relabels() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    assert check.prometheus_problems() == []


def test_the_scrape_check_fails_on_a_broken_relabelling() -> None:
    config = yaml.safe_load((check.PROMETHEUS / "scrape.yaml").read_text())
    assert check.scrape_problems(config) == []
    broken = copy.deepcopy(config)
    broken["scrape_configs"][0]["relabel_configs"][0]["regex"] = "yes"  # keeps nothing
    assert any("is dropped" in p for p in check.scrape_problems(broken))
    broken = copy.deepcopy(config)
    relabels = broken["scrape_configs"][0]["relabel_configs"]
    relabels.remove(next(r for r in relabels if r.get("target_label") == "tier"))  # the alerts need it
    assert any("'tier': None" in p for p in check.scrape_problems(broken))
