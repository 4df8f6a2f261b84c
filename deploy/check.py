"""``make deploy-check``: everything deploy/ promises, checked offline.

For every overlay under deploy/overlays/ (or the ones named): render it with kustomize, validate
each object strictly against the Kubernetes schemas of 1.30 and 1.32 (``kubernetes-validate``;
custom resources, which it has no schema for, are named in ``CUSTOM_RESOURCES`` and given a shape
check of their own, and any other kind it cannot find fails), then check the settings the
deployment relies on over the parsed objects (``object_problems``), for each tier (``TIERS``: the
session tier, the workers and the Realtime edge): the restricted security context, no
service-account token, bounded scratch space, resources, digest-pinned images, the three probes
(gRPC with liveness on its own health service; the edge's HTTP /healthz and /readyz), a preStop
and a grace period longer than the drain, metrics on every interface, the worker discovery flags,
the edge's session service, files from Secrets, the arguments as the real ``duplex`` parsers read
them, and the network policies (a default deny, then exactly the flows the tiers need, none open
to every namespace). Then the images (``image_problems``:
the Containerfiles, parsed) and Prometheus (``prometheus_problems``: ``promtool check rules`` and
``promtool test rules``, the scrape config's relabelling, the PrometheusRule copy of the rules).

Run as ``python -m deploy.check [OVERLAY ...] [--release]`` from the repository root; it prints
each problem and exits 1 when there is any. ``--release`` also refuses the placeholder images the
repository's overlays carry: run it on the overlay you deploy. ``tests/test_deploy.py`` runs the
same checks under ``make test`` and proves they fail on broken objects.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = DEPLOY / "overlays"
IMAGES = DEPLOY / "images"
PROMETHEUS = DEPLOY / "prometheus"
COMPONENTS = DEPLOY / "components"
K8S_VERSIONS = ("1.30", "1.32")

Doc = dict[str, Any]

#: The health service name liveness probes must ask for (duplex.serving.LIVENESS_SERVICE; read
#: from there in ``_liveness_service``, this is only the fallback when grpc is not installed).
LIVENESS_FALLBACK = "duplex.v1.Liveness"

#: The tiers: app.kubernetes.io/component of each workload's pods. The session tier and the workers
#: must be there; the Realtime edge (``duplex realtime``) is checked when it is.
TIERS = ("session", "worker", "realtime")
REQUIRED_TIERS = ("session", "worker")
#: The tiers that serve gRPC with a plaintext health port (``--health-listen``) for gRPC probes.
GRPC_TIERS = ("session", "worker")
#: The tiers an autoscaler owns the replica count of.
AUTOSCALED_TIERS = ("session", "realtime")
#: Each tier's image (the logical names the base uses, the repositories the overlays pin): the
#: edge's is the realtime image (the session image with the webrtc extra), entry point
#: ``duplex realtime``.
TIER_IMAGES = {"session": "session", "realtime": "realtime"}
#: The edge's probes: plain GETs on its WebSocket port (HTTPS when it serves wss).
REALTIME_PROBES = {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
#: The edge's WebSocket container port name (the Service's target, the policies' port).
REALTIME_PORT = "websocket"

#: What each tier's startup probe asks for. The session tier: liveness (whether the process
#: serves), never the overall status, which waits for a worker: a rollout during a worker outage
#: would restart every new replica. The worker: the overall status (the model is loaded), so a
#: load that hangs is restarted.
STARTUP_SERVICE = {"session": "liveness", "worker": ""}

#: Seconds each tier needs after its drain (``--drain-grace-s``) before it exits: the session
#: server's stop grace (2 s); the worker's (1 s) and its engine thread's join (up to 10 s); the
#: edge's close handshakes with the clients still connected (websockets' close timeout, 10 s) and
#: its streams to the session service (2 s).
STOP_AFTER_DRAIN_S = {"session": 2.0, "worker": 11.0, "realtime": 12.0}
#: The drain grace when the flag is absent (the CLIs' defaults).
DEFAULT_DRAIN_S = {"session": 10.0, "worker": 5.0, "realtime": 10.0}
#: terminationGracePeriodSeconds must exceed preStop + drain + stop by at least this.
GRACE_MARGIN_S = 5.0

#: Kinds kubernetes-validate has no schema for: (apiVersion, spec keys that must be there).
#: Anything else it cannot find a schema for is a problem, never skipped silently.
CUSTOM_RESOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "PodMonitor": ("monitoring.coreos.com/v1", ("selector", "podMetricsEndpoints")),
    "ServiceMonitor": ("monitoring.coreos.com/v1", ("selector", "endpoints")),
    "PrometheusRule": ("monitoring.coreos.com/v1", ("groups",)),
    "Certificate": ("cert-manager.io/v1", ("secretName", "issuerRef")),
    "Issuer": ("cert-manager.io/v1", ()),
    "ClusterIssuer": ("cert-manager.io/v1", ()),
}
ISSUER_TYPES = ("selfSigned", "ca", "acme", "vault", "venafi")

#: An image pinned by digest: [registry/]repository[:tag]@sha256:<64 hex>.
IMAGE_RE = re.compile(
    r"^(?P<name>[a-z0-9]+(?:[._\-/:][a-z0-9]+)*?)(?::(?P<tag>[\w][\w.\-]{0,127}))?@sha256:[0-9a-f]{64}$"
)
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
PLACEHOLDER_REGISTRY = "registry.example.com/"

#: Packages the session image must never install.
TORCH_PACKAGES = ("torch", "silero-vad", "torchaudio", "triton")

ANY_ADDRESS = ("0.0.0.0", "::", "[::]")


class CheckError(Exception):
    """A tool the check needs is missing or failed outright."""


# -- rendering --------------------------------------------------------------------------------


def overlay_dirs() -> list[Path]:
    """Every overlay: the folders under deploy/overlays/ with a kustomization.yaml."""
    return sorted(p.parent for p in OVERLAYS.glob("*/kustomization.yaml"))


def render(path: Path) -> list[Doc]:
    """``kubectl kustomize PATH``, parsed."""
    if shutil.which("kubectl") is None:
        raise CheckError("kubectl (with kustomize) is not installed")
    proc = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise CheckError(f"kubectl kustomize {path} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def where(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# -- schema -----------------------------------------------------------------------------------


def schema_problems(docs: Iterable[Doc], versions: Iterable[str] = K8S_VERSIONS) -> list[str]:
    """Each object validated strictly (unknown fields are errors) for each Kubernetes version;
    the custom resources of ``CUSTOM_RESOURCES`` get a shape check instead."""
    import kubernetes_validate  # type: ignore[import-untyped]

    problems: list[str] = []
    for doc in docs:
        kind = doc.get("kind", "")
        if kind in CUSTOM_RESOURCES:
            problems += custom_resource_problems(doc)
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = "/".join(str(p) for p in err.path)
                problems.append(f"{where(doc)}: not valid for Kubernetes {version} at {path}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(
                    f"{where(doc)}: Kubernetes {version} has no {doc.get('apiVersion')} {kind}, and it "
                    "is not a custom resource deploy/check.py knows"
                )
    return problems


def custom_resource_problems(doc: Doc) -> list[str]:
    """The basic shape of a custom resource (its CRD may not exist where the check runs)."""
    kind = doc["kind"]
    api, required = CUSTOM_RESOURCES[kind]
    problems = []
    if doc.get("apiVersion") != api:
        problems.append(f"{where(doc)}: apiVersion {doc.get('apiVersion')!r}, expected {api}")
    extra = set(doc) - {"apiVersion", "kind", "metadata", "spec"}
    if extra:
        problems.append(f"{where(doc)}: unexpected top-level fields {sorted(extra)}")
    if not isinstance(doc.get("metadata", {}).get("name"), str):
        problems.append(f"{where(doc)}: no metadata.name")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return [*problems, f"{where(doc)}: no spec"]
    problems += [f"{where(doc)}: spec.{key} missing" for key in required if key not in spec]
    if kind in ("Issuer", "ClusterIssuer") and sum(t in spec for t in ISSUER_TYPES) != 1:
        problems.append(f"{where(doc)}: needs exactly one of {', '.join(ISSUER_TYPES)}")
    if kind == "Certificate":
        if not (spec.get("dnsNames") or spec.get("commonName") or spec.get("uris")):
            problems.append(f"{where(doc)}: names nothing (dnsNames, commonName or uris)")
        if not isinstance(spec.get("issuerRef"), dict) or not spec["issuerRef"].get("name"):
            problems.append(f"{where(doc)}: issuerRef.name missing")
    if kind == "PodMonitor":
        for ep in spec.get("podMetricsEndpoints") or [{}]:
            if not ep.get("port"):
                problems.append(f"{where(doc)}: a podMetricsEndpoint without a port name")
    if kind == "PrometheusRule":
        for group in spec.get("groups") or []:
            for rule in group.get("rules", []):
                if not rule.get("expr") or not (rule.get("alert") or rule.get("record")):
                    problems.append(f"{where(doc)}: rule {rule} needs expr and alert or record")
    return problems


# -- the objects ------------------------------------------------------------------------------


def _liveness_service() -> str:
    try:
        from duplex.serving import LIVENESS_SERVICE
    except ImportError:  # pragma: no cover - the dev install has grpc
        return LIVENESS_FALLBACK
    return str(LIVENESS_SERVICE)


def args_map(container: Doc) -> dict[str, str]:
    """``--flag value`` pairs of a container's args (flags without a value map to "")."""
    args = [str(a) for a in container.get("args", [])]
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            key, _, value = arg.partition("=")
            out[key] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
        else:
            out[arg] = ""
    return out


