"""``duplex session``: parse the command line, load the plugin, run the service."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import uuid
from pathlib import Path

from duplex.errors import DuplexError
from duplex.serving import split_host_port
from duplex.tls import ClientTLS
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import load_plugin
from session_service.resume import DEFAULT_MAX_AGE_S


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplex session", description="Run a session service replica.")
    p.add_argument("--plugin", default="session_service.plugins.parrot:ParrotPlugin", help="module:Class")
    p.add_argument("--workers", required=True, help="worker addresses HOST:PORT[,HOST:PORT...]")
    p.add_argument("--listen", default="127.0.0.1:50051", help="gRPC HOST:PORT (port 0 = any)")
    p.add_argument("--metrics-port", type=int, default=9464, help="/metrics port (0 = any)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--idle-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--resume-secret",
        default="",
        help="HMAC key for resume tokens, shared by all replicas "
        "(default: $DUPLEX_RESUME_SECRET, else random per process)",
    )
    p.add_argument(
        "--resume-max-age-s",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help="how long a resume token stays valid",
    )
    p.add_argument("--replica-id", default="", help="owner id towards workers (default: random)")
    p.add_argument("--drain-grace-s", type=float, default=10.0)
    p.add_argument(
        "--no-silence-continuation",
        action="store_true",
        help=(
            "do not feed real-time silence during replies "
            "(a lockstep model such as parrot then stalls without client audio)"
        ),
    )
    p.add_argument(
        "--max-unconsumed-input-ms",
        type=int,
        default=RunnerConfig().max_unconsumed_input_ms,
        help="hold input acks while more audio than this waits unconsumed at the worker (0 = never)",
    )
    p.add_argument(
        "--worker-stall-timeout-s",
        type=float,
        default=ServiceConfig(plugin="", workers=()).worker_stall_timeout_s,
        help="treat a worker as lost when it owes output and sends none for this long (0 = never)",
    )
    p.add_argument(
        "--worker-tls-ca",
        type=Path,
        default=None,
        metavar="PATH",
        help="mutual TLS towards the workers: the CA that signed their certificates (PEM)",
    )
    p.add_argument(
        "--worker-tls-cert",
        type=Path,
        default=None,
        metavar="PATH",
        help="this replica's client certificate towards the workers (PEM; its identity is the owner's)",
    )
    p.add_argument("--worker-tls-key", type=Path, default=None, metavar="PATH", help="its private key (PEM)")
    return p


def _worker_tls(args: argparse.Namespace) -> ClientTLS | None:
    """``--worker-tls-*``: files re-read whenever a worker link makes a new channel."""
    if args.worker_tls_ca is None:
        if args.worker_tls_cert is not None or args.worker_tls_key is not None:
            raise SystemExit("duplex session: --worker-tls-cert/--worker-tls-key need --worker-tls-ca")
        return None
    try:
        return ClientTLS(ca=args.worker_tls_ca, cert=args.worker_tls_cert, key=args.worker_tls_key)
    except DuplexError as err:
        raise SystemExit(
            f"duplex session: --worker-tls-cert and --worker-tls-key go together ({err.message})"
        ) from err


def _resume_secret(flag: str | None) -> bytes:
    # The environment keeps the secret out of the process list; replicas that share it can
    # resume each other's sessions. Without one, tokens work on this process only.
    value = flag or os.environ.get("DUPLEX_RESUME_SECRET", "")
    return value.encode() if value else secrets.token_bytes(32)


def config_from_args(argv: list[str]) -> ServiceConfig:
    args = _parser().parse_args(argv)
    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    if not workers:
        raise SystemExit("duplex session: --workers needs at least one HOST:PORT")
    try:
        for w in (*workers, args.listen):
            split_host_port(w)
    except ValueError as exc:
        raise SystemExit(f"duplex session: {exc}") from exc
    if args.resume_max_age_s <= 0:
        raise SystemExit("duplex session: --resume-max-age-s must be positive")
    if args.max_unconsumed_input_ms < 0:
        raise SystemExit("duplex session: --max-unconsumed-input-ms must not be negative")
    if args.worker_stall_timeout_s < 0:
        raise SystemExit("duplex session: --worker-stall-timeout-s must not be negative")
    if args.max_sessions < 1 or args.idle_timeout_s <= 0:
        raise SystemExit("duplex session: --max-sessions and --idle-timeout-s must be positive")
    worker_tls = _worker_tls(args)
    return ServiceConfig(
        plugin=args.plugin,
        workers=workers,
        listen=args.listen,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_sessions=args.max_sessions,
        resume_secret=_resume_secret(args.resume_secret),
        resume_max_age_s=args.resume_max_age_s,
        replica_id=args.replica_id or f"session-{uuid.uuid4().hex[:12]}",
        drain_grace_s=args.drain_grace_s,
        worker_stall_timeout_s=args.worker_stall_timeout_s,
        worker_tls=worker_tls,
        runner=RunnerConfig(
            idle_timeout_s=args.idle_timeout_s,
            silence_continuation=not args.no_silence_continuation,
            max_unconsumed_input_ms=args.max_unconsumed_input_ms,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    try:
        plugin = load_plugin(cfg.plugin)
    except DuplexError as err:
        print(f"duplex session: {err.message}", file=sys.stderr)
        return 2
    from session_service.server import run  # grpc only once the arguments are good

    return run(cfg, plugin)


if __name__ == "__main__":
    sys.exit(main())
