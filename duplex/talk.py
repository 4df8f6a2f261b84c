"""``duplex talk IN.wav -o REPLY.wav``: talk a recording through a session, save the reply.

The file is converted to the session's input format, streamed at the speed of speech (or
as fast as the server accepts it with ``--fast``) followed by a second of silence so the
server's turn detection ends the turn, and every step of the conversation is printed as a
timeline with latencies. ``talk()`` is the reusable part (``duplex demo`` calls it).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
import numpy as np

from duplex.audio import (
    PCM16K_MONO,
    PCMA_8K,
    PCMU_8K,
    AudioFileError,
    PcmFormat,
    decode,
    encode,
    read_wav,
    resample,
    to_mono,
    write_wav,
)
from duplex.client import DuplexClient, Session, check_token, event_kind, read_token, tls_credentials
from duplex.errors import DuplexError, ErrorCode
from duplex.v1 import session_pb2

DEFAULT_TARGET = "127.0.0.1:50051"

EXIT_OK = 0
EXIT_FAILED = 1  # the conversation went wrong: server error, failed response, timeout, no reply
EXIT_USAGE = 2  # bad arguments or an unreadable input file
EXIT_UNREACHABLE = 3  # nothing answers at the target (or it is unavailable)
EXIT_UNAUTHENTICATED = 4  # the service refused the credentials (none, or not valid there)

_STATUS = {
    session_pb2.RESPONSE_STATUS_COMPLETED: "completed",
    session_pb2.RESPONSE_STATUS_CANCELLED: "cancelled",
    session_pb2.RESPONSE_STATUS_FAILED: "failed",
}


class TalkError(Exception):
    """The conversation did not produce a reply; carries the exit code for the CLI."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class InputAudio:
    """A WAV file already converted to the session's input format (``fmt``)."""

    path: Path
    pcm: bytes
    source_rate: int
    source_channels: int
    fmt: PcmFormat = PCM16K_MONO

    @property
    def duration_ms(self) -> float:
        return self.fmt.duration_ms(len(self.pcm))

    @classmethod
    def load(cls, path: str | Path, fmt: PcmFormat = PCM16K_MONO) -> InputAudio:
        """Read and convert; raises ``AudioFileError`` with a one-line reason."""
        p = Path(path)
        if not p.is_file():
            raise AudioFileError(f"{p}: no such file")
        try:
            samples, rate = read_wav(p)
        except OSError as exc:
            raise AudioFileError(f"{p}: {exc.strerror or exc}") from exc
        pcm = encode(resample(to_mono(samples), rate, fmt.sample_rate_hz), fmt)
        return cls(p, pcm, rate, samples.shape[1], fmt)


@dataclass
class Timeline:
    """Prints one line per conversation event, in ms since ``t0``, and keeps the marks."""

    out: TextIO
    t0: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)
    clear_line: bool = False  # a progress line may be on the terminal: erase it first

    def now(self) -> float:
        return (time.monotonic() - self.t0) * 1000.0

    def add(self, label: str, detail: str = "", *, key: str | None = None, at: float | None = None) -> float:
        ms = self.now() if at is None else at
        if key is not None:
            self.marks.setdefault(key, ms)
        prefix = "\r\033[K" if self.clear_line else ""
        self.out.write(f"{prefix}{ms:8.0f} ms  {label:<18} {detail}".rstrip() + "\n")
        self.out.flush()
        return ms


class Progress:
    """A one-line, self-overwriting "sending" indicator on stderr (only on a terminal)."""

    def __init__(self, err: TextIO, total_ms: float) -> None:
        self.err = err
        self.total_ms = total_ms
        self.tty = err.isatty()
        self._last = 0.0
        self.sent: list[tuple[float, float]] = []  # (input ms sent, monotonic time)

    def __call__(self, sent_ms: float) -> None:
        self.sent.append((sent_ms, time.monotonic()))
        now = time.monotonic()
        if self.tty and (now - self._last > 0.1 or sent_ms >= self.total_ms):
            self._last = now
            self.err.write(f"\r\033[K  sending {sent_ms / 1000:5.1f} / {self.total_ms / 1000:.1f} s")
            self.err.flush()

    def sent_at(self, input_ms: float) -> float | None:
        """When input position ``input_ms`` had been sent (monotonic), if it was."""
        i = bisect.bisect_left(self.sent, (input_ms, 0.0))
        return self.sent[i][1] if i < len(self.sent) else None

    def done(self) -> None:
        if self.tty:
            self.err.write("\r\033[K")
            self.err.flush()


