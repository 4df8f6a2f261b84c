"""Where a process's CPU goes: ``py-spy record`` (sampling, from outside the process) and the top
functions of its collapsed stacks, by own time (the leaf frame) and by inclusive time (anywhere on
the stack).

py-spy sees Python frames only: time in gRPC's C core, numpy or torch is charged to the Python
function that called it. Idle threads are not sampled (py-spy's default), so the shares are of the
time the process was running Python.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from duplex import spawn

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    """The py-spy executable (next to this Python first), or None."""
    import sys

    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


def record(
    pid: int,
    seconds: int,
    out: Path,
    *,
    rate: int = 100,
    gil: bool = False,
    threads: bool = False,
    native: bool = False,
) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record`` on ``pid`` for ``seconds`` (collapsed stacks into ``out``);
    ``gil``: sample only the thread holding the GIL (the Python work that serialises the
    process); ``threads``: stacks start with their thread; ``native``: C frames too (gRPC's core,
    libc's syscalls, protobuf), which needs py-spy to pause the process at each sample (the
    others read it without stopping it). None when py-spy is not installed."""
    exe = py_spy()
    if exe is None:
        return None
    flags = [*(["--gil"] if gil else []), *(["--threads"] if threads else [])]
    flags += ["--native"] if native else ["--nonblocking"]
    return spawn.popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(seconds),
            "--rate",
            str(rate),
            "--format",
            "raw",
            *flags,
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


PROJECT = ("duplex/", "session_service/", "worker_service/")
"""Where the project's own code lives (py-spy names files relative to their sys.path entry)."""


def _parse(frame: str) -> tuple[str, str]:
    """``func (path:line)`` -> (``func``, ``path``)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


def short(frame: str) -> str:
    """``func (path/to/pkg/mod.py:123)`` -> ``pkg/mod.py:func`` (line numbers dropped; a path of
    the project from its package on, ``session_service/session/runner.py``, any other cut to its
    last two parts; an unresolved native address is ``lib.so:?``)."""
    func, file = _parse(frame)
    if not file:
        return func
    parts = Path(file).parts
    if re.fullmatch(r"0x[0-9a-fA-F]+", func):
        func = "?"
    roots = [i for i, part in enumerate(parts) if f"{part}/" in PROJECT]
    kept = parts[roots[-1] :] if roots else parts[-2:]
    return f"{'/'.join(kept)}:{func}"


#: Where a leaf frame's time goes, by its file: (area, substrings of the file), first match wins.
AREAS: list[tuple[str, tuple[str, ...]]] = [
    ("gRPC (C core, Cython, grpc.aio)", ("cygrpc", "grpc/", "grpc_")),
    ("libc (syscalls: sendmsg, write, getpid...; malloc)", ("libc.so",)),
    ("protobuf", ("_message.abi3", "google/protobuf", "upb")),
    ("asyncio event loop", ("asyncio/", "selectors.py", "_asynciomodule", "selectmodule")),
    ("project code (duplex, session_service)", PROJECT),
    ("prometheus_client", ("prometheus_client",)),
    ("numpy, soxr", ("numpy", "soxr")),
    ("CPython and C++ runtime", ("libpython", "object.h", ".c", ".h", "libstdc++", "<frozen")),
]


def area(frame: str) -> str:
    """The area a (leaf) frame belongs to (``AREAS``), "other" when none matches."""
    _, file = _parse(frame)
    for name, needles in AREAS:
        if any(n in file for n in needles):
            return name
    return "other"


def _entry(func: str, file: str) -> bool:
    """A frame of the process's entry chain (under every sample of its thread: no information)."""
    name = Path(file).name
    return func == "<module>" or (func in ("main", "run") and name in ("cli.py", "server.py", "__main__.py"))


def top_functions(collapsed: str, n: int = 10) -> dict[str, Any]:
    """From py-spy's raw (collapsed) output -- one ``frame;frame;...;leaf COUNT`` line per
    distinct stack, root first, a ``thread (...)`` frame first with ``--threads``:

    * ``own``: the top ``n`` functions by own samples (the leaf frame), any code;
    * ``inclusive``: the top ``n`` functions of the project (``PROJECT``) by samples anywhere on
      the stack, the entry chain left out;
    * ``threads``: samples per thread (with ``--threads``);
    * ``areas``: the share of samples whose leaf is in each of ``AREAS``; ``through_grpc``: the
      share with a gRPC frame anywhere on the stack (with native frames)."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    through_grpc = 0
    total = 0
    for line in collapsed.splitlines():
        line = line.strip()
        if not line or " " not in line:
            continue
        stack, _, count_text = line.rpartition(" ")
        try:
            count = int(count_text)
        except ValueError:
            continue
        raw = [f for f in stack.split(";") if f.strip()]
        if raw and raw[0].startswith("thread ("):
            thread = raw[0].split(":", 1)[-1].strip() if ":" in raw[0] else raw[0]
            threads[thread] += count
            raw = raw[1:]
        if not raw:
            continue
        total += count
        own[short(raw[-1])] += count
        areas[area(raw[-1])] += count
        if any(area(f).startswith("gRPC") for f in raw):
            through_grpc += count
        seen = set()
        for f in raw:
            func, file = _parse(f)
            if file.startswith(PROJECT) and not _entry(func, file):
                seen.add(short(f))
        for f in seen:
            incl[f] += count

    def table(c: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"function": f, "samples": k, "share": k / total if total else 0.0} for f, k in c.most_common(n)
        ]

    return {
        "samples": total,
        "own": table(own),
        "inclusive": table(incl),
        "threads": {t: k for t, k in threads.most_common()},
        "areas": {a: k / total if total else 0.0 for a, k in areas.most_common()},
        "through_grpc": through_grpc / total if total else 0.0,
    }
