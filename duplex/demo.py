"""``duplex demo`` (``make demo``): start the local stack, talk a recording through it, stop.

Talks ``examples/hello.wav`` through a fresh ``LocalStack`` exactly as ``duplex talk`` would,
prints the timeline, and writes the reply next to the recording
(``examples/hello.reply.wav``) -- play it to hear the utterance come back altered. With
``--pipeline cascade`` it talks ``examples/coffee.wav`` through the cascade instead (speech
recognition -> responder -> speech synthesis, each stage on its own worker): the timeline shows
the words heard and the reply's text, and the reply says back what it heard.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from duplex.audio import AudioFileError
from duplex.client import DuplexClient
from duplex.errors import DuplexError
from duplex.stack import PIPELINES, LocalStack, StackError, example_path
from duplex.talk import InputAudio, TalkError, TalkResult, print_summary, talk, write_reply


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplex demo",
        description="Start the local stack, talk a bundled recording through it, save the reply, stop.",
        epilog="exit codes: 0 reply written, 1 the conversation failed, 2 bad input, "
        "3 the stack did not start",
    )
    p.add_argument(
        "--input",
        type=Path,
        default=None,
        help="WAV to talk (default: examples/hello.wav; with --pipeline cascade examples/coffee.wav)",
    )
    p.add_argument(
        "--pipeline",
        choices=sorted(PIPELINES),
        default=None,
        help="talk to a model served in stages instead of the parrot (cascade: speech recognition -> "
        "responder -> speech synthesis)",
    )
    p.add_argument("--out", type=Path, help="reply WAV (default: next to the input, .reply.wav)")
    p.add_argument("--workers", type=int, default=1, help="workers to start (default: %(default)s)")
    p.add_argument("--fast", action="store_true", help="send the recording faster than real time")
    p.add_argument(
        "--barge-in-after", type=float, metavar="MS", help="interrupt the reply MS after its first audio"
    )
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="give up after S seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input is None:
        args.input = example_path("coffee.wav" if args.pipeline else "hello.wav")
    try:
        audio = InputAudio.load(args.input)
    except AudioFileError as exc:
        print(f"duplex demo: {exc}", file=sys.stderr)
        return 2
    out_path: Path = args.out or args.input.with_suffix(".reply.wav")
    # The services' logs would drown the timeline; keep them in a file, show it on failure.
    log = tempfile.NamedTemporaryFile("w+", prefix="duplex-demo-", suffix=".log", delete=False)
    what = f"{args.workers} parrot worker(s)"
    if args.pipeline:
        stages = ", ".join(PIPELINES[args.pipeline][1])
        what = f"{args.workers} worker(s) of each {args.pipeline} stage: {stages}"
    print(f"starting the local stack ({what}, CPU)...", file=sys.stderr)
    try:
        with log, LocalStack(workers=args.workers, log=log, pipeline=args.pipeline) as stack:
            print(f"stack up: session service at {stack.target} (service logs: {log.name})", file=sys.stderr)
            print(f"talking {audio.path} ({audio.duration_ms / 1000:.2f} s)", file=sys.stderr)
            result = asyncio.run(_talk(stack.target, audio, args))
    except StackError as exc:
        print(f"duplex demo: the stack did not start: {exc}\n{_tail(log.name)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("\nduplex demo: interrupted; the stack is stopped", file=sys.stderr)
        return 130
    except (DuplexError, TalkError) as exc:
        print(f"duplex demo: {exc}\n{_tail(log.name)}", file=sys.stderr)
        return 1
    if not result.ok:
        why = "; ".join(result.errors) or result.reason or result.status or "no response"
        print(f"duplex demo: no reply ({why})", file=sys.stderr)
        return 1
    write_reply(result, out_path)
    print_summary(result, out_path, sys.stdout)
    print(f"play it:  aplay {out_path}   (or: play {out_path})")
    Path(log.name).unlink(missing_ok=True)
    return 0


async def _talk(target: str, audio: InputAudio, args: argparse.Namespace) -> TalkResult:
    async with DuplexClient(target) as client:
        return await talk(
            client,
            audio,
            realtime=not args.fast,
            barge_in_after_ms=args.barge_in_after,
            timeout_s=args.timeout,
        )


def _tail(path: str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "last service log lines:\n  " + "\n  ".join(text) if text else ""


if __name__ == "__main__":
    sys.exit(main())