def _host_port(value: str) -> tuple[str, int | None]:
    host, _, port = value.rpartition(":")
    return host.strip("[]") if host != "[::]" else "::", int(port) if port.isdigit() else None


def _selects(selector: Doc | None, labels: Doc) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) matches ``labels``. An empty
    selector matches everything; None matches nothing."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels.get(key) in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def _narrow(selector: Doc) -> bool:
    """Whether a selector names what it selects: matchLabels, or an In expression. ``{}``, or only
    Exists / NotIn / DoesNotExist expressions, select (nearly) everything."""
    if selector.get("matchLabels"):
        return True
    return any(e.get("operator") == "In" for e in selector.get("matchExpressions") or [])


@dataclass
class Workload:
    doc: Doc
    tier: str

    @property
    def pod(self) -> Doc:
        spec: Doc = self.doc["spec"]["template"]["spec"]
        return spec

    @property
    def labels(self) -> Doc:
        labels: Doc = self.doc["spec"]["template"].get("metadata", {}).get("labels", {})
        return labels

    @property
    def annotations(self) -> Doc:
        ann: Doc = self.doc["spec"]["template"].get("metadata", {}).get("annotations", {}) or {}
        return ann

    @property
    def containers(self) -> list[Doc]:
        return list(self.pod.get("containers", [])) + list(self.pod.get("initContainers", []))

    @property
    def main(self) -> Doc:
        container: Doc = self.pod["containers"][0]
        return container

    def port(self, name: str) -> int | None:
        for c in self.pod.get("containers", []):
            for p in c.get("ports", []):
                if p.get("name") == name:
                    return int(p["containerPort"])
        return None


WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod")


def workloads(docs: Iterable[Doc]) -> list[Workload]:
    """The Deployments and StatefulSets, by tier (app.kubernetes.io/component of the pods)."""
    out = []
    for doc in docs:
        if doc.get("kind") in ("Deployment", "StatefulSet"):
            labels = doc["spec"]["template"].get("metadata", {}).get("labels", {})
            out.append(Workload(doc, labels.get("app.kubernetes.io/component", "unknown")))
    return out


@dataclass
class Context:
    docs: list[Doc]
    release: bool = False
    problems: list[str] = field(default_factory=list)

    def of(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d.get("kind") == kind]

    def named(self, kind: str, name: str) -> Doc | None:
        return next((d for d in self.of(kind) if d["metadata"].get("name") == name), None)

    def add(self, doc: Doc | Workload, message: str) -> None:
        d = doc.doc if isinstance(doc, Workload) else doc
        self.problems.append(f"{where(d)}: {message}")


def object_problems(docs: list[Doc], *, release: bool = False) -> list[str]:
    """Every setting the deployment relies on, checked over one rendered overlay."""
    ctx = Context(docs, release=release)
    loads = workloads(docs)
    for doc in docs:
        if doc.get("kind") in WORKLOAD_KINDS and doc.get("kind") not in ("Deployment", "StatefulSet"):
            ctx.add(doc, "a kind of workload this deployment does not have (unchecked)")
    tiers = [w.tier for w in loads]
    if not set(REQUIRED_TIERS) <= set(tiers):
        ctx.problems.append(f"expected a session and a worker workload, found tiers {sorted(set(tiers))}")
    for tier in sorted({t for t in tiers if tiers.count(t) > 1}):
        ctx.problems.append(f"more than one workload of tier {tier}")
    for w in loads:
        if w.tier not in TIERS:
            ctx.add(
                w,
                f"a workload of no known tier (app.kubernetes.io/component {w.tier!r}, not one of "
                f"{', '.join(TIERS)})",
            )
            continue
        _check_pod(ctx, w)
        for c in w.containers:
            _check_container(ctx, w, c)
        _check_main_container(ctx, w, loads)
    _check_namespace(ctx)
    _check_services(ctx, loads)
    _check_scaling(ctx, loads)
    _check_policies(ctx, loads)
    _check_custom_resources(ctx, loads)
    return ctx.problems


def _check_namespace(ctx: Context) -> None:
    namespaces = ctx.of("Namespace")
    if len(namespaces) != 1:
        ctx.problems.append(f"expected one Namespace, found {len(namespaces)}")
        return
    ns = namespaces[0]
    if ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted":
        ctx.add(ns, "does not enforce the restricted Pod Security Standard")
    name = ns["metadata"]["name"]
    for doc in ctx.docs:
        if doc is not ns and doc["metadata"].get("namespace") not in (name, None):
            ctx.add(doc, f"in namespace {doc['metadata'].get('namespace')}, not {name}")


