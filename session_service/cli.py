"""``duplex session``: parse the command line, load the plugin, run the service."""

from __future__ import annotations

import argparse
import sys
import uuid

from duplex.errors import DuplexError
from duplex.serving import split_host_port
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import load_plugin
from session_service.resume import DEFAULT_MAX_AGE_S, ResumeKeys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplex session",
        description="Run a session service replica.",
        epilog="Resume tokens are encrypted with the keys in $DUPLEX_RESUME_SECRETS "
        "(KID:SECRET[,KID:SECRET...], secrets of at least 32 bytes; the first encrypts, all decrypt); "
        "replicas that share them resume each other's sessions. Without it tokens work on this "
        "replica only.",
    )
    p.add_argument("--plugin", default="session_service.plugins.parrot:ParrotPlugin", help="module:Class")
    p.add_argument("--workers", required=True, help="worker addresses HOST:PORT[,HOST:PORT...]")
    p.add_argument("--listen", default="127.0.0.1:50051", help="gRPC HOST:PORT (port 0 = any)")
    p.add_argument("--metrics-port", type=int, default=9464, help="/metrics port (0 = any)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument(
        "--max-sessions-per-principal",
        type=int,
        default=0,
        help="most sessions one caller holds on this replica (0 = only --max-sessions)",
    )
    p.add_argument("--idle-timeout-s", type=float, default=300.0)
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
    return p


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
    if args.max_sessions_per_principal < 0:
        raise SystemExit("duplex session: --max-sessions-per-principal must not be negative")
    try:
        resume_keys = ResumeKeys.from_environment()
    except DuplexError as err:
        raise SystemExit(f"duplex session: {err.message}") from err
    return ServiceConfig(
        plugin=args.plugin,
        workers=workers,
        listen=args.listen,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_sessions=args.max_sessions,
        max_sessions_per_principal=args.max_sessions_per_principal,
        # From the environment only (DUPLEX_RESUME_SECRETS): a secret in argv is in every
        # process listing.
        resume_keys=resume_keys,
        resume_max_age_s=args.resume_max_age_s,
        replica_id=args.replica_id or f"session-{uuid.uuid4().hex[:12]}",
        drain_grace_s=args.drain_grace_s,
        worker_stall_timeout_s=args.worker_stall_timeout_s,
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
