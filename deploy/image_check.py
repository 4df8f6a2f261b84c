"""``make images-check``: build the session, realtime and CPU worker images from deploy/images/, run
them as a local stack and hold one conversation through them.

With buildah (``--isolation chroot``: no daemon, no cgroups, the host's network), in a storage of
its own under /var/tmp that is removed at the end, so nothing else's images are touched:

1. The base: the Containerfiles' default (the official Python image) when a registry answers;
   otherwise a Debian bookworm root made by ``debootstrap --variant=minbase`` with python3.11 and
   its venv module, from the Debian mirror this machine's apt uses (read from /etc/apt), cached as
   a tar under build/image-check/ (git-ignored) and imported with ``buildah from scratch``.
2. The images: ``buildah bud --isolation chroot --build-arg PYTHON_IMAGE=<base>``; the worker's
   builder gets the torch wheel this machine's pip installs (``pip download torch==VERSION``,
   which must be the +cpu build) through ``TORCH_WHEELS``, so no CUDA build is downloaded.
   The CUDA worker is built only when its registry base can be pulled; otherwise it is skipped
   with the reason (its Containerfile is checked by ``make deploy-check``). The realtime image's
   builder is the session image's (``--layers`` builds it once).
3. Checks: the session and realtime images have no torch (``python -c "import torch"`` fails in
   them), the realtime image's WebRTC stack loads (aiortc, PyAV's libopus), the worker's torch is
   the +cpu build, each image's size (the session's under 250 MB, the realtime's under 400 MB),
   its version and revision labels, a numeric non-root user.
4. The stack: each image's ENTRYPOINT run in a container of it (``buildah from`` + ``buildah run
   --isolation chroot``, as the image's user) on loopback ports, health awaited, then
   ``duplex talk examples/hello.wav`` (the host's) through it; the reply must be non-empty audio.
   Then ``duplex realtime`` from the realtime image in front of that session service, its
   ``/healthz`` awaited, and one turn through it over WebSocket (Realtime JSON events, 24 kHz PCM)
   and one over a WebRTC call (aiortc on this machine as the browser, hello.wav its microphone):
   ``response.done`` ``completed`` with over a second of audio. No container may have had a file
   written outside /tmp (buildah run has no read-only root, so this stands in for the pods'
   readOnlyRootFilesystem).
5. Cleanup: the processes it started (by pid), every container and image, the storage.

Exit 0 when every check passes, 1 otherwise. The debootstrap tar and the torch wheel stay under
build/image-check/ for the next run (``make clean`` removes them): about 2.5 minutes warm, 3 cold,
on 2 cores. ``--base IMAGE`` builds on a given base; ``--debootstrap`` skips trying the registry.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "deploy" / "images"
WORK = ROOT / "build" / "image-check"
DEBIAN_SUITE = "bookworm"
# python3.11-venv needs python3.11-distutils, a virtual package that python3-distutils provides.
DEBIAN_PACKAGES = "python3.11,python3.11-venv,python3-distutils"
TORCH_VERSION = "2.13.0"
PREFIX = "localhost/duplex-image-check"
T0 = time.monotonic()


class CheckFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[images-check {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def debian_mirror() -> str:
    """The URI of the apt source that serves Debian's ``bookworm`` suite with ``main`` (one-line
    sources.list entries and deb822 .sources files); $DEBIAN_MIRROR overrides."""
    if os.environ.get("DEBIAN_MIRROR"):
        return os.environ["DEBIAN_MIRROR"]
    files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]
    for path in files:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 4 and words[0] == "deb" and words[2] == DEBIAN_SUITE and "main" in words[3:]:
                    return words[1]
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with contextlib.suppress(OSError):
            for stanza in re.split(r"\n\s*\n", Path(path).read_text()):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if (
                    "deb" in fields.get("types", "").split()
                    and DEBIAN_SUITE in fields.get("suites", "").split()
                    and "main" in fields.get("components", "").split()
                    and fields.get("enabled", "yes") != "no"
                ):
                    return fields["uris"].split()[0]
    raise CheckFailed(f"no apt source for Debian {DEBIAN_SUITE} main in /etc/apt (set DEBIAN_MIRROR)")


def containerfile_default(name: str, arg: str) -> str:
    m = re.search(rf"^ARG {arg}=(\S+)", (IMAGES / f"{name}.Containerfile").read_text(), re.M)
    if not m:
        raise CheckFailed(f"deploy/images/{name}.Containerfile: no ARG {arg} default")
    return m.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), deepest last."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Buildah:
    def __init__(self, storage: Path) -> None:
        self.storage = storage
        self.base = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run")]
        self.containers: list[str] = []

    def __call__(
        self, *args: str, check: bool = True, quiet: bool = False, timeout: float | None = None
    ) -> str:
        proc = subprocess.run(
            [*self.base, *args],
            cwd=ROOT,
            text=True,
            timeout=timeout,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if not quiet else subprocess.PIPE,
        )
        if check and proc.returncode != 0:
            raise CheckFailed(
                f"buildah {' '.join(args[:3])}... failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
            )
        return proc.stdout if proc.returncode == 0 else ""

    def stream(self, *args: str) -> None:
        """A long command with its output shown (indented)."""
        log("buildah " + " ".join(args))
        proc = subprocess.Popen(
            [*self.base, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            tail = [*tail[-40:], line]
            if line.startswith(("STEP", "COMMIT", "Successfully", "-->")):
                print("    " + line.rstrip(), flush=True)
        if proc.wait() != 0:
            raise CheckFailed(f"buildah {args[0]} failed ({proc.returncode}):\n{''.join(tail)}")

    def container(self, image: str, name: str) -> str:
        ctr = self("from", "--pull-never", "--name", name, image).strip().splitlines()[-1]
        self.containers.append(ctr)
        return ctr

    def run_argv(self, ctr: str, user: str, argv: list[str]) -> list[str]:
        return [*self.base, "run", "--isolation", "chroot", "--user", user, ctr, "--", *argv]


def pullable(b: Buildah, image: str) -> tuple[bool, str]:
    try:
        out = subprocess.run(
            [*b.base, "pull", "--quiet", image], text=True, capture_output=True, timeout=120, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return False, "the pull timed out after 120 s"
    if out.returncode == 0:
        return True, ""
    last = (out.stderr.strip().splitlines() or ["?"])[-1]
    return False, last


def debian_base(b: Buildah) -> str:
    """A Debian bookworm root with python3.11 (cached tar), imported as an image."""
    WORK.mkdir(parents=True, exist_ok=True)
    tar = WORK / f"debian-{DEBIAN_SUITE}-minbase-python3.11.tar"
    stamp = tar.with_suffix(".packages")
    if not (tar.exists() and stamp.exists() and stamp.read_text() == DEBIAN_PACKAGES):
        mirror = debian_mirror()
        rootfs = WORK / "rootfs.tmp"
        if rootfs.exists():
            shutil.rmtree(rootfs)
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={DEBIAN_PACKAGES}",
            DEBIAN_SUITE,
            str(rootfs),
            mirror,
        ]
        log("base: " + " ".join(cmd))
        proc = subprocess.run(cmd, text=True, capture_output=True)
        if proc.returncode != 0:
            raise CheckFailed(
                f"debootstrap failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        # What the official slim images leave out too: the package caches, documentation,
        # manual pages and translations (about 50 MB).
        for junk in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/info",
            "usr/share/locale",
        ):
            for p in (rootfs / junk).glob("*"):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.name != "lock" and p.name != "partial":
                    p.unlink()
        subprocess.run(
            [
                "tar",
                "-C",
                str(rootfs),
                "--numeric-owner",
                "--exclude=./dev/*",
                "--exclude=./proc/*",
                "--exclude=./sys/*",
                "-cf",
                str(tar) + ".tmp",
                ".",
            ],
            check=True,
        )
        os.replace(str(tar) + ".tmp", tar)
        stamp.write_text(DEBIAN_PACKAGES)
        shutil.rmtree(rootfs)
        log(f"base: cached {tar.relative_to(ROOT)} ({tar.stat().st_size / 1e6:.0f} MB)")
    else:
        log(f"base: the cached {tar.relative_to(ROOT)}")
    image = f"{PREFIX}/debian-python:{DEBIAN_SUITE}"
    ctr = b("from", "scratch").strip()
    b("add", ctr, str(tar), "/")
    env = [
        "--env",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--env",
        "LANG=C.UTF-8",
    ]
    # This base is made here for here: it trusts the CAs this machine's pip trusts (a TLS-inspecting
    # proxy's among them), and its pip uses them, so the builds reach PyPI as the host does.
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        b("copy", ctr, str(bundle), "/etc/ssl/certs/ca-certificates.crt")
        env += ["--env", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
    b("config", *env, "--cmd", "/usr/bin/python3", "--os", "linux", ctr)
    b("commit", "--quiet", "--rm", ctr, image)
    return image


def torch_wheel_dir() -> Path:
    """The torch wheel this machine's pip installs (``pip download``: the same index, find-links
    and constraints as ``make setup``), copied under build/; refused unless it is the +cpu build."""
    wheels = WORK / "wheels"
    found = sorted(wheels.glob(f"torch-{TORCH_VERSION}+cpu-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        pip = ROOT / ".venv" / "bin" / "pip"
        log(f"torch: pip download torch=={TORCH_VERSION} --no-deps (the wheel this machine's pip uses)")
        subprocess.run(
            [
                str(pip),
                "download",
                "-q",
                f"torch=={TORCH_VERSION}",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                str(wheels),
            ],
            check=True,
            cwd=ROOT,
        )
        found = sorted(wheels.glob(f"torch-{TORCH_VERSION}+cpu-*.whl"))
        if not found:
            got = [p.name for p in wheels.glob("torch-*")]
            for p in wheels.glob("torch-*"):
                p.unlink()
            raise CheckFailed(
                f"pip's torch=={TORCH_VERSION} here is {got}, not the +cpu build: refusing a CUDA build"
            )
    for p in wheels.glob("*.whl"):
        if p not in found[:1]:
            p.unlink()
    log(f"torch: {found[0].name} ({found[0].stat().st_size / 1e6:.0f} MB)")
    return wheels


@dataclass
class Facts:
    user: str
    entrypoint: list[str]
    labels: dict[str, str]
    size: float  # bytes, as buildah reports it (decimal MB)


def image_facts(b: Buildah, image: str) -> Facts:
    info = json.loads(b("inspect", "--type", "image", image))
    config = info["OCIv1"]["config"]
    size = 0.0
    for row in json.loads(b("images", "--json", image) or "[]"):
        m = re.fullmatch(r"([\d.]+)\s*([kMG]?B)", str(row.get("size", "")).strip())
        if m:
            size = float(m.group(1)) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(2)]
    return Facts(
        user=str(config.get("User", "")),
        entrypoint=[str(a) for a in config.get("Entrypoint") or []],
        labels={str(k): str(v) for k, v in (config.get("Labels") or {}).items()},
        size=size,
    )


def wait_healthy(name: str, address: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2

    from duplex.serving import health_check

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with grpc.insecure_channel(address) as channel:
        check = health_check(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CheckFailed(f"{name} exited with code {proc.returncode} before it was healthy")
            try:
                resp = check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    log(f"{name}: SERVING on {address} (grpc.health.v1)")
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}"
            time.sleep(0.25)
    raise CheckFailed(f"{name} at {address} not SERVING after {timeout_s:.0f} s ({last})")


#: What ``buildah run`` itself puts into a container's root (mount points and files it binds).
RUN_ARTEFACTS = {
    "etc/hosts",
    "etc/resolv.conf",
    "etc/hostname",
    "run/.containerenv",
    "dev",
    "proc",
    "sys",
    "run",
}


def written_outside_tmp(root: str, since: float) -> list[str]:
    """Paths under a container's root (its mount point) changed after ``since``, /tmp aside."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel in ("tmp", "proc", "sys", "dev"):
            dirnames[:] = []
            continue
        for entry in filenames + dirnames:
            path = os.path.join(dirpath, entry)
            relpath = os.path.normpath(os.path.join(rel, entry))
            with contextlib.suppress(OSError):
                if os.lstat(path).st_mtime > since and relpath not in RUN_ARTEFACTS and relpath != "tmp":
                    found.append("/" + relpath)
    return sorted(found)