def _check_pod(ctx: Context, w: Workload) -> None:
    pod = w.pod
    if pod.get("automountServiceAccountToken") is not False:
        ctx.add(w, "automountServiceAccountToken is not false: the pod would get an API token")
    sa_name = pod.get("serviceAccountName")
    sa = ctx.named("ServiceAccount", sa_name) if sa_name else None
    if sa is None:
        ctx.add(w, f"serviceAccountName {sa_name!r} is not a ServiceAccount of the deployment")
    elif sa.get("automountServiceAccountToken") is not False:
        ctx.add(sa, "automountServiceAccountToken is not false")
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            ctx.add(w, f"{host} is set")
    sc = pod.get("securityContext") or {}
    if sc.get("runAsNonRoot") is not True:
        ctx.add(w, "pod securityContext.runAsNonRoot is not true")
    if sc.get("runAsUser") in (0, None):
        ctx.add(w, "pod securityContext.runAsUser is not a non-root uid")
    if (sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        ctx.add(w, "pod securityContext.seccompProfile is not RuntimeDefault")
    for vol in pod.get("volumes", []):
        if "emptyDir" in vol and not (vol["emptyDir"] or {}).get("sizeLimit"):
            ctx.add(w, f"emptyDir volume {vol['name']!r} has no sizeLimit")
        if "hostPath" in vol:
            ctx.add(w, f"hostPath volume {vol['name']!r}")
    grace = pod.get("terminationGracePeriodSeconds")
    if not isinstance(grace, int):
        ctx.add(w, "no terminationGracePeriodSeconds")
    # Prometheus discovery by annotation: on (or switched off where a PodMonitor scrapes the
    # pods), pointing at the metrics port.
    ann = w.annotations
    metrics = w.port("metrics")
    if ann.get("prometheus.io/scrape") not in ("true", "false"):
        ctx.add(w, 'pod annotation prometheus.io/scrape is not "true" (or "false" with a PodMonitor)')
    elif ann.get("prometheus.io/scrape") == "false" and not ctx.of("PodMonitor") + ctx.of("ServiceMonitor"):
        ctx.add(w, "prometheus.io/scrape is off and no PodMonitor or ServiceMonitor scrapes the pods")
    if ann.get("prometheus.io/port") != str(metrics):
        ctx.add(w, f"prometheus.io/port {ann.get('prometheus.io/port')!r} is not the metrics port {metrics}")


def _check_container(ctx: Context, w: Workload, c: Doc) -> None:
    name = c.get("name")
    sc = c.get("securityContext") or {}
    if sc.get("allowPrivilegeEscalation") is not False:
        ctx.add(w, f"container {name}: allowPrivilegeEscalation is not false")
    if sc.get("readOnlyRootFilesystem") is not True:
        ctx.add(w, f"container {name}: readOnlyRootFilesystem is not true")
    if sc.get("privileged"):
        ctx.add(w, f"container {name}: privileged")
    caps = sc.get("capabilities") or {}
    if caps.get("drop") != ["ALL"]:
        ctx.add(w, f"container {name}: capabilities.drop is not [ALL]")
    if caps.get("add"):
        ctx.add(w, f"container {name}: adds capabilities {caps['add']}")
    if sc.get("runAsUser") == 0 or sc.get("runAsNonRoot") is False:
        ctx.add(w, f"container {name}: runs as root")
    image = str(c.get("image", ""))
    m = IMAGE_RE.match(image)
    if m is None:
        ctx.add(w, f"container {name}: image {image!r} is not pinned by digest (NAME@sha256:<64 hex>)")
    elif m.group("tag") == "latest" or image.split("@")[0].endswith(":latest"):
        ctx.add(w, f"container {name}: image {image!r} names :latest")
    elif ctx.release and (image.endswith(PLACEHOLDER_DIGEST) or image.startswith(PLACEHOLDER_REGISTRY)):
        ctx.add(w, f"container {name}: image {image!r} is the repository's placeholder")
    if c.get("imagePullPolicy") == "Always":
        ctx.add(w, f"container {name}: imagePullPolicy Always (a digest never changes)")
    res = c.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for key in ("cpu", "memory"):
        if key not in requests:
            ctx.add(w, f"container {name}: no {key} request")
    if "memory" not in limits:
        ctx.add(w, f"container {name}: no memory limit")
    gpu_req, gpu_lim = requests.get("nvidia.com/gpu"), limits.get("nvidia.com/gpu")
    if gpu_req != gpu_lim:
        ctx.add(w, f"container {name}: nvidia.com/gpu request {gpu_req} and limit {gpu_lim} differ")


def _probe_service(probe: Doc) -> str:
    return str((probe.get("grpc") or {}).get("service") or "")


def _check_main_container(ctx: Context, w: Workload, loads: list[Workload]) -> None:
    c = w.main
    a = args_map(c)
    args = [str(x) for x in c.get("args", [])]
    # The image's entry point is `duplex <tier>`: the args are that subcommand's options.
    if args and not args[0].startswith("--"):
        ctx.add(w, f"args start with {args[0]!r}: the image's entry point already names the subcommand")
    if "--insecure" in args:
        ctx.add(w, "runs with --insecure")
    if c.get("command"):
        ctx.add(w, "overrides the image's entry point (command)")
    # Ports: the flags and the declared container ports agree.
    listen_host, listen_port = _host_port(a.get("--listen", ""))
    health_host, health_port = _host_port(a.get("--health-listen", ""))
    listen_name = REALTIME_PORT if w.tier == "realtime" else "grpc"
    ports: list[tuple[str, int | None]] = [(listen_name, listen_port)]
    if w.tier in GRPC_TIERS:
        if "--health-listen" not in a:
            ctx.add(w, "no --health-listen: the probes have no plaintext health port")
        ports.append(("health", health_port))
    for port_name, value in ports:
        if value is None or w.port(port_name) != value:
            ctx.add(w, f"container port {port_name!r} ({w.port(port_name)}) is not the flag's port ({value})")
    metrics_port = int(a["--metrics-port"]) if a.get("--metrics-port", "").isdigit() else None
    if metrics_port is None or w.port("metrics") != metrics_port:
        ctx.add(w, f"container port 'metrics' ({w.port('metrics')}) is not --metrics-port ({metrics_port})")
    # Metrics on every interface, or Prometheus cannot scrape. The session tier and the edge have
    # --metrics-host (default 127.0.0.1); the worker binds /metrics on the --listen host.
    metrics_host = a.get("--metrics-host", listen_host if w.tier == "worker" else "127.0.0.1")
    if metrics_host not in ANY_ADDRESS:
        ctx.add(w, f"/metrics binds {metrics_host}, not every interface: Prometheus cannot scrape it")
    for flag, host in (("--listen", listen_host), ("--health-listen", health_host)):
        if flag in a and host not in ANY_ADDRESS:
            ctx.add(w, f"{flag} binds {host}: unreachable from other pods and the kubelet")
    if w.tier == "realtime":
        _check_http_probes(ctx, w, a, listen_port)
    else:
        _check_grpc_probes(ctx, w, health_port)
    # Stopping: a preStop, then a grace period that outlasts the drain.
    pre_stop = ((c.get("lifecycle") or {}).get("preStop")) or {}
    pre_stop_s = 0.0
    if "sleep" in pre_stop:
        pre_stop_s = float(pre_stop["sleep"].get("seconds", 0))
    elif "exec" in pre_stop:
        cmd = pre_stop["exec"].get("command", [])
        pre_stop_s = float(cmd[-1]) if cmd and str(cmd[-1]).replace(".", "", 1).isdigit() else 0.0
    if pre_stop_s <= 0:
        ctx.add(w, "no preStop pause: SIGTERM would start the drain while the endpoint still gets calls")
    try:
        drain = float(a.get("--drain-grace-s", DEFAULT_DRAIN_S[w.tier]))
    except ValueError:
        drain = DEFAULT_DRAIN_S[w.tier]
    needed = pre_stop_s + drain + STOP_AFTER_DRAIN_S[w.tier] + GRACE_MARGIN_S
    grace = w.pod.get("terminationGracePeriodSeconds")
    if isinstance(grace, int) and grace < needed:
        ctx.add(
            w,
            f"terminationGracePeriodSeconds {grace} < preStop {pre_stop_s:g} + drain {drain:g} + stop "
            f"{STOP_AFTER_DRAIN_S[w.tier]:g} + margin {GRACE_MARGIN_S:g}",
        )
    # Files the flags name come from mounted Secrets (rotated in place).
    for flag, path in a.items():
        if path.startswith("/etc/duplex/") and _flag_secret(w, path) is None:
            ctx.add(w, f"{flag} {path} is not on a mounted Secret")
    if w.tier == "session":
        _check_session_flags(ctx, w, a, loads)
    elif w.tier == "worker":
        _check_worker_flags(ctx, w, a)
    else:
        _check_realtime_flags(ctx, w, a, loads)
    _check_cli(ctx, w)


def _flag_secret(w: Workload, path: str) -> tuple[str, Doc] | None:
    """(volume name, its ``secret``) of the Secret volume a path of the main container lies on."""
    mounts = {m["name"]: m["mountPath"].rstrip("/") for m in w.main.get("volumeMounts", [])}
    secrets = {v["name"]: v["secret"] for v in w.pod.get("volumes", []) if "secret" in v}
    volume = next((n for n, m in mounts.items() if path.startswith(m + "/")), None)
    if volume is None or volume not in secrets:
        return None
    return volume, secrets[volume]


def _check_grpc_probes(ctx: Context, w: Workload, health_port: int | None) -> None:
    """All three, gRPC on the plaintext health port; liveness on its own service name."""
    c = w.main
    liveness = _liveness_service()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if not isinstance(probe, dict) or "grpc" not in probe:
            ctx.add(w, f"no gRPC {kind}")
            continue
        if probe["grpc"].get("port") != health_port:
            ctx.add(w, f"{kind} port {probe['grpc'].get('port')} is not the health port {health_port}")
    live = c.get("livenessProbe") or {}
    if "grpc" in live and _probe_service(live) != liveness:
        ctx.add(
            w,
            f"livenessProbe asks for service {_probe_service(live)!r}, not {liveness!r}: the overall "
            "status follows workers and drains, and a failing liveness probe restarts the pod",
        )
    ready = c.get("readinessProbe") or {}
    if "grpc" in ready and _probe_service(ready) != "":
        ctx.add(w, f"readinessProbe asks for service {_probe_service(ready)!r}, not the overall status")
    start = c.get("startupProbe") or {}
    want = liveness if STARTUP_SERVICE.get(w.tier) == "liveness" else ""
    if "grpc" in start and _probe_service(start) != want:
        ctx.add(w, f"startupProbe asks for service {_probe_service(start)!r}, expected {want!r}")


def _check_http_probes(ctx: Context, w: Workload, a: dict[str, str], listen_port: int | None) -> None:
    """The edge's: all three, HTTP GETs on the WebSocket port (HTTPS when it serves wss), liveness
    and startup on /healthz (the process serves), readiness on /readyz (503 while draining)."""
    scheme = "HTTPS" if "--tls-cert" in a else "HTTP"
    for kind, path in REALTIME_PROBES.items():
        probe = w.main.get(kind)
        if not isinstance(probe, dict) or "httpGet" not in probe:
            ctx.add(w, f"no HTTP {kind} ({path})")
            continue
        get = probe["httpGet"]
        port = get.get("port")
        if (w.port(port) if isinstance(port, str) else port) != listen_port:
            ctx.add(w, f"{kind} port {port!r} is not the WebSocket port {listen_port}")
        if get.get("path") != path:
            ctx.add(w, f"{kind} asks for {get.get('path')!r}, not {path}")
        if get.get("scheme", "HTTP") != scheme:
            ctx.add(w, f"{kind} scheme {get.get('scheme', 'HTTP')}, but the port serves {scheme}")


def _check_session_flags(ctx: Context, w: Workload, a: dict[str, str], loads: list[Workload]) -> None:
    for flag in ("--tls-cert", "--tls-key", "--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key"):
        if flag not in a:
            ctx.add(w, f"no {flag}")
    if not ({"--auth-tokens", "--auth-jwks", "--tls-client-ca"} & a.keys()):
        ctx.add(w, "no caller authentication (--auth-tokens, --auth-jwks or --tls-client-ca)")
    # The workers: every ready pod behind the worker StatefulSet's headless Service, by DNS.
    workers = [x for x in loads if x.tier == "worker" and x.doc["kind"] == "StatefulSet"]
    namespace = w.doc["metadata"].get("namespace", "default")
    if not workers:
        return
    sts = workers[0].doc
    svc = ctx.named("Service", sts["spec"].get("serviceName", ""))
    grpc_port = workers[0].port("grpc")
    if svc is not None:
        port = next((p["port"] for p in svc["spec"].get("ports", []) if p.get("name") == "grpc"), grpc_port)
        want = f"dns:///{svc['metadata']['name']}.{namespace}.svc.cluster.local:{port}"
        if a.get("--workers") != want:
            ctx.add(w, f"--workers is {a.get('--workers')!r}, expected the headless Service's name {want}")


def _check_worker_flags(ctx: Context, w: Workload, a: dict[str, str]) -> None:
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--takeover-identities"):
        if flag not in a:
            ctx.add(w, f"no {flag} (mutual TLS, and who may take sessions over)")
    # --worker-id is the pod's name, from the downward API.
    worker_id = a.get("--worker-id", "")
    m = re.fullmatch(r"\$\((\w+)\)", worker_id)
    env = {e["name"]: e for e in w.main.get("env", [])}
    source = env.get(m.group(1), {}).get("valueFrom", {}).get("fieldRef", {}) if m else {}
    if source.get("fieldPath") != "metadata.name":
        ctx.add(w, f"--worker-id is {worker_id!r}, not $(VAR) of an env var holding the pod's name")
    # torch's threads fit the pod's CPU (its default is one per core of the node).
    threads = a.get("--torch-threads", "0")
    cpu = _cpu((w.main.get("resources") or {}).get("requests", {}).get("cpu"))
    if not threads.isdigit() or int(threads) == 0 or (cpu is not None and int(threads) > max(1, round(cpu))):
        ctx.add(w, f"--torch-threads {threads} does not fit the CPU request {cpu}")
    # The device follows the resources: cuda with a GPU, never cuda without one.
    device = a.get("--device", "auto")
    gpu = (w.main.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
    if gpu and not device.startswith("cuda"):
        ctx.add(w, f"takes a GPU but runs --device {device}")
    if not gpu and device.startswith("cuda"):
        ctx.add(w, "runs --device cuda without an nvidia.com/gpu limit")
    if gpu:
        tolerations = w.pod.get("tolerations", [])
        if not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
            ctx.add(w, "takes a GPU but does not tolerate the nvidia.com/gpu taint")
        if not w.pod.get("nodeSelector") and not w.pod.get("affinity"):
            ctx.add(w, "takes a GPU but selects no nodes (nodeSelector or affinity)")


def _check_realtime_flags(ctx: Context, w: Workload, a: dict[str, str], loads: list[Workload]) -> None:
    """The edge: wss and bearer tokens towards its clients, checked against the session service's own
    token file (or JWKS); the session service by its Service's DNS name, over TLS; the session
    image; only the CA of the session API's certificate Secret, never its key."""
    for flag in ("--tls-cert", "--tls-key"):
        if flag not in a:
            ctx.add(w, f"no {flag}: clients would send their bearer tokens in plaintext")
    if not ({"--auth-tokens", "--auth-jwks"} & a.keys()):
        ctx.add(w, "no --auth-tokens or --auth-jwks: tokens are not checked before the WebSocket opens")
    session = next((x for x in loads if x.tier == "session"), None)
    if session is None:
        return
    sa = args_map(session.main)
    # The same token file / JWKS as the session service: from the same Secret (and key).
    for flag in ("--auth-tokens", "--auth-jwks"):
        if flag not in a:
            continue
        mine, theirs = _flag_secret(w, a[flag]), _flag_secret(session, sa.get(flag, "/-"))
        if theirs is None:
            ctx.add(w, f"{flag} is set but the session service has none")
        elif mine is not None and (
            mine[1].get("secretName") != theirs[1].get("secretName")
            or Path(a[flag]).name != Path(sa[flag]).name
        ):
            ctx.add(
                w,
                f"{flag} reads Secret {mine[1].get('secretName')} ({Path(a[flag]).name}), not the session "
                f"service's {theirs[1].get('secretName')} ({Path(sa[flag]).name})",
            )
    # The session service, by its Service's name and gRPC port.
    namespace = w.doc["metadata"].get("namespace", "default")
    services = [
        s
        for s in ctx.of("Service")
        if s["spec"].get("selector") and _selects({"matchLabels": s["spec"]["selector"]}, session.labels)
    ]
    wanted = []
    for svc in services:
        for port in svc["spec"].get("ports", []):
            if port.get("name") == "grpc":
                wanted.append(f"{svc['metadata']['name']}.{namespace}.svc.cluster.local:{port['port']}")
    if a.get("--session") not in wanted:
        ctx.add(w, f"--session is {a.get('--session')!r}, expected the session Service's name {wanted}")
    # TLS towards it, as it serves TLS.
    if "--tls-cert" in sa and "--session-ca" not in a:
        ctx.add(w, "no --session-ca: the session service serves TLS")
    # Its own image (the webrtc extra), not the session tier's.
    image = str(w.main.get("image", ""))
    if image == session.main.get("image") or _repository(image) not in ("realtime", "duplex-realtime"):
        ctx.add(w, f"image {image!r} is not the realtime image (.../realtime@sha256:...)")
    _check_webrtc(ctx, w, a)
    # Another tier's server key never lands in the edge's pod (the session API's certificate Secret
    # is mounted for its ca.crt alone).
    for flag in ("--tls-key", "--worker-tls-key"):
        found = _flag_secret(session, sa.get(flag, "/-"))
        if found is None:
            continue
        secret, key = found[1].get("secretName"), Path(sa[flag]).name
        for vol in w.pod.get("volumes", []):
            if (vol.get("secret") or {}).get("secretName") != secret:
                continue
            items = vol["secret"].get("items")
            if items is None or any(i.get("key") == key for i in items):
                ctx.add(w, f"volume {vol['name']!r} mounts {key} of Secret {secret}, the session tier's key")


def _repository(image: str) -> str:
    """The last path part of an image's repository (``reg/duplex/realtime@sha256:..`` -> realtime)."""
    return image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]


def media_range(w: Workload) -> tuple[int, int] | None:
    """The edge's ``--webrtc-ports`` (None when it has none, or it does not parse)."""
    m = re.fullmatch(r"(\d+)-(\d+)", args_map(w.main).get("--webrtc-ports", ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_webrtc(ctx: Context, w: Workload, a: dict[str, str]) -> None:
    """WebRTC's media (``--webrtc-ports``): each replica announces an address of its own, holds no
    more calls than it has ports, and shares the client secrets' keys with the others. (The
    NetworkPolicy that opens the range: ``_check_policies``.)"""
    if "--webrtc-ports" not in a:
        return
    ports = media_range(w)
    if ports is None or not 1024 <= ports[0] <= ports[1] <= 65535:
        ctx.add(w, f"--webrtc-ports {a['--webrtc-ports']!r} is not LOW-HIGH within 1024-65535")
        return
    size = ports[1] - ports[0] + 1
    max_calls = int(a["--max-calls"]) if a.get("--max-calls", "").isdigit() else 64
    if max_calls == 0 or max_calls > size:
        ctx.add(w, f"--max-calls {max_calls or 'unbounded'} exceeds the {size} media ports of --webrtc-ports")
    # The address a browser sends its media to is this replica's: the pod's own IP (downward API),
    # not one address for every replica of an autoscaled Deployment.
    if "--webrtc-public-address" in a:
        ctx.add(
            w, "--webrtc-public-address is one address for every replica: media would reach the wrong one"
        )
    env = {e["name"]: e for e in w.main.get("env", [])}
    var = re.fullmatch(r"\$\((\w+)\)", a.get("--webrtc-address", ""))
    field = ((env.get(var.group(1), {}).get("valueFrom") or {}).get("fieldRef") or {}) if var else {}
    if field.get("fieldPath") != "status.podIP":
        ctx.add(w, "--webrtc-address is not the pod's IP ($(VAR) of an env var from fieldRef status.podIP)")
    # Replicas accept each other's client secrets only with the same keys.
    if "--client-secret-keys" not in a:
        ctx.add(w, "no --client-secret-keys: a client secret minted by one replica fails on another")


def _cpu(quantity: object) -> float | None:
    """A CPU quantity ("2", 2, "500m") in cores."""
    text = str(quantity) if quantity is not None else ""
    if re.fullmatch(r"\d+m", text):
        return int(text[:-1]) / 1000
    try:
        return float(text)
    except ValueError:
        return None


def _check_cli(ctx: Context, w: Workload) -> None:
    """The args as ``duplex <tier>`` parses them: a misspelt flag fails here, not in the pod."""
    env = {e["name"]: f"<{e['name']}>" for e in w.main.get("env", [])}
    args = [
        re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(x))
        for x in w.main.get("args", [])
    ]
    parser: Any
    try:
        if w.tier == "session":
            from session_service.api import cli as session_cli

            parser = session_cli._parser()
        elif w.tier == "realtime":
            from realtime_service import cli as realtime_cli

            parser = realtime_cli.build_parser()
        else:
            from worker_service import cli as worker_cli

            parser = worker_cli.build_parser()
    except ImportError as exc:
        ctx.add(
            w,
            f"cannot parse its args with the duplex {w.tier} parser here ({exc}); "
            "install '.[worker,webrtc,dev]'",
        )
        return
    # argparse takes an unambiguous prefix for a flag: the manifests spell each one out.
    known = set(parser._option_string_actions)
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            ctx.add(w, f"duplex {w.tier} has no option {flag} (a typo, or an abbreviation)")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        message = err.getvalue().strip().splitlines()
        ctx.add(w, f"duplex {w.tier} refuses its args: {message[-1] if message else 'error'}")


def _check_services(ctx: Context, loads: list[Workload]) -> None:
    for svc in ctx.of("Service"):
        # A Service's selector is a plain map of labels (no matchLabels).
        selector = svc["spec"].get("selector") or {}
        targets = [w for w in loads if selector and _selects({"matchLabels": selector}, w.labels)]
        if not targets:
            ctx.add(svc, "selects no workload")
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port.get("port"))
            for w in targets:
                found = w.port(target) if isinstance(target, str) else target
                declared = [p.get("containerPort") for c in w.pod["containers"] for p in c.get("ports", [])]
                if found is None or found not in declared:
                    ctx.add(
                        svc,
                        f"port {port.get('name')} targets {target!r}, which {where(w.doc)} does not declare",
                    )
    for w in loads:
        if w.doc["kind"] == "StatefulSet":
            headless = ctx.named("Service", w.doc["spec"].get("serviceName", ""))
            if headless is None or headless["spec"].get("clusterIP") != "None":
                ctx.add(w, "serviceName is not a headless Service of the deployment")
            elif headless["spec"].get("publishNotReadyAddresses"):
                ctx.add(headless, "publishes not-ready workers in DNS")


def _check_scaling(ctx: Context, loads: list[Workload]) -> None:
    for w in loads:
        if not any(_selects(p["spec"].get("selector"), w.labels) for p in ctx.of("PodDisruptionBudget")):
            ctx.add(w, "no PodDisruptionBudget")
    hpas = ctx.of("HorizontalPodAutoscaler")
    for w in loads:
        if w.tier not in AUTOSCALED_TIERS:
            continue
        mine = [h for h in hpas if h["spec"]["scaleTargetRef"].get("name") == w.doc["metadata"]["name"]]
        if not mine:
            ctx.add(w, "no HorizontalPodAutoscaler")
            continue
        hpa = mine[0]
        if "replicas" in w.doc["spec"]:
            ctx.add(w, "sets spec.replicas although an autoscaler owns it (each apply would reset it)")
        if hpa["spec"]["scaleTargetRef"].get("kind") != w.doc["kind"]:
            ctx.add(hpa, f"scaleTargetRef kind is not {w.doc['kind']}")
        if hpa["spec"].get("minReplicas", 1) < 2:
            ctx.add(hpa, "minReplicas below 2: one replica's drain would leave none")
        resources = [
            m["resource"]["name"] for m in hpa["spec"].get("metrics", []) if m.get("type") == "Resource"
        ]
        if "cpu" not in resources:
            ctx.add(hpa, "does not scale on CPU")
        if "cpu" in resources and "cpu" not in (w.main.get("resources") or {}).get("requests", {}):
            ctx.add(hpa, "scales on CPU utilization but the container requests no CPU")


# -- network policies ---------------------------------------------------------------------------

#: How a policy peer is classified for the flow table.
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
KUBE_SYSTEM = {"kubernetes.io/metadata.name": "kube-system"}


def _peer_kind(ctx: Context, peer: Doc, loads: list[Workload], where_: str) -> str | None:
    """A peer as a flow endpoint: "pods:<tier>", "monitoring", "kube-dns", "backends"; None (and a
    problem) for a peer that is open to every namespace or every address."""
    if "ipBlock" in peer:
        cidr = peer["ipBlock"].get("cidr", "")
        if cidr in ("0.0.0.0/0", "::/0"):
            ctx.problems.append(f"{where_}: ipBlock {cidr} is open to every address")
            return None
        return f"ipBlock:{cidr}"
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is not None and not _narrow(ns_sel):
        ctx.problems.append(f"{where_}: namespaceSelector {ns_sel} is open to every namespace")
        return None
    if ns_sel is None:
        if pod_sel is None or not _narrow(pod_sel):
            ctx.problems.append(f"{where_}: podSelector {pod_sel} is open to every pod of the namespace")
            return None
        tiers = sorted({w.tier for w in loads if _selects(pod_sel, w.labels)})
        return "pods:" + ",".join(tiers) if tiers else "pods:none"
    labels = ns_sel.get("matchLabels", {})
    if labels == MONITORING:
        return "monitoring"
    if labels == KUBE_SYSTEM and (pod_sel or {}).get("matchLabels") == {"k8s-app": "kube-dns"}:
        return "kube-dns"
    return "backends"


def expected_flows(loads: list[Workload]) -> set[tuple[str, str, str, int, str]]:
    """(direction, tier, peer, port, protocol): exactly what the tiers need. Derived from the
    workloads' own ports, so a typo in a policy's port shows as one flow missing, one extra."""
    by_tier = {w.tier: w for w in loads}
    session, worker, realtime = by_tier.get("session"), by_tier.get("worker"), by_tier.get("realtime")
    if session is None or worker is None:
        return set()
    flows: set[tuple[str, str, str, int, str]] = set()

    def add(direction: str, tier: str, peer: str, port: int | None, proto: str = "TCP") -> None:
        if port is not None:
            flows.add((direction, tier, peer, port, proto))

    add("ingress", "session", "backends", session.port("grpc"))
    add("ingress", "session", "monitoring", session.port("metrics"))
    add("ingress", "worker", "pods:session", worker.port("grpc"))
    add("ingress", "worker", "monitoring", worker.port("metrics"))
    add("egress", "session", "pods:worker", worker.port("grpc"))
    for tier in ("session", "worker"):
        add("egress", tier, "kube-dns", 53, "UDP")
        add("egress", tier, "kube-dns", 53, "TCP")
    if realtime is not None:
        # Clients (namespaces chosen by label, as the backends are) on the WebSocket port; the edge
        # calls the session service, and resolves its Service's name.
        add("ingress", "realtime", "backends", realtime.port(REALTIME_PORT))
        add("ingress", "realtime", "monitoring", realtime.port("metrics"))
        add("ingress", "session", "pods:realtime", session.port("grpc"))
        add("egress", "realtime", "pods:session", session.port("grpc"))
        add("egress", "realtime", "kube-dns", 53, "UDP")
        add("egress", "realtime", "kube-dns", 53, "TCP")
    return flows


def _check_policies(ctx: Context, loads: list[Workload]) -> None:
    policies = ctx.of("NetworkPolicy")
    deny = [
        p
        for p in policies
        if p["spec"].get("podSelector") == {}
        and {"Ingress", "Egress"} <= set(p["spec"].get("policyTypes", []))
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    if not deny:
        ctx.problems.append(
            "no default-deny NetworkPolicy (podSelector {}, policyTypes Ingress and Egress, no rules)"
        )
    flows: set[tuple[str, str, str, int, str]] = set()
    media_open: set[tuple[int, int]] = set()
    for policy in policies:
        selected = [w for w in loads if _selects(policy["spec"].get("podSelector", {}), w.labels)]
        for direction, peers_key in (("ingress", "from"), ("egress", "to")):
            for i, rule in enumerate(policy["spec"].get(direction) or []):
                here = f"{where(policy)} {direction}[{i}]"
                if direction == "ingress" and _media_rule(ctx, rule, selected, here):
                    media_open |= {(p["port"], p["endPort"]) for p in rule["ports"]}
                    continue
                peers = rule.get(peers_key)
                if not peers:
                    ctx.problems.append(f"{here}: no {peers_key}: open to every source in every namespace")
                    continue
                ports = rule.get("ports")
                if not ports:
                    ctx.problems.append(f"{here}: no ports: open on every port")
                    continue
                for peer in peers:
                    kind = _peer_kind(ctx, peer, loads, here)
                    if kind is None:
                        continue
                    for port in ports:
                        number = port.get("port")
                        if isinstance(number, str):  # a named port of the pods it lands on
                            targets = (
                                selected
                                if direction == "ingress"
                                else [w for w in loads if kind == f"pods:{w.tier}"]
                            )
                            number = next((w.port(number) for w in targets if w.port(number)), None)
                        if number is None or port.get("endPort"):
                            ctx.problems.append(f"{here}: port {port} is not one port of the pods")
                            continue
                        for w in selected:
                            flows.add((direction, w.tier, kind, int(number), port.get("protocol", "TCP")))
    for w in loads:
        ports = media_range(w) if w.tier == "realtime" else None
        if ports is not None and ports not in media_open:
            ctx.add(
                w,
                f"no NetworkPolicy lets UDP {ports[0]}-{ports[1]} (its --webrtc-ports) in: no media",
            )
    want = expected_flows(loads)
    for flow in sorted(want - flows):
        ctx.problems.append(f"NetworkPolicy: flow {_flow(flow)} is not allowed (the tiers need it)")
    for flow in sorted(flows - want):
        ctx.problems.append(f"NetworkPolicy: flow {_flow(flow)} is allowed but not needed")


def _media_rule(ctx: Context, rule: Doc, selected: list[Workload], here: str) -> bool:
    """Whether an ingress rule is the one that opens WebRTC's media: UDP port ranges (``endPort``)
    only. Browsers are anywhere, so its peers may be every address; the range must be exactly the
    ``--webrtc-ports`` of the edge pods it selects, and it must select nothing else."""
    ports = rule.get("ports") or []
    if not ports or not all(p.get("protocol") == "UDP" and p.get("endPort") for p in ports):
        return False
    if not rule.get("from"):
        ctx.problems.append(f"{here}: no from: open to every source")
    if not selected or any(w.tier != "realtime" for w in selected):
        ctx.problems.append(f"{here}: a UDP port range to pods other than the Realtime edge's")
        return True
    for p in ports:
        for w in selected:
            if media_range(w) != (p.get("port"), p.get("endPort")):
                ctx.problems.append(
                    f"{here}: UDP {p.get('port')}-{p.get('endPort')} is not {where(w.doc)}'s --webrtc-ports "
                    f"({args_map(w.main).get('--webrtc-ports', 'none')})"
                )
    return True


def _flow(flow: tuple[str, str, str, int, str]) -> str:
    direction, tier, peer, port, proto = flow
    if direction == "ingress":
        return f"{peer} -> {tier}:{port}/{proto}"
    return f"{tier} -> {peer}:{port}/{proto}"


def _check_custom_resources(ctx: Context, loads: list[Workload]) -> None:
    for monitor in ctx.of("PodMonitor"):
        selector = monitor["spec"].get("selector", {})
        scraped = [w for w in loads if _selects(selector, w.labels)]
        missed = sorted({w.tier for w in loads} - {w.tier for w in scraped})
        if missed:
            ctx.add(monitor, f"does not select the pods of every tier (not {', '.join(missed)})")
        for ep in monitor["spec"].get("podMetricsEndpoints", []):
            for w in scraped:
                if w.port(ep.get("port", "")) is None:
                    ctx.add(monitor, f"port {ep.get('port')!r} is not a port of {where(w.doc)}")
    for rule in ctx.of("PrometheusRule"):
        alerts = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())
        if rule["spec"].get("groups") != alerts.get("groups"):
            ctx.add(rule, "its groups differ from deploy/prometheus/alerts.yaml")
    certificates = ctx.of("Certificate")
    if not certificates:
        return
    issued = {c["spec"].get("secretName") for c in certificates}
    issuers = {i["metadata"]["name"] for i in ctx.of("Issuer")}
    for cert in certificates:
        ref = cert["spec"].get("issuerRef", {})
        if ref.get("kind", "Issuer") == "Issuer" and ref.get("name") not in issuers:
            ctx.add(cert, f"issuerRef {ref.get('name')!r} is not an Issuer of the deployment")
    # With cert-manager, every Secret a TLS flag reads from is one it issues.
    for w in loads:
        c = w.main
        mounts = {m["name"]: m["mountPath"].rstrip("/") for m in c.get("volumeMounts", [])}
        secrets = {v["name"]: v["secret"]["secretName"] for v in w.pod.get("volumes", []) if "secret" in v}
        for flag, value in args_map(c).items():
            # TLS material: --tls-*, --worker-tls-*, and the edge's --session-ca/-cert/-key.
            if "tls" not in flag and not flag.startswith("--session-"):
                continue
            volume = next((n for n, m in mounts.items() if value.startswith(m + "/")), None)
            if volume in secrets and secrets[volume] not in issued:
                ctx.add(w, f"{flag} reads Secret {secrets[volume]}, which no Certificate issues")


# -- images -------------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    value: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)


def _logical_lines(text: str) -> Iterator[str]:
    buf: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        yield " ".join(part.strip() for part in buf)
        buf = []
    if buf:
        yield " ".join(part.strip() for part in buf)


def _expand(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, m.group(0))

    # Repeat: a default may itself name an earlier ARG.
    for _ in range(3):
        value = re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, value)
    return value