@dataclass
class TalkResult:
    """What one ``talk`` produced."""

    reply: bytes
    reply_format: PcmFormat
    status: str  # "completed", "cancelled", "failed" or "" when no response came
    reason: str
    marks: dict[str, float]
    latencies: dict[str, float]
    errors: list[str]
    session_id: str
    played_ms: float | None = None  # where playback stopped when the talk barged in

    @property
    def ok(self) -> bool:
        """A reply came (possibly cut short by our own barge-in) and did not fail."""
        return (bool(self.reply) or self.played_ms is not None) and self.status != "failed"

    @property
    def reply_ms(self) -> float:
        return self.reply_format.duration_ms(len(self.reply))


async def talk(
    client: DuplexClient,
    audio: InputAudio,
    *,
    realtime: bool = True,
    barge_in_after_ms: float | None = None,
    trailing_silence_ms: int = 1000,
    model: str = "",
    timeout_s: float = 60.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> TalkResult:
    """Open a session, stream ``audio``, print the timeline, return the first reply.

    The timeline goes to ``out`` (default stdout), progress to ``err`` (default stderr).
    ``timeout_s`` counts from the end of the input in real-time mode.
    Raises ``DuplexError`` for call failures and ``TalkError`` when no reply comes in time.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    tl = Timeline(out)
    fmt_in = audio.fmt
    # Telephone audio comes back as it went: a G.711 caller hears G.711.
    session = await client.open_session(
        model=model, input_format=fmt_in, output_format=fmt_in if fmt_in.g711 else None
    )
    out.write(f"{'t':>11}  {'event':<18} detail\n")
    try:
        fmt = session.output_format
        tl.add(
            "session opened",
            f"{session.session_id}  model={session.capabilities.model or '?'}  "
            f"in={session.input_format} out={fmt}",
            key="opened",
        )
        silence = np.zeros(fmt_in.sample_rate_hz * trailing_silence_ms // 1000, np.float32)
        pcm = audio.pcm + encode(silence, fmt_in)
        progress = Progress(err, fmt_in.duration_ms(len(pcm)))
        tl.clear_line = progress.tty and out.isatty()
        send_start = time.monotonic()

        async def send() -> None:
            sent = await session.stream_audio([pcm], fmt=fmt_in, realtime=realtime, progress=progress)
            progress.done()
            rate = sent / max(1.0, (time.monotonic() - send_start) * 1000)
            tl.add("input sent", f"{sent / 1000:.2f} s of audio ({rate:.1f}x real time)", key="input_sent")

        sender = asyncio.create_task(send())
        # The clock starts when the input has been said, however long it is.
        limit_s = timeout_s + (progress.total_ms / 1000.0 if realtime else 0.0)
        try:
            result = await asyncio.wait_for(
                _follow(session, tl, progress, fmt, barge_in_after_ms, sender), limit_s
            )
        except TimeoutError:
            raise TalkError(f"no complete reply within {limit_s:g} s") from None
        finally:
            if not sender.done():
                # The reply can finish before the trailing silence is all sent; that is fine.
                await asyncio.wait({sender}, timeout=2.0)
                sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, DuplexError):
                await sender
            progress.done()
    finally:
        await session.close()
    return result


async def _follow(
    session: Session,
    tl: Timeline,
    progress: Progress,
    fmt: PcmFormat,
    barge_in_after_ms: float | None,
    sender: asyncio.Task[None],
) -> TalkResult:
    """Read events until the first response is over, printing each step.

    The reply is "played" from its first audio at real time (the server may send it much
    faster): a barge-in ``barge_in_after_ms`` later keeps only what was played by then, as a
    client that stops its speaker and discards the rest would.
    """
    reply = bytearray()
    response_id = ""
    speech_stop_input_ms: float | None = None
    barge: asyncio.Task[None] | None = None
    played_ms: float | None = None  # set when the barge-in went out
    errors: list[str] = []
    status, reason = "", ""
    first_opened = True

    async def barge_in_later(delay_ms: float) -> None:
        nonlocal played_ms
        await asyncio.sleep(delay_ms / 1000.0)
        played_ms = min(delay_ms, fmt.duration_ms(len(reply)))
        if response_id:
            await session.playback_ack(int(played_ms), response_id)
        await session.barge_in()
        tl.add("barge-in sent", f"after {played_ms:.0f} ms of playback", key="barge_in")

    try:
        async for ev in session.events():
            kind = event_kind(ev)
            if kind == "speech_started":
                tl.add("speech started", f"at {ev.speech_started.audio_ms} ms of input", key="speech_started")
            elif kind == "speech_stopped":
                speech_stop_input_ms = float(ev.speech_stopped.audio_ms)
                tl.add("speech stopped", f"at {ev.speech_stopped.audio_ms} ms of input", key="speech_stopped")
            elif kind == "committed":
                c = ev.committed
                tl.add("committed", f"turn {c.turn_id}, {c.audio_ms} ms of audio", key="committed")
            elif kind == "response_started":
                r = ev.response_started
                response_id = response_id or r.response_id
                tl.add(
                    "response started", f"{r.response_id} (turn {r.turn_id}, epoch {r.epoch})", key="started"
                )
            elif kind == "audio_delta":
                d = ev.audio_delta
                if d.response_id != response_id:
                    continue  # only the first response is the reply
                if not reply:
                    tl.add("first audio", f"{fmt.duration_ms(len(d.pcm)):.0f} ms chunk", key="first_audio")
                    if barge_in_after_ms is not None:
                        barge = asyncio.create_task(barge_in_later(barge_in_after_ms))
                reply += d.pcm
            elif kind == "transcript_delta" and ev.transcript_delta.role == "user":
                tl.add("you said", repr(ev.transcript_delta.text))
            elif kind == "input_transcribed":
                t = ev.input_transcribed
                tl.add("transcribed", f"turn {t.turn_id}: {t.transcript!r}")
            elif kind in ("text_delta", "transcript_delta"):
                text = ev.text_delta.text if kind == "text_delta" else ev.transcript_delta.text
                tl.add(kind.replace("_", " "), repr(text))
            elif kind == "audio_cancelled":
                a = ev.audio_cancelled
                what = a.response_id or "no active response"
                tl.add("audio cancelled", f"{a.reason}: {what}, epoch {a.cancelled_epoch} -> {a.epoch}")
                if status:  # the response had ended before the barge-in reached the server
                    tl.add("", "(the server had sent the whole reply already; playback stopped locally)")
                    break
            elif kind == "response_done":
                done = ev.response_done
                if done.response_id != response_id:
                    continue
                status = _STATUS.get(done.status, str(done.status))
                reason = done.reason
                detail = f"{status}{' (' + reason + ')' if reason else ''}, {done.audio_ms} ms of audio sent"
                if done.restarting:
                    # Its worker was lost: the whole reply comes again as the next response.
                    tl.add("response done", f"{detail}; the reply restarts on another worker")
                    response_id, status, reason = "", "", ""
                    reply.clear()
                    continue
                tl.add("response done", detail, key="done")
                if barge is None or (barge.done() and done.status != session_pb2.RESPONSE_STATUS_COMPLETED):
                    break
                # A barge-in is still to come: wait for its audio_cancelled.
            elif kind == "error":
                e = ev.error
                errors.append(f"{e.code}: {e.message}")
                tl.add("error", f"{e.code}: {e.message}")
            elif kind == "go_away":
                tl.add("go away", f"{ev.go_away.reason}; will resume")
            elif kind == "opened":
                if not first_opened:
                    tl.add("resumed", f"{ev.opened.session_id} epoch {ev.opened.epoch}")
                first_opened = False
            elif kind == "closed":
                tl.add("closed", ev.closed.reason)
                break
    finally:
        if barge is not None and not barge.done():
            barge.cancel()
    if played_ms is not None:
        del reply[fmt.bytes_for_ms(played_ms) :]
    marks = tl.marks
    latencies: dict[str, float] = {}
    if "first_audio" in marks:
        first = marks["first_audio"]
        if speech_stop_input_ms is not None:
            sent_at = progress.sent_at(speech_stop_input_ms)
            if sent_at is not None:
                latencies["end of speech -> first audio"] = first - (sent_at - tl.t0) * 1000.0
        for key, label in (("speech_stopped", "speech stopped"), ("committed", "committed")):
            if key in marks:
                latencies[f"{label} event -> first audio"] = first - marks[key]
    if "opened" in marks:
        latencies["session open"] = marks["opened"]
    failed = sender.exception() if sender.done() and not sender.cancelled() else None
    if failed is not None:
        raise failed
    return TalkResult(
        bytes(reply), fmt, status, reason, dict(marks), latencies, errors, session.session_id, played_ms
    )


def print_summary(result: TalkResult, out_path: Path | None, out: TextIO) -> None:
    """Latencies and where the reply went."""
    for label, ms in result.latencies.items():
        out.write(f"  {label:<34} {ms:7.0f} ms\n")
    if out_path is not None:
        out.write(
            f"reply: {out_path} ({result.reply_ms / 1000:.2f} s, {result.reply_format.sample_rate_hz} Hz, "
            f"{result.status or 'no response'})\n"
        )
    out.flush()


def write_reply(result: TalkResult, path: Path) -> None:
    """Save the reply as WAV at the session's output rate: 16-bit PCM, or G.711 (a mu-law or
    A-law WAV) when the reply came so."""
    fmt = result.reply_format
    samples = decode(result.reply, fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_wav(path, samples, fmt.sample_rate_hz, g711=fmt.encoding if fmt.g711 else None)


#: ``--codec``: the session's input format (and, for G.711, its output format).
CODECS: dict[str, PcmFormat] = {"pcm": PCM16K_MONO, "pcmu": PCMU_8K, "pcma": PCMA_8K}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplex talk",
        allow_abbrev=False,  # "--token SECRET" must not pass as --token-file
        description="Talk a WAV file through a duplex session and save the spoken reply.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "exit codes:\n"
            "  0  the reply was written\n"
            "  1  the conversation failed (server error, failed response, timeout, no reply)\n"
            "  2  bad arguments or an unreadable/malformed input file\n"
            "  3  cannot reach the session service at --target\n"
            "  4  the service refused the credentials (code unauthenticated)\n\n"
            "credentials: the bearer token comes from --token-file or $DUPLEX_TOKEN, never from\n"
            "the command line; --tls-ca (or --tls for the system's roots) turns on TLS.\n\n"
            "examples:\n"
            "  duplex up &     # the local stack, on 127.0.0.1:50051 (plaintext, no credentials)\n"
            "  duplex talk examples/hello.wav -o reply.wav\n"
            "  duplex talk in.wav --target duplex.example:443 --tls-ca ca.crt --token-file token"
        ),
    )
    p.add_argument("input", type=Path, help="WAV file (any rate, integer or float PCM, any channels)")
    p.add_argument("-o", "--out", type=Path, help="reply WAV (default: INPUT with .reply.wav)")
    p.add_argument(
        "--target",
        default=os.environ.get("DUPLEX_TARGET", DEFAULT_TARGET),
        help="session service HOST:PORT (default: $DUPLEX_TARGET or %(default)s)",
    )
    p.add_argument("--fast", action="store_true", help="send as fast as the server accepts, not in real time")
    p.add_argument(
        "--barge-in-after",
        type=float,
        metavar="MS",
        help="barge in MS milliseconds into playing the reply (played from its first audio at real "
        "time); the saved reply keeps only what was played",
    )
    p.add_argument(
        "--trailing-silence",
        type=int,
        default=1000,
        metavar="MS",
        help="silence appended so turn detection ends the turn (default: %(default)s)",
    )
    p.add_argument(
        "--codec",
        choices=sorted(CODECS),
        default="pcm",
        help="the audio on the wire: pcm (16 kHz 16-bit, the default), or telephone audio, G.711 at "
        "8 kHz: pcmu (mu-law) or pcma (A-law), both ways; the reply is saved as a WAV of the same",
    )
    p.add_argument("--model", default="", help="expected model id (default: whatever the service runs)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="give up after S seconds")
    p.add_argument(
        "--connect-timeout", type=float, default=5.0, metavar="S", help="connecting gives up after S seconds"
    )
    p.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="file holding the bearer token sent as 'authorization: Bearer' (default: $DUPLEX_TOKEN)",
    )
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CA roots")
    p.add_argument("--tls-ca", type=Path, metavar="PATH", help="connect with TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", type=Path, metavar="PATH", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", type=Path, metavar="PATH", help="the client certificate's private key (PEM)")
    return p


def _credentials(args: argparse.Namespace) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """The channel credentials and bearer token the arguments ask for; raises ``DuplexError``."""
    token: str | None = None
    if args.token_file is not None:
        token = read_token(args.token_file)
    elif os.environ.get("DUPLEX_TOKEN"):
        token = os.environ["DUPLEX_TOKEN"].strip()
        check_token(token, "$DUPLEX_TOKEN")
    tls = args.tls or args.tls_ca is not None or args.tls_cert is not None or args.tls_key is not None
    if not tls:
        return None, token
    return tls_credentials(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key), token


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        audio = InputAudio.load(args.input, CODECS[args.codec])
    except AudioFileError as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out_path: Path = args.out or args.input.with_suffix(".reply.wav")
    try:
        credentials, token = _credentials(args)
    except DuplexError as exc:
        print(f"duplex talk: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"{audio.path}: {audio.source_rate} Hz, {audio.source_channels} ch, {audio.duration_ms / 1000:.2f} s "
        f"-> {args.target}",
        file=sys.stderr,
    )
    try:
        return asyncio.run(_run(args, audio, out_path, credentials, token))
    except KeyboardInterrupt:
        print("\nduplex talk: interrupted", file=sys.stderr)
        return 130


async def _run(
    args: argparse.Namespace,
    audio: InputAudio,
    out_path: Path,
    credentials: grpc.ChannelCredentials | None,
    token: str | None,
) -> int:
    try:
        client = DuplexClient(
            args.target, credentials=credentials, token=token, connect_timeout_s=args.connect_timeout
        )
        async with client:
            result = await talk(
                client,
                audio,
                realtime=not args.fast,
                barge_in_after_ms=args.barge_in_after,
                trailing_silence_ms=args.trailing_silence,
                model=args.model,
                timeout_s=args.timeout,
            )
    except DuplexError as exc:
        if exc.status == grpc.StatusCode.UNAVAILABLE:
            print(f"duplex talk: cannot reach {args.target}: {exc.message} [{exc.code}]", file=sys.stderr)
            return EXIT_UNREACHABLE
        if exc.code == ErrorCode.UNAUTHENTICATED:
            hint = "" if token else " (no token given: --token-file or $DUPLEX_TOKEN)"
            print(
                f"duplex talk: {args.target} refused the credentials{hint}: {exc.message} [{exc.code}]",
                file=sys.stderr,
            )
            return EXIT_UNAUTHENTICATED
        print(f"duplex talk: {exc.message} [{exc.code}]", file=sys.stderr)
        return EXIT_FAILED
    except TalkError as exc:
        print(f"duplex talk: {exc}", file=sys.stderr)
        return exc.exit_code
    if not result.reply and result.played_ms is None:
        print_summary(result, None, sys.stdout)
        why = "; ".join(result.errors) or result.reason or result.status or "no response"
        print(f"duplex talk: no reply audio ({why})", file=sys.stderr)
        return EXIT_FAILED
    write_reply(result, out_path)
    print_summary(result, out_path, sys.stdout)
    if result.status == "failed":
        print(f"duplex talk: the response failed: {result.reason}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
