"""Packaging: the base install (client, session service) needs no torch; the ``worker`` extra adds it.

The import checks run in a fresh interpreter with a ``sys.meta_path`` finder that refuses
``torch`` and ``silero_vad``, as on a machine where only ``pip install duplex-serving`` ran.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
BLOCKED = ("torch", "silero_vad")
# The packages a base install must be able to import in full.
BASE_PACKAGES = ("duplex", "session_service")

# Put first in every child: after it, importing a blocked module fails as if it were absent.
BLOCK_HOOK = f"""
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""

# Imports every module of BASE_PACKAGES and prints what happened as JSON.
IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback

failed = {}
seen = []
skipped = {}
for pkg_name in %(packages)r:
    pkg = importlib.import_module(pkg_name)
    seen.append(pkg_name)
    def onerror(name):
        failed[name] = traceback.format_exc()
    for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg_name + ".", onerror=onerror):
        if info.name.rpartition(".")[2] == "__main__":
            # Importing a __main__ runs its program (the CLI exits); `duplex worker` is checked
            # by its own test below.
            skipped[info.name] = "runs the CLI when imported"
            continue
        seen.append(info.name)
        try:
            importlib.import_module(info.name)
        except BaseException:
            failed[info.name] = traceback.format_exc()
try:
    import torch  # noqa: F401
    hook_works = False
except ModuleNotFoundError:
    hook_works = True
print(json.dumps({
    "seen": seen,
    "failed": failed,
    "skipped": skipped,
    "hook_works": hook_works,
    "files": {name: getattr(sys.modules[name], "__file__", None) for name in %(packages)r},
    "blocked_loaded": sorted(m for m in sys.modules if m.partition(".")[0] in %(blocked)r),
}))
"""

# `python -m duplex ARGS...`, after the hook.
RUN_CLI = """
import runpy
sys.argv = ["duplex", *sys.argv[1:]]
runpy.run_module("duplex", run_name="__main__", alter_sys=True)
"""


def _run_blocked(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (this checkout first on the path) with torch blocked."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-c", BLOCK_HOOK + code, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_base_module_imports_without_torch() -> None:
    proc = _run_blocked(IMPORT_ALL % {"packages": BASE_PACKAGES, "blocked": BLOCKED})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hook_works"], "the blocking hook let torch through: the test proves nothing"
    # This checkout's packages were the ones imported (not an installed copy elsewhere).
    for name, file in report["files"].items():
        assert file is not None and Path(file).resolve().is_relative_to(REPO), (name, file)
    # The walk found the modules (so a rename cannot make it check nothing).
    for expected in ("duplex.client", "duplex.talk", "duplex.v1.session_pb2", "session_service.api.server"):
        assert expected in report["seen"], report["seen"]
    assert set(report["skipped"]) <= {f"{p}.__main__" for p in BASE_PACKAGES}, report["skipped"]
    failures = "\n".join(f"--- {name}\n{tb}" for name, tb in report["failed"].items())
    assert not report["failed"], f"modules that need torch/silero_vad at import:\n{failures}"
    assert report["blocked_loaded"] == []


def test_worker_without_torch_says_which_extra_to_install() -> None:
    proc = _run_blocked(RUN_CLI, "worker", "--help")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # one clear line, no traceback
    assert "pip install 'duplex-serving[worker]'" in lines[0]
    assert "torch" in lines[0]
    assert proc.stdout == ""


EDGE_WITHOUT_WEBRTC = """
import asyncio, json, sys, urllib.request, urllib.error
from realtime_service.server import EdgeConfig, EdgeServer
from session_service.trust.auth import Authenticator

async def main():
    server = EdgeServer(EdgeConfig(listen_port=0), Authenticator())
    await server.start()
    url = f"http://127.0.0.1:{server.port}/v1/realtime/calls"
    request = urllib.request.Request(url, data=b"v=0", headers={"Content-Type": "application/sdp"})
    try:
        await asyncio.to_thread(urllib.request.urlopen, request)
    except urllib.error.HTTPError as err:
        print(json.dumps({"status": err.code, "body": json.loads(err.read()), "calls": server.calls is None}))
    await server.drain()