def parse_containerfile(text: str) -> list[Stage]:
    """A Containerfile's stages, with ARG defaults expanded (global ARGs reach a stage only when it
    declares them again, as in Docker)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, value = line.strip().partition(" ")
        keyword = keyword.upper()
        value = value.strip()
        if keyword == "ARG":
            name, _, default = value.partition("=")
            scope = stages[-1].args if stages else global_args
            if default:
                scope[name] = _expand(default.strip('"'), {**global_args, **scope})
            else:
                scope[name] = global_args.get(name, scope.get(name, ""))
            continue
        if keyword == "FROM":
            parts = value.split()
            base = _expand(parts[0], global_args)
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=alias))
            continue
        if not stages:
            continue
        stage = stages[-1]
        stage.instructions.append(Instruction(keyword, _expand(value, stage.args)))
    return stages


def _commands(run: str) -> Iterator[list[str]]:
    """The simple commands of a RUN (split at && ; ||), as words; --mount options dropped."""
    words = shlex.split(run, posix=True)
    while words and words[0].startswith("--"):
        words.pop(0)
    cmd: list[str] = []
    for word in words:
        if word in ("&&", ";", "||", "|"):
            if cmd:
                yield cmd
            cmd = []
        else:
            cmd.append(word)
    if cmd:
        yield cmd


_PIP_VALUE_OPTIONS = {
    "--find-links", "-f", "--index-url", "-i", "--extra-index-url", "--wheel-dir", "-w",
    "--constraint", "-c", "--target", "-t", "--python", "--root", "--prefix", "--platform",
    "--python-version", "--implementation", "--abi", "--progress-bar", "--cache-dir", "--src",
}  # fmt: skip


@dataclass
class PipCall:
    verb: str  # install | wheel
    options: list[str]
    targets: list[str]


def pip_calls(stage: Stage) -> list[PipCall]:
    calls = []
    for ins in stage.instructions:
        if ins.keyword != "RUN":
            continue
        for cmd in _commands(ins.value):
            # pip, pip3, /opt/x/bin/pip, python -m pip
            idx = next(
                (
                    i
                    for i, w in enumerate(cmd)
                    if re.fullmatch(r"(.*/)?pip(3(\.\d+)?)?", w) or (w == "pip" and i > 0)
                ),
                None,
            )
            if idx is None or idx + 1 >= len(cmd) or cmd[idx + 1] not in ("install", "wheel"):
                continue
            options, targets = [], []
            rest = cmd[idx + 2 :]
            i = 0
            while i < len(rest):
                word = rest[i]
                if word in _PIP_VALUE_OPTIONS:
                    options += rest[i : i + 2]
                    i += 2
                    continue
                if word.startswith("-"):
                    options.append(word)
                else:
                    targets.append(word)
                i += 1
            calls.append(PipCall(cmd[idx + 1], options, targets))
    return calls


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_set(targets: Iterable[str], pyproject: Doc) -> set[str]:
    """The top-level distributions a pip target list installs: the project (``.``, a path, or its
    name) with its base dependencies and the extras it names, and any other requirement."""
    from packaging.requirements import InvalidRequirement, Requirement

    project = pyproject["project"]
    names: set[str] = set()
    for target in targets:
        m = re.fullmatch(r"(\.|\./|/src/?|[\w.\-]+)(?:\[([\w,\- ]+)\])?", target.split(";")[0].strip())
        base, extras = (m.group(1), m.group(2)) if m else (target, None)
        if base in (".", "./", "/src", "/src/") or _norm(base) == _norm(project["name"]):
            names.add(_norm(project["name"]))
            deps = list(project.get("dependencies", []))
            for extra in (extras or "").split(","):
                if extra.strip():
                    deps += project.get("optional-dependencies", {}).get(extra.strip(), [])
            names |= {_norm(Requirement(d).name) for d in deps}
            continue
        try:
            names.add(_norm(Requirement(target).name))
        except InvalidRequirement:
            names.add(f"<unparsed {target}>")
    return names


COMPILERS = {"build-essential", "gcc", "g++", "clang", "make", "cmake", "cc", "cpp"}


def project_packages(pyproject: Doc, root: Path = ROOT) -> set[str]:
    """The top-level packages the project's wheel holds: the folders of ``root`` with an
    ``__init__.py`` that ``[tool.setuptools.packages.find] include`` names."""
    find = pyproject.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    patterns = [str(p) for p in find.get("include", [])]
    return {
        d.name
        for d in root.iterdir()
        if (d / "__init__.py").is_file() and any(fnmatch.fnmatchcase(d.name, p) for p in patterns)
    }


def _copied(stage: Stage) -> set[str]:
    """The sources a stage's COPY/ADD instructions take from the build context (not --from)."""
    out: set[str] = set()
    for ins in stage.instructions:
        if ins.keyword not in ("COPY", "ADD") or "--from=" in ins.value:
            continue
        words = [w for w in shlex.split(ins.value) if not w.startswith("--")]
        out |= {w.strip("/").removeprefix("./").strip("/") or "." for w in words[:-1]}
    return out


