"""The ``duplex`` command: one entry point, one subcommand per tool.

Each subcommand lives in the module that owns it and exposes ``main(argv) -> int``;
this file only dispatches, so importing it stays cheap (no torch, no grpc).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("worker_service.cli", "run a GPU/CPU worker service (batched model engine)"),
    "session": ("session_service.cli", "run a session service (the client-facing gRPC API)"),
    "up": ("duplex.stack", "start the local stack: one session service and N workers"),
    "talk": ("duplex.talk", "talk a WAV file through a session and save the reply"),
    "demo": ("duplex.demo", "start the local stack, talk a bundled recording through it, stop"),
}


def _usage() -> str:
    lines = ["usage: duplex <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in SUBCOMMANDS.items()]
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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    sys.exit(main())