def check_reply(path: Path) -> str:
    import array

    with wave.open(str(path), "rb") as w:
        frames, rate, width = w.getnframes(), w.getframerate(), w.getsampwidth()
        data = w.readframes(frames)
    if frames == 0:
        raise CheckFailed(f"the reply {path} holds no audio")
    peak = max((abs(x) for x in array.array("h", data)), default=0) if width == 2 else -1
    if peak == 0:
        raise CheckFailed(f"the reply {path} is silence")
    return f"{frames} frames at {rate} Hz ({frames / rate:.2f} s), peak {peak}"


def _start_logged(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, its output into ``log_path`` (the child keeps
    its own descriptor)."""
    with log_path.open("wb") as logfile:
        return subprocess.Popen(
            argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def wait_http_ok(name: str, url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll a plain HTTP probe (the Realtime edge's /healthz) until it answers 200."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"{name} exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    log(f"{name}: {url} answers 200")
                    return
                last = str(response.status)
        except (OSError, urllib.error.URLError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise CheckFailed(f"{name}: {url} not healthy after {timeout_s:.0f} s ({last})")


#: Run in the realtime image: its WebRTC stack loads (aiortc, PyAV's Opus in FFmpeg).
WEBRTC_PROBE = (
    "import aiortc, av; av.CodecContext.create('libopus', 'w'); "
    "print('aiortc', aiortc.__version__, 'av', av.__version__, 'libopus ok')"
)


def webrtc_turn(address: str, timeout_s: float) -> str:
    """One turn through the Realtime edge at ``address`` over a WebRTC call, with aiortc on this
    machine as the browser (tests/webrtc_helpers.py): examples/hello.wav as its microphone; returns
    what came back, or raises ``CheckFailed``."""
    import asyncio

    from duplex.audio import resample
    from tests.webrtc_helpers import PcmTrack, connect, hello_16k, offer, post_call

    async def turn() -> str:
        import numpy as np

        mic = np.concatenate([resample(hello_16k(), 16_000, 48_000), np.zeros(48_000 * 2, np.float32)])
        peer = await offer(PcmTrack(mic))
        try:
            status, answer, _ = await post_call(f"http://{address}", peer.pc.localDescription.sdp)
            if status != 201:
                raise CheckFailed(f"webrtc: POST /v1/realtime/calls answered {status}: {answer[:300]}")
            await connect(peer, answer)
            done = await peer.next_event("response.done", timeout_s)
            await peer.next_event("output_audio_buffer.stopped", 10)
            status_ = done["response"]["status"]
            heard = peer.audio()
            loud = np.flatnonzero(np.abs(heard) > 0.02)
            seconds = (loud[-1] - loud[0]) / 48_000 if len(loud) else 0.0
            if status_ != "completed" or seconds < 1.0:
                raise CheckFailed(f"webrtc: response {status_} with {seconds:.2f} s of audio heard")
            return f"response.done completed, {seconds:.2f} s of the reply heard on the track"
        finally:
            for task in peer.tasks:
                task.cancel()
            await peer.pc.close()

    return asyncio.run(asyncio.wait_for(turn(), timeout_s + 15))


def realtime_turn(address: str, timeout_s: float) -> str:
    """One turn through the Realtime edge at ``address`` (plain WebSocket JSON events):
    examples/hello.wav as 24 kHz PCM16 appends and silence; returns what came back, or raises
    ``CheckFailed``."""
    import asyncio
    import base64

    import websockets

    from duplex.audio import S16LE, PcmFormat
    from duplex.client import load_wav_as

    fmt = PcmFormat(S16LE, 24_000, 1)
    pcm = load_wav_as(ROOT / "examples" / "hello.wav", fmt) + bytes(fmt.bytes_for_ms(1500))
    step = fmt.bytes_for_ms(20)

    async def turn() -> str:
        async with websockets.connect(f"ws://{address}/v1/realtime?model=parrot", max_size=None) as ws:
            first = json.loads(await ws.recv())
            if first["type"] != "session.created":
                raise CheckFailed(f"realtime: expected session.created, got {first['type']}")
            for i in range(0, len(pcm), step):
                chunk = base64.b64encode(pcm[i : i + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            audio = 0
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "response.output_audio.delta":
                    audio += len(base64.b64decode(event["delta"]))
                elif event["type"] == "error":
                    raise CheckFailed(f"realtime: error event {event['error']}")
                elif event["type"] == "response.done":
                    status = event["response"]["status"]
                    seconds = audio / fmt.frame_bytes / fmt.sample_rate_hz
                    if status != "completed" or seconds < 1.0:
                        raise CheckFailed(f"realtime: response {status} with {seconds:.2f} s of audio")
                    return f"response.done completed, {seconds:.2f} s of 24 kHz audio"
            raise CheckFailed("realtime: the connection ended before response.done")

    return asyncio.run(asyncio.wait_for(turn(), timeout_s))


def is_server(pid: int) -> bool:
    """A duplex process (not buildah-chroot-runtime or buildah-chroot-exec, which carry its argv)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return not Path(argv[0].decode(errors="replace")).name.startswith("buildah") and b"duplex" in b" ".join(
        argv
    )


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _zombie(pid)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop(procs: list[tuple[str, subprocess.Popen[bytes]]], grace_s: float = 20.0) -> None:
    """Stop what we started, session first, by pid: SIGTERM to the server inside the container (it
    drains and exits, and buildah run with it), then SIGTERM to whatever of it is left, SIGKILL last."""
    for name, proc in procs:
        pids = [proc.pid, *children_of(proc.pid)]
        servers = []
        for pid in pids[1:]:
            if is_server(pid):
                servers.append(pid)
        for targets in (servers, pids):
            _signal(targets, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            if proc.poll() is not None:
                break
        left = [pid for pid in pids if _alive(pid)]
        if left:
            log(f"{name}: pids {left} still running after SIGTERM: SIGKILL")
            _signal(left, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        log(
            f"{name}: stopped (SIGTERM to the server, pid {servers}; buildah run exit code {proc.returncode})"
        )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cleanup(b: Buildah) -> None:
    for ctr in b.containers:
        b("rm", ctr, check=False, quiet=True)
    b("rmi", "--all", "--force", check=False, quiet=True)
    b("unmount", "--all", check=False, quiet=True)
    root = str(b.storage)
    with contextlib.suppress(OSError):
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for mnt in sorted((m for m in mounts if m.startswith(root)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], check=False)
    shutil.rmtree(b.storage, ignore_errors=True)
    log(f"cleanup: containers {len(b.containers)} and every image removed, storage {root} deleted")


def ensure_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            log(f"apt-get install -y {' '.join(missing)}")
            subprocess.run(
                ["apt-get", "install", "-y", "-q", *missing], check=True, stdout=subprocess.DEVNULL
            )
        else:
            raise CheckFailed(f"missing {missing}: apt-get install -y buildah debootstrap")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.image_check", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base",
        help="base image for both images (default: the Containerfiles' when it pulls, else debootstrap)",
    )
    p.add_argument(
        "--debootstrap", action="store_true", help="use the debootstrap base without trying the registry"
    )
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for each service's health")
    args = p.parse_args(argv)

    ensure_tools()
    storage = Path(tempfile.mkdtemp(prefix="duplex-image-check-", dir="/var/tmp"))
    b = Buildah(storage)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    labels = {"VERSION": version.group(1) if version else "0.0.0+unknown", "REVISION": revision or "unknown"}
    tag = revision[:12] or "dev"
    failed = False
    try:
        log(f"buildah {b('--version').split()[2]}, storage {storage} (removed at the end)")
        # 1. The base.
        default_base = containerfile_default("session", "PYTHON_IMAGE")
        base = args.base
        if base is None and not args.debootstrap:
            ok, why = pullable(b, default_base)
            if ok:
                base = default_base
                log(f"base: pulled {default_base}")
            else:
                log(f"base: {default_base} cannot be pulled ({why}): making one from Debian's packages")
        if base is None:
            base = debian_base(b)
        elif args.base:
            ok, why = pullable(b, base) if "/" in base and not base.startswith(PREFIX) else (True, "")
            if not ok:
                raise CheckFailed(f"--base {base} cannot be pulled: {why}")
        # 2. The images.
        wheels = torch_wheel_dir()
        common = [
            "bud",
            "--isolation",
            "chroot",
            "--layers",
            "--pull-never" if base.startswith(PREFIX) else "--pull",
            "--build-arg",
            f"VERSION={labels['VERSION']}",
            "--build-arg",
            f"REVISION={labels['REVISION']}",
        ]
        built: dict[str, str] = {}
        worker_args = [
            "--build-arg",
            f"TORCH_WHEELS={wheels.relative_to(ROOT)}",
            "--build-arg",
            "TORCH_INDEX=https://pypi.org/simple",
        ]

        def build(name: str, extra: list[str]) -> None:
            t = time.monotonic()
            image = f"{PREFIX}/{name}:{tag}"
            b.stream(
                *common,
                "--build-arg",
                f"PYTHON_IMAGE={base}",
                *extra,
                "-f",
                f"deploy/images/{name}.Containerfile",
                "-t",
                image,
                ".",
            )
            built[name] = image
            log(f"{name}: built {image} in {time.monotonic() - t:.0f} s")

        def front() -> None:
            build("session", [])
            build("realtime", [])  # session.Containerfile's builder, cached by --layers: its final stage

        # The worker's image and the front ones share only the base: built side by side (most of
        # each is waiting on pip's downloads), in one buildah storage (it locks what it shares).
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(front), pool.submit(build, "worker-cpu", worker_args)]
            for job in jobs:
                job.result()
        built = {name: built[name] for name in ("session", "realtime", "worker-cpu")}
        cuda_base = containerfile_default("worker-cuda", "CUDA_IMAGE")
        ok, why = pullable(b, cuda_base)
        if ok:
            t = time.monotonic()
            image = f"{PREFIX}/worker-cuda:{tag}"
            b.stream(*common, "-f", "deploy/images/worker-cuda.Containerfile", "-t", image, ".")
            built["worker-cuda"] = image
            log(f"worker-cuda: built {image} in {time.monotonic() - t:.0f} s (not run: no GPU stack here)")
        else:
            log(
                f"worker-cuda: SKIPPED: its base {cuda_base} cannot be pulled here ({why}); "
                "its Containerfile is checked by make deploy-check"
            )
        # 3. What each image is.
        facts = {name: image_facts(b, image) for name, image in built.items()}
        for name, f in facts.items():
            lab = f.labels
            log(
                f"{name}: size {f.size / 1e6:.0f} MB, user {f.user}, entrypoint {f.entrypoint}, "
                f"version {lab.get('org.opencontainers.image.version')!r}, "
                f"revision {lab.get('org.opencontainers.image.revision')!r}"
            )
            if (
                lab.get("org.opencontainers.image.version") != labels["VERSION"]
                or lab.get("org.opencontainers.image.revision") != labels["REVISION"]
            ):
                raise CheckFailed(
                    f"{name}: labels {lab} are not version {labels['VERSION']}, revision {labels['REVISION']}"
                )
            uid = f.user.split(":")[0]
            if not uid.isdigit() or uid == "0":
                raise CheckFailed(f"{name}: user {f.user!r} is not a numeric non-root uid")
        session_mb, realtime_mb = facts["session"].size / 1e6, facts["realtime"].size / 1e6
        size_problem = "; ".join(
            f"{name}: {mb:.0f} MB, not under {limit} MB"
            for name, mb, limit in (("session", session_mb, 250), ("realtime", realtime_mb, 400))
            if mb >= limit
        )
        if size_problem:
            log(f"FAIL (checked again at the end): {size_problem}")
        # 4. Containers: torch where it belongs, then the stack.
        ctrs = {
            name: b.container(built[name], f"duplex-image-check-{name}-{os.getpid()}")
            for name in ("session", "realtime", "worker-cpu")
        }
        user = {name: facts[name].user for name in ctrs}
        probe = (
            "import os, sys\ntry:\n import torch\nexcept ImportError as e:\n"
            " print('no torch:', e); sys.exit(3)\nprint('torch', torch.__version__, 'uid', os.getuid())"
        )
        for name, want in (("session", 3), ("realtime", 3), ("worker-cpu", 0)):
            proc = subprocess.run(
                b.run_argv(ctrs[name], user[name], ["python", "-c", probe]), capture_output=True, text=True
            )
            out = (proc.stdout + proc.stderr).strip().splitlines()
            said = [line for line in out if "torch" in line]
            log(f"{name}: python -c 'import torch' -> exit {proc.returncode}: {said[0] if said else out}")
            du = subprocess.run(
                b.run_argv(ctrs[name], "0:0", ["du", "-sm", "/opt/duplex", "/usr", "/var", "/etc"]),
                capture_output=True,
                text=True,
            ).stdout.split()
            log(f"{name}: MB by folder: {dict(zip(du[1::2], du[0::2], strict=False))}")
            if proc.returncode != want or (name == "worker-cpu" and "+cpu" not in proc.stdout):
                raise CheckFailed(f"{name}: unexpected torch probe result {proc.returncode}: {out[-5:]}")
        webrtc = subprocess.run(
            b.run_argv(ctrs["realtime"], user["realtime"], ["python", "-c", WEBRTC_PROBE]),
            capture_output=True,
            text=True,
        )
        log(f"realtime: {(webrtc.stdout + webrtc.stderr).strip().splitlines()[-1:]}")
        if webrtc.returncode != 0:
            raise CheckFailed(f"realtime: the webrtc extra does not load: {webrtc.stderr.strip()[-300:]}")
        # The moshi model's package (installed without its dependencies) imports in the worker.
        moshi_probe = "import moshi.models.loaders, sentencepiece, safetensors; print('moshi ok')"
        proc = subprocess.run(
            b.run_argv(ctrs["worker-cpu"], user["worker-cpu"], ["python", "-c", moshi_probe]),
            capture_output=True,
            text=True,
        )
        said_moshi = proc.stdout.strip() or proc.stderr[-300:]
        log(f"worker-cpu: import moshi -> exit {proc.returncode}: {said_moshi}")
        if proc.returncode != 0:
            raise CheckFailed(f"worker-cpu: the moshi model's package does not import: {proc.stderr[-500:]}")
        started = time.time() - 1
        ports = {k: free_port() for k in ("worker", "worker_health", "session", "session_health", "realtime")}
        logs = WORK / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stack = (
            (
                "worker-cpu",
                [
                    "--model",
                    "parrot",
                    "--device",
                    "cpu",
                    "--torch-threads",
                    "1",
                    "--worker-id",
                    "image-check-0",
                    "--listen",
                    f"127.0.0.1:{ports['worker']}",
                    "--health-listen",
                    f"127.0.0.1:{ports['worker_health']}",
                    "--metrics-port",
                    "0",
                ],
                ports["worker_health"],
            ),
            (
                "session",
                [
                    "--workers",
                    f"127.0.0.1:{ports['worker']}",
                    "--listen",
                    f"127.0.0.1:{ports['session']}",
                    "--health-listen",
                    f"127.0.0.1:{ports['session_health']}",
                    "--metrics-port",
                    "0",
                    "--metrics-host",
                    "127.0.0.1",
                ],
                ports["session_health"],
            ),
        )
        for name, extra, health in stack:
            argv = b.run_argv(ctrs[name], user[name], [*facts[name].entrypoint, *extra])
            server = _start_logged(argv, logs / f"{name}.log")
            procs.insert(0, (name, server))
            log(f"{name}: started pid {server.pid}: buildah run ... {' '.join(argv[argv.index('--') + 1 :])}")
            wait_healthy(name, f"127.0.0.1:{health}", server, args.timeout)
            uids = set()
            for pid in children_of(server.pid):
                with contextlib.suppress(OSError):
                    if is_server(pid):
                        m = re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
                        uids.add(m.group(1) if m else "?")
            log(f"{name}: its duplex process runs as uid {sorted(uids)}")
            if not uids or "0" in uids:
                raise CheckFailed(f"{name}: the server's uid is {sorted(uids)}, expected {user[name]}")
        reply = WORK / "reply.wav"
        reply.unlink(missing_ok=True)
        talk = [
            str(ROOT / ".venv" / "bin" / "duplex"),
            "talk",
            "examples/hello.wav",
            "-o",
            str(reply.relative_to(ROOT)),
            "--target",
            f"127.0.0.1:{ports['session']}",
            "--timeout",
            "60",
        ]
        log("talk: " + " ".join(talk[1:]))
        proc = subprocess.run(talk, cwd=ROOT, capture_output=True, text=True)
        for line in (proc.stdout + proc.stderr).strip().splitlines():
            print("    " + line, flush=True)
        if proc.returncode != 0:
            raise CheckFailed(f"duplex talk exited {proc.returncode}")
        log(f"talk: the reply {reply.relative_to(ROOT)}: {check_reply(reply)}")
        # The Realtime edge from its image, in front of the image-run session service.
        edge_argv = [
            *facts["realtime"].entrypoint,
            "--session",
            f"127.0.0.1:{ports['session']}",
            "--listen",
            f"127.0.0.1:{ports['realtime']}",
            "--metrics-port",
            "0",
        ]
        argv = b.run_argv(ctrs["realtime"], user["realtime"], edge_argv)
        edge = _start_logged(argv, logs / "realtime.log")
        procs.insert(0, ("realtime", edge))
        log(f"realtime: started pid {edge.pid}: buildah run ... {' '.join(edge_argv)}")
        wait_http_ok("realtime", f"http://127.0.0.1:{ports['realtime']}/healthz", edge, args.timeout)
        edge_address = f"127.0.0.1:{ports['realtime']}"
        log(f"realtime: a turn over WebSocket: {realtime_turn(edge_address, 60.0)}")
        log(f"realtime: a turn over a WebRTC call: {webrtc_turn(edge_address, 60.0)}")
        # buildah run has no read-only root; instead: nothing was written outside /tmp.
        for name, ctr in ctrs.items():
            written = written_outside_tmp(b("mount", ctr).strip(), started)
            log(f"{name}: files written outside /tmp while it ran: {written or 'none'}")
            if written:
                raise CheckFailed(f"{name} wrote outside /tmp (the pods' root is read-only): {written}")
        if size_problem:
            raise CheckFailed(size_problem)
        summary = ", ".join(f"{n} {f.size / 1e6:.0f} MB" for n, f in facts.items())
        log(
            f"PASS: {summary}; a conversation through the image-run stack returned the parrot's reply, "
            "over gRPC and through the Realtime edge (WebSocket and WebRTC)"
        )
    except Exception as exc:  # reported, then everything is cleaned up
        failed = True
        log(f"FAIL: {exc}")
        for name, _ in procs:
            path = WORK / "logs" / f"{name}.log"
            if path.exists():
                print(
                    f"---- {name} log (last lines) ----\n"
                    + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
                )
    finally:
        stop(procs)
        cleanup(b)
        log(f"done in {time.monotonic() - T0:.0f} s: {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