def image_problems(run_as_user: set[int] | None = None) -> list[str]:
    """The Containerfiles under deploy/images/, parsed: multi-stage, a final stage without build
    tools that installs only the builder's wheels, a non-root USER (the pods' runAsUser when given),
    an entry point that is a ``duplex`` subcommand, no torch in the session image, the torch build
    each worker image promises (the CUDA one paired with its base image's CUDA), and a builder that
    copies every package of the project; the session and realtime images' builders the same."""
    from duplex.cli import SUBCOMMANDS

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    problems: list[str] = []
    files = sorted(IMAGES.glob("*.Containerfile"))
    tiers = {f.name.split(".")[0].split("-")[0] for f in files}
    if tiers != {"session", "realtime", "worker"}:
        problems.append(
            f"deploy/images: expected session, realtime and worker Containerfiles, found {sorted(tiers)}"
        )
    for path in files:
        problems += containerfile_problems(path.name, path.read_text(), pyproject, SUBCOMMANDS, run_as_user)
    problems += same_builder_problems(IMAGES / "session.Containerfile", IMAGES / "realtime.Containerfile")
    return problems


def same_builder_problems(first: Path, second: Path) -> list[str]:
    """The two images' builder stages are the same instructions (one build serves both)."""
    if not first.is_file() or not second.is_file():
        return []
    a, b = (parse_containerfile(p.read_text())[:-1] for p in (first, second))
    if [(s.base, s.name, s.instructions) for s in a] != [(s.base, s.name, s.instructions) for s in b]:
        return [f"deploy/images/{second.name}: its builder stages differ from {first.name}'s"]
    return []