asyncio.run(main())
"""


def test_the_realtime_edge_runs_without_the_webrtc_extra() -> None:
    # Without aiortc (the webrtc extra) the edge serves WebSockets and the page; /calls says why not.
    code = BLOCK_HOOK.replace(repr(BLOCKED), repr(("torch", "silero_vad", "aiortc", "av", "aioice")))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code + EDGE_WITHOUT_WEBRTC],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["status"] == 501 and answer["calls"], answer
    assert answer["body"]["error"]["code"] == "webrtc_unavailable"
    assert "duplex-serving[webrtc]" in answer["body"]["error"]["message"]
    assert "WebRTC is off" in proc.stderr


def test_the_extra_check_passes_when_the_extra_is_installed() -> None:
    # The check must not refuse a machine that has the extra.
    pytest.importorskip("torch")
    pytest.importorskip("silero_vad")
    from duplex.cli import WORKER_MODULES, missing_modules

    assert missing_modules(WORKER_MODULES) == []
    assert missing_modules(["duplex_no_such_module"]) == ["duplex_no_such_module"]


def _project() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _torch_requirement() -> Requirement:
    worker = [Requirement(r) for r in _project()["optional-dependencies"]["worker"]]
    (torch,) = [r for r in worker if r.name == "torch"]
    return torch


def test_base_dependencies_leave_torch_to_the_worker_extra() -> None:
    project = _project()
    base = {Requirement(r).name.lower() for r in project["dependencies"]}
    worker = [Requirement(r) for r in project["optional-dependencies"]["worker"]]
    assert not base & {"torch", "silero-vad"}, base
    # What the client and the session service import stays in the base install.
    assert {"grpcio", "protobuf", "numpy", "prometheus-client"} <= base
    # The models' own: torch, the parrot's VAD, the real needs of Kyutai's moshi (installed with
    # --no-deps by make setup: its metadata pins an older torch than it runs on), and the
    # cascade's speech recognizer and synthesizer (their wheels ship their models and data), and
    # the chat stage's client of a language model server.
    moshi_needs = {"safetensors", "huggingface-hub", "einops", "sentencepiece", "sphn", "tqdm"}
    cascade = {"pocketsphinx", "espeakng-loader", "openai"}
    assert {r.name.lower() for r in worker} == {"torch", "silero-vad", *moshi_needs, *cascade}
    assert "pip install -q --no-deps moshi==$(MOSHI_VERSION)" in (REPO / "Makefile").read_text()
    torch = _torch_requirement()
    assert torch.specifier.contains("2.13.0") and not torch.specifier.contains("3.0")


def test_make_setup_installs_the_pinned_cpu_torch_first() -> None:
    # A torch requirement with no torch installed pulls a multi-GB CUDA build: setup installs
    # the CPU build first, and the worker extra's range must accept it.
    makefile = (REPO / "Makefile").read_text()
    pins = re.findall(r"pip install -q torch==(\S+)", makefile)
    editable = makefile.find("pip install -q -e '.[worker,webrtc,dev,frameworks]'")
    assert len(pins) == 1 and editable != -1
    assert makefile.find(f"torch=={pins[0]}") < editable
    assert _torch_requirement().specifier.contains(pins[0])


def test_make_setup_installs_the_frameworks_and_pipecat_without_its_pins() -> None:
    # The framework tests run in CI: make setup installs the frameworks extra, then Pipecat with
    # --no-deps (its protobuf<7 pin would break the generated code); the extra itself never names
    # Pipecat, so no resolver ever downgrades protobuf for it.
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"pip install -q --no-deps '\$\(PIPECAT\)'", makefile)
    assert re.search(r"PIPECAT \?= pipecat-ai==\S+", makefile)
    frameworks = [Requirement(r) for r in _project()["optional-dependencies"]["frameworks"]]
    names = {r.name.lower() for r in frameworks}
    assert "livekit-agents" in names and "pipecat-ai" not in names and "protobuf" not in names
