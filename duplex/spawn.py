"""Start child processes from a parent whose threads (gRPC's, an engine's) are running.

Only ``popen`` here starts children for ``duplex up`` / ``duplex demo`` (``duplex.stack``), the
benchmarks and the tests. It never runs Python between fork and exec, because in a threaded
parent that can bring the child down:

- CPython (3.11) runs a ``preexec_fn`` in a child made with ``fork()``, and before that
  ``fork()`` runs every ``pthread_atfork`` handler. The grpcio wheel is built with gRPC's fork
  support on (``GRPC_ENABLE_FORK_SUPPORT`` defaults to true in its core), so gRPC's handlers
  run; when other threads are inside gRPC they give up ("Other threads are currently calling
  into gRPC, skipping fork() handlers") and the child, left with gRPC's state copied mid-flight,
  can die with SIGSEGV or SIGABRT before it ever reaches exec.
- With no ``preexec_fn`` (and no ``user``/``group``/``extra_groups``), ``_posixsubprocess``
  starts the child with ``vfork()``, which runs no atfork handler, and does everything else
  (``cwd``, ``start_new_session``, closing descriptors, dup2) in C before exec.

So ``popen`` takes no ``preexec_fn``. What used to need one -- the kernel's SIGTERM to the
child when its parent dies (``PR_SET_PDEATHSIG``) -- is done after exec instead: with
``parent_death_signal`` the child first execs a tiny Python trampoline (a fresh,
single-threaded interpreter), which asks for the signal, checks its parent is still the one
that started it (else it exits 1: the parent died first), and execs the real command in place
(same pid). The setting survives exec (it is cleared only for set-user-ID programs).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any, Literal, overload

__all__ = ["TRAMPOLINE", "popen", "trampoline_argv"]

_File = int | IO[Any] | None

#: The child's first program when it must die with its parent: ``python -I -S -c TRAMPOLINE
#: PARENT_PID SIGNAL ARGV...``. Runs in the exec'd interpreter, never between fork and exec.
TRAMPOLINE = """\
import ctypes, os, signal, sys
parent, sig, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, sig, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
except (OSError, AttributeError) as exc:
    sys.stderr.write(f"duplex.spawn: no parent-death signal for {argv[0]}: {exc}\\n")
if os.getppid() != parent:
    os._exit(1)
for name in ("SIGPIPE", "SIGXFSZ"):  # the interpreter ignores them; restore what exec would get
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
try:
    os.execv(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"duplex.spawn: cannot run {argv[0]}: {exc}\\n")
    os._exit(127)
"""


def trampoline_argv(argv: Sequence[str], parent_pid: int, sig: int) -> list[str]:
    """``argv`` (its program an absolute path) behind the parent-death trampoline."""
    return [sys.executable, "-I", "-S", "-c", TRAMPOLINE, str(parent_pid), str(int(sig)), *argv]


def _resolve(program: str, env: Mapping[str, str] | None) -> str:
    """The program's path as exec would find it; FileNotFoundError now rather than in the child."""
    if os.path.dirname(program):
        return program
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    found = shutil.which(program, path=path)
    if found is None:
        raise FileNotFoundError(2, "No such file or directory", program)
    return os.path.abspath(found)


@overload
def popen(
    argv: Sequence[str],
    *,
    text: Literal[True],
    stdin: _File = ...,
    stdout: _File = ...,
    stderr: _File = ...,
    env: Mapping[str, str] | None = ...,
    cwd: str | os.PathLike[str] | None = ...,
    new_session: bool = ...,
    parent_death_signal: int | None = ...,
) -> subprocess.Popen[str]: ...


@overload
def popen(
    argv: Sequence[str],
    *,
    text: Literal[False] = ...,
    stdin: _File = ...,
    stdout: _File = ...,
    stderr: _File = ...,
    env: Mapping[str, str] | None = ...,
    cwd: str | os.PathLike[str] | None = ...,
    new_session: bool = ...,
    parent_death_signal: int | None = ...,
) -> subprocess.Popen[bytes]: ...


def popen(
    argv: Sequence[str],
    *,
    text: bool = False,
    stdin: _File = None,
    stdout: _File = None,
    stderr: _File = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    new_session: bool = False,
    parent_death_signal: int | None = None,
) -> subprocess.Popen[str] | subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, ...)`` with nothing in Python between fork and exec.

    ``new_session``: the child leads a session and process group of its own (``setsid`` in C:
    a terminal's Ctrl-C reaches only the parent). ``parent_death_signal``: on Linux, the kernel
    sends the child this signal when the thread that started it ends (its process exiting,
    even by SIGKILL); a child whose parent is already gone exits 1 before running ``argv``.
    Elsewhere it is ignored.
    """
    args = list(argv)
    if parent_death_signal is not None and sys.platform.startswith("linux"):
        args[0] = _resolve(args[0], env)
        args = trampoline_argv(args, os.getpid(), signal.Signals(parent_death_signal))
    # No preexec_fn, user, group or extra_groups: any of them makes CPython fork() (running
    # gRPC's atfork handlers) instead of vfork(), and the first runs Python in the child.
    return subprocess.Popen(
        args,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=new_session,
    )