def containerfile_problems(
    name: str,
    text: str,
    pyproject: Doc,
    subcommands: dict[str, tuple[str, str]],
    run_as_user: set[int] | None = None,
) -> list[str]:
    here = f"deploy/images/{name}"
    problems: list[str] = []
    stages = parse_containerfile(text)
    if len(stages) < 2:
        return [f"{here}: not multi-stage (a builder stage, then the final one)"]
    final = stages[-1]
    names = {s.name for s in stages[:-1] if s.name}
    if final.base in names:
        problems.append(f"{here}: the final stage starts from the builder stage (its build tools)")
    # The builder builds the project's wheel from the packages it copied: one left out is missing
    # from the image (setuptools finds only what is there), and so is its subcommand.
    copied = set().union(*(_copied(s) for s in stages[:-1]))
    if "." not in copied:
        missing = sorted(project_packages(pyproject) - copied)
        if missing:
            problems.append(f"{here}: the builder does not copy the project's packages {missing}")
    # No build tools in the final stage.
    for ins in final.instructions:
        if ins.keyword == "RUN":
            for cmd in _commands(ins.value):
                if cmd[:1] in (["apt-get"], ["apt"], ["apk"], ["dnf"], ["yum"]) and (
                    "install" in cmd or "add" in cmd
                ):
                    packages = {w for w in cmd if not w.startswith("-")}
                    bad = {p for p in packages if p in COMPILERS or p.endswith("-dev")}
                    if bad:
                        problems.append(f"{here}: the final stage installs build tools {sorted(bad)}")
        if (
            ins.keyword == "COPY"
            and "--from=" not in ins.value
            and re.search(r"\b(duplex|session_service|worker_service|realtime_service)\b", ins.value)
        ):
            problems.append(f"{here}: the final stage copies the source tree ({ins.value})")
    # The final stage installs the builder's wheels and nothing from an index.
    final_calls = [c for c in pip_calls(final) if c.verb == "install"]
    if not final_calls:
        problems.append(f"{here}: the final stage installs nothing with pip")
    for call in final_calls:
        if "--no-index" not in call.options:
            problems.append(f"{here}: the final stage's pip install reaches an index (no --no-index)")
    # A non-root user, the pods' uid.
    users = [ins.value for ins in final.instructions if ins.keyword == "USER"]
    user = users[-1] if users else "root"
    uid = user.split(":")[0]
    if uid in ("root", "0", ""):
        problems.append(f"{here}: the final stage runs as root (USER {user})")
    elif not uid.isdigit():
        problems.append(f"{here}: USER {user} is not numeric (the kubelet checks runAsNonRoot by uid)")
    elif run_as_user and {int(uid)} != run_as_user:
        problems.append(f"{here}: USER {uid} is not the pods' runAsUser {sorted(run_as_user)}")
    # The entry point: `duplex <tier>`, a subcommand the CLI has.
    tier = name.split(".")[0].split("-")[0]
    entry = [ins.value for ins in final.instructions if ins.keyword == "ENTRYPOINT"]
    try:
        argv = json.loads(entry[-1]) if entry else None
    except json.JSONDecodeError:
        argv = None
    if not isinstance(argv, list) or len(argv) < 2:
        problems.append(f'{here}: ENTRYPOINT is not the exec form ["duplex", SUBCOMMAND]')
    else:
        if Path(argv[0]).name != "duplex":
            problems.append(f"{here}: ENTRYPOINT runs {argv[0]}, not duplex")
        if argv[1] not in subcommands:
            problems.append(
                f"{here}: ENTRYPOINT subcommand {argv[1]!r} is not one of duplex's {sorted(subcommands)}"
            )
        elif argv[1] != tier:
            problems.append(f"{here}: ENTRYPOINT runs duplex {argv[1]}, expected duplex {tier}")
    # What pip installs, derived from the commands and pyproject's dependencies.
    every = [c for s in stages for c in pip_calls(s)]
    final_set = install_set([t for c in final_calls for t in c.targets], pyproject)
    all_set = install_set([t for c in every for t in c.targets], pyproject)
    if tier in ("session", "realtime"):
        heavy = sorted(n for n in all_set if n in TORCH_PACKAGES or n.startswith("nvidia-"))
        if heavy:
            problems.append(f"{here}: the {tier} image installs {heavy} (the base install has no torch)")
        if _norm(pyproject["project"]["name"]) not in final_set:
            problems.append(f"{here}: the final stage does not install the project")
        if tier == "realtime" and "aiortc" not in final_set:
            problems.append(f"{here}: the realtime image does not install aiortc (the webrtc extra)")
    else:
        if not {"torch", "silero-vad"} <= final_set:
            problems.append(
                f"{here}: the worker image does not install torch and silero-vad (the worker extra)"
            )
        pins = [t for c in final_calls for t in c.targets if re.match(r"torch==", t)]
        variant = "cpu" if "cpu" in name else final.args.get("TORCH_CUDA", "")
        if not pins or not pins[0].endswith(f"+{variant}") or not variant:
            problems.append(f"{here}: torch is not pinned to its +{variant or '?'} build ({pins})")
        if "cuda" in name:
            problems += _cuda_pairing(here, final)
    return problems


