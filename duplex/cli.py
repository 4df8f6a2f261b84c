"""The ``duplex`` command: one entry point, one subcommand per tool.

Each subcommand lives in the module that owns it and exposes ``main(argv) -> int``;
this file only dispatches, so importing it stays cheap (no torch, no grpc). Subcommands
that run models need the ``worker`` extra; without it they stop with one line saying so.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("worker_service.cli", "run a GPU/CPU worker service (batched model engine)"),
    "session": ("session_service.api.cli", "run a session service (the client-facing gRPC API)"),
    "realtime": ("realtime_service.cli", "serve the OpenAI Realtime API over WebSocket (an edge)"),
    "up": ("duplex.stack", "start the local stack: one session service and N workers"),
    "talk": ("duplex.talk", "talk a WAV file through a session and save the reply"),
    "demo": ("duplex.demo", "start the local stack, talk a bundled recording through it, stop"),
    "moshi-checkpoint": (
        "worker_service.models.moshi.checkpoint",
        "write a small random-weight Moshi checkpoint (to try --model moshi)",
    ),
}

#: The pip extra that holds the worker's models, and the modules it brings.
WORKER_EXTRA = "worker"
WORKER_MODULES: tuple[str, ...] = ("torch", "silero_vad")

# subcommand -> the extra it needs beyond the base install. `up` and `demo` start workers.
NEEDS_EXTRA: dict[str, tuple[str, tuple[str, ...]]] = {
    name: (WORKER_EXTRA, WORKER_MODULES) for name in ("worker", "up", "demo")
}
NEEDS_EXTRA["moshi-checkpoint"] = (WORKER_EXTRA, (*WORKER_MODULES, "sentencepiece", "safetensors"))


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The top-level ``modules`` that cannot be imported here, found without importing them."""
    missing = []
    for mod in modules:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ImportError:  # a finder may refuse the name outright instead of passing on it
            found = False
        if not found:
            missing.append(mod)
    return missing


def _missing_extra_message(command: str, extra: str, missing: Iterable[str]) -> str:
    return (
        f"duplex {command}: needs {', '.join(missing)} (not installed); "
        f"install the '{extra}' extra: pip install 'duplex-serving[{extra}]'"
    )


def _usage() -> str:
    lines = ["usage: duplex <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'duplex <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"duplex: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in NEEDS_EXTRA:
        # Checked before importing the subcommand, so even --help says what is missing
        # instead of ending in a traceback from deep inside the worker's imports.
        extra, modules = NEEDS_EXTRA[name]
        missing = missing_modules(modules)
        if missing:
            print(_missing_extra_message(name, extra, missing), file=sys.stderr)
            return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