def _cuda_pairing(here: str, final: Stage) -> list[str]:
    m = re.search(r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-", final.base)
    torch_cuda = final.args.get("TORCH_CUDA", "")
    if m is None:
        return [f"{here}: the final stage is not an nvidia/cuda image ({final.base})"]
    if torch_cuda != f"cu{m.group(1)}{m.group(2)}":
        cuda = f"{m.group(1)}.{m.group(2)}"
        return [f"{here}: torch's CUDA build {torch_cuda!r} does not match the image's CUDA {cuda}"]
    return []


# -- Prometheus ---------------------------------------------------------------------------------


def prometheus_problems() -> list[str]:
    """promtool on the alert rules and their unit tests; the scrape config's relabelling on a
    session, a worker and a Realtime edge pod; the adapter rule's metric is the autoscaler's."""
    problems: list[str] = []
    if shutil.which("promtool") is None:
        raise CheckError("promtool (Debian package prometheus) is not installed")
    for cmd in (
        ["promtool", "check", "rules", "alerts.yaml"],
        ["promtool", "test", "rules", "alerts_test.yaml"],
    ):
        proc = subprocess.run(cmd, cwd=PROMETHEUS, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            problems.append(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    problems += scrape_problems(yaml.safe_load((PROMETHEUS / "scrape.yaml").read_text()))
    adapter = yaml.safe_load(
        (COMPONENTS / "hpa-active-sessions" / "prometheus-adapter-rules.yaml").read_text()
    )
    exposed = {r.get("name", {}).get("as") for r in adapter.get("rules", {}).get("custom", [])}
    hpa_patch = (COMPONENTS / "hpa-active-sessions" / "kustomization.yaml").read_text()
    wanted = set(re.findall(r"metric: \{name: (\w+)\}", hpa_patch))
    if not wanted or not wanted <= exposed:
        problems.append(
            f"hpa-active-sessions: the autoscaler reads {sorted(wanted)}, "
            f"the adapter rule exposes {sorted(exposed)}"
        )
    return problems


def relabel(labels: dict[str, str], configs: list[Doc]) -> dict[str, str] | None:
    """Prometheus relabelling (replace, keep, drop) of one target; None when dropped."""
    labels = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace")
        source = cfg.get("separator", ";").join(labels.get(s, "") for s in cfg.get("source_labels", []))
        regex = re.compile(f"(?:{cfg.get('regex', '(.*)')})\\Z")
        m = regex.match(source)
        if action == "keep" and m is None:
            return None
        if action == "drop" and m is not None:
            return None
        if action == "replace" and m is not None:
            # Prometheus writes groups as $1; Python's expand as \1 (an unmatched group is "").
            replacement = m.expand(re.sub(r"\$(\d+)", r"\\\1", cfg.get("replacement", "$1")))
            if replacement:
                labels[cfg["target_label"]] = replacement
            else:
                labels.pop(cfg["target_label"], None)
    return labels


def scrape_problems(config: Doc) -> list[str]:
    jobs = config.get("scrape_configs", [])
    if len(jobs) != 1:
        return [f"deploy/prometheus/scrape.yaml: expected one job, found {len(jobs)}"]
    relabels = jobs[0].get("relabel_configs", [])
    problems = []
    for tier, port, scrape, (other_name, other_port) in (
        ("session", 9101, "true", ("grpc", 50051)),
        ("worker", 9102, "true", ("grpc", 50052)),
        ("worker", 9102, "false", ("grpc", 50052)),
        ("realtime", 9103, "true", (REALTIME_PORT, 8765)),
    ):
        for port_name, container_port in ((other_name, other_port), ("metrics", port)):
            target = {
                "__address__": f"10.0.0.1:{container_port}",
                "__metrics_path__": "/metrics",
                "__meta_kubernetes_namespace": "duplex",
                "__meta_kubernetes_pod_name": f"{tier}-0",
                "__meta_kubernetes_pod_container_port_name": port_name,
                "__meta_kubernetes_pod_label_app_kubernetes_io_component": tier,
                "__meta_kubernetes_pod_annotation_prometheus_io_scrape": scrape,
                "__meta_kubernetes_pod_annotation_prometheus_io_port": str(port),
                "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
            }
            got = relabel(target, relabels)
            keep = scrape == "true" and port_name == "metrics"
            if keep != (got is not None):
                problems.append(
                    f"deploy/prometheus/scrape.yaml: a {tier} pod's {port_name} port annotated "
                    f"scrape={scrape} is {'kept' if got is not None else 'dropped'}"
                )
            if got is not None and keep:
                want = {
                    "__address__": f"10.0.0.1:{port}",
                    "tier": tier,
                    "namespace": "duplex",
                    "pod": f"{tier}-0",
                }
                wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
                if wrong:
                    problems.append(
                        f"deploy/prometheus/scrape.yaml: a {tier} target gets {wrong}, expected {want}"
                    )
    return problems


# -- main ---------------------------------------------------------------------------------------


def check_overlay(
    path: Path, *, release: bool = False, versions: Iterable[str] = K8S_VERSIONS
) -> tuple[list[Doc], list[str]]:
    docs = render(path)
    return docs, schema_problems(copy.deepcopy(docs), versions) + object_problems(docs, release=release)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deploy.check", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument(
        "overlays", nargs="*", type=Path, help="overlay folders (default: every deploy/overlays/*)"
    )
    p.add_argument(
        "--release", action="store_true", help="also refuse the placeholder images (the overlay you deploy)"
    )
    p.add_argument(
        "--k8s-versions", default=",".join(K8S_VERSIONS), help="schema versions (default: %(default)s)"
    )
    args = p.parse_args(argv)
    versions = [v.strip() for v in args.k8s_versions.split(",") if v.strip()]
    problems: list[str] = []
    uids: set[int] = set()
    try:
        for overlay in args.overlays or overlay_dirs():
            docs, found = check_overlay(overlay, release=args.release, versions=versions)
            uids |= {w.pod.get("securityContext", {}).get("runAsUser") for w in workloads(docs)} - {None}
            problems += [f"{overlay.name}: {msg}" for msg in found]
            print(f"deploy-check: {overlay.name}: {len(docs)} objects, {len(found)} problems")
        found = image_problems(uids or None)
        print(f"deploy-check: images: {len(found)} problems")
        problems += found
        found = prometheus_problems()
        print(f"deploy-check: prometheus: {len(found)} problems")
        problems += found
    except CheckError as err:
        print(f"deploy-check: {err}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    if problems:
        print(f"deploy-check: FAILED, {len(problems)} problems", file=sys.stderr)
        return 1
    print("deploy-check: OK")
    return 0


def mutate(docs: list[Doc], kind: str, name: str, change: Callable[[Doc], object]) -> list[Doc]:
    """A deep copy of ``docs`` with ``change`` applied to the object KIND/NAME (for tests)."""
    out = copy.deepcopy(docs)
    target = next(d for d in out if d.get("kind") == kind and d["metadata"].get("name") == name)
    change(target)
    return out


if __name__ == "__main__":
    sys.exit(main())
