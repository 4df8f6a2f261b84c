"""``duplex session``: parse the command line, load the plugin, run the service."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

from duplex.errors import BadRequestError, DuplexError, ErrorCode
from duplex.serving import EVENT_LOOPS, event_loop_name, split_host_port
from duplex.tls import ClientTLS, ServerTLS
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import load_plugin
from session_service.trust.resume_tokens import DEFAULT_MAX_AGE_S, ResumeKeys
from session_service.workers.discovery import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_RESOLVE_INTERVAL_S,
    WorkersSpecError,
    parse_workers,
)


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
    p.add_argument(
        "--workers",
        required=True,
        help="the workers: HOST:PORT[,HOST:PORT...], or dns:///NAME:PORT (every A/AAAA record of NAME "
        "is a worker, re-resolved while running; dns://DNS_IP[:PORT]/NAME:PORT asks that DNS server)",
    )
    p.add_argument(
        "--stage-workers",
        action="append",
        default=None,
        metavar="STAGE=WORKERS",
        help="a plugin served in stages: the workers of a later stage, as --workers takes them "
        "(repeat for each stage; the first stage's are --workers)",
    )
    p.add_argument(
        "--workers-resolve-interval-s",
        type=float,
        default=DEFAULT_RESOLVE_INTERVAL_S,
        help="with --workers dns:...: resolve the name again this often (and at once when a worker "
        "link is lost)",
    )
    p.add_argument(
        "--max-workers",
        type=int,
        default=DEFAULT_MAX_WORKERS,
        help="most worker links (a longer --workers list is refused, a DNS answer is cut)",
    )
    p.add_argument("--listen", default="127.0.0.1:50051", help="gRPC HOST:PORT (port 0 = any)")
    p.add_argument(
        "--health-listen",
        default="",
        metavar="HOST:PORT",
        help="also serve grpc.health.v1 (and nothing else) in plaintext here, for probes that cannot "
        "speak TLS (default: none)",
    )
    p.add_argument("--metrics-port", type=int, default=9464, help="/metrics port (0 = any)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=0,
        help="authenticated calls in progress at once, unopened streams included; beyond it a call is "
        "refused with RESOURCE_EXHAUSTED too_many_calls (0 = 2 x --max-sessions + 64)",
    )
    p.add_argument(
        "--open-timeout-s",
        type=float,
        default=ServiceConfig(plugin="", workers=()).open_timeout_s,
        help="how long a new call may take to send its open or resume; until then it holds a call "
        "slot of its caller (default: %(default)s)",
    )
    p.add_argument(
        "--max-calls-per-principal",
        type=int,
        default=0,
        help="calls one caller may have in progress at once, opened or not (0 = 2 x "
        "--max-sessions-per-principal + 16 when that is set, else --max-sessions + 16; always below "
        "--max-concurrent-rpcs)",
    )
    p.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=0,
        help="HTTP/2 streams one client connection may hold (0 = --max-sessions + 16)",
    )
    p.add_argument(
        "--max-session-buffer-bytes",
        type=int,
        default=RunnerConfig().max_buffer_bytes,
        help="bytes queued per session each way: client events not yet handled (the client is "
        "then read no further), server events not yet read (beyond: slow_consumer)",
    )
    p.add_argument(
        "--detached-grace-s",
        type=float,
        default=RunnerConfig().detached_grace_s,
        help="how long a session whose stream ended without close waits for a resume",
    )
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
        "--no-turn-failover",
        action="store_true",
        help="do not keep turns' input to replay on another worker: a lost worker fails the turn "
        "(models that can be replayed keep it by default)",
    )
    p.add_argument(
        "--restart-timeout-s",
        type=float,
        default=RunnerConfig().restart_timeout_s,
        help="a reply restarted on another worker after its worker was lost fails "
        "(worker_unavailable) unless its first audio comes within this long",
    )
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
        "--worker-write-coalesce-ms",
        type=float,
        default=ServiceConfig(plugin="", workers=()).worker_write_coalesce_ms,
        help="wait up to this long for more submissions to share a command to a worker (0 = none)",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=ServiceConfig(plugin="", workers=()).event_loop,
        help="the asyncio event loop (auto: uvloop where installed)",
    )
    trust = p.add_argument_group(
        "TLS and authentication",
        "Without --auth-tokens, --auth-jwks or --tls-client-ca the API is unauthenticated and "
        "listens on loopback only, unless --insecure. The health service needs no credentials.",
    )
    trust.add_argument(
        "--tls-cert", type=Path, metavar="PATH", help="serve TLS with this certificate chain (PEM)"
    )
    trust.add_argument("--tls-key", type=Path, metavar="PATH", help="the private key of --tls-cert (PEM)")
    trust.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="PATH",
        help="require a client certificate signed by this CA (PEM); its identity is the principal",
    )
    trust.add_argument(
        "--auth-tokens",
        type=Path,
        metavar="PATH",
        help="bearer tokens: lines PRINCIPAL:SHA256_HEX (the hex SHA-256 of the token), re-read when changed",
    )
    trust.add_argument(
        "--auth-jwks",
        type=Path,
        metavar="PATH",
        help="JWT bearer tokens verified against this JWKS file (re-read when changed); sub is the principal",
    )
    trust.add_argument("--auth-audience", default="", metavar="AUD", help="the aud a JWT must carry")
    trust.add_argument(
        "--insecure",
        action="store_true",
        help="serve an unauthenticated API on a non-loopback address (otherwise refused)",
    )
    trust.add_argument(
        "--no-reflection", action="store_true", help="do not serve gRPC reflection (authenticated otherwise)"
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


def _tls(p: argparse.ArgumentParser, args: argparse.Namespace) -> ServerTLS | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        if args.tls_client_ca is not None:
            p.error("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    return ServerTLS(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)


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


def config_from_args(argv: list[str]) -> ServiceConfig:
    p = _parser()
    args = p.parse_args(argv)
    tls = _tls(p, args)
    if (args.auth_jwks is None) != (not args.auth_audience):
        p.error("--auth-jwks and --auth-audience go together")
    if args.max_workers < 1:
        raise SystemExit("duplex session: --max-workers must be at least 1")
    if args.workers_resolve_interval_s <= 0:
        raise SystemExit("duplex session: --workers-resolve-interval-s must be positive")
    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    stage_workers: dict[str, tuple[str, ...]] = {}
    try:
        parse_workers(workers, max_workers=args.max_workers)
        for spec in args.stage_workers or ():
            name, sep, listed = spec.partition("=")
            if not sep or not name.strip() or name.strip() in stage_workers:
                raise WorkersSpecError(f"--stage-workers takes STAGE=WORKERS, once per stage: {spec!r}")
            stage_workers[name.strip()] = tuple(w.strip() for w in listed.split(",") if w.strip())
            parse_workers(stage_workers[name.strip()], max_workers=args.max_workers)
    except WorkersSpecError as exc:
        raise SystemExit(f"duplex session: {exc}") from exc
    try:
        split_host_port(args.listen)
        event_loop_name(args.event_loop)
    except ValueError as exc:
        raise SystemExit(f"duplex session: {exc}") from exc
    if args.resume_max_age_s <= 0:
        raise SystemExit("duplex session: --resume-max-age-s must be positive")
    if args.max_unconsumed_input_ms < 0:
        raise SystemExit("duplex session: --max-unconsumed-input-ms must not be negative")
    if args.worker_stall_timeout_s < 0:
        raise SystemExit("duplex session: --worker-stall-timeout-s must not be negative")
    if not 0 <= args.worker_write_coalesce_ms <= 50:
        raise SystemExit("duplex session: --worker-write-coalesce-ms must be within 0..50")
    if args.max_sessions < 1 or args.idle_timeout_s <= 0:
        raise SystemExit("duplex session: --max-sessions and --idle-timeout-s must be positive")
    if min(args.max_concurrent_rpcs, args.max_streams_per_connection, args.max_calls_per_principal) < 0:
        raise SystemExit(
            "duplex session: --max-concurrent-rpcs, --max-calls-per-principal and "
            "--max-streams-per-connection must not be negative"
        )
    if args.max_session_buffer_bytes < 64 * 1024:
        raise SystemExit("duplex session: --max-session-buffer-bytes must be at least 65536")
    if args.detached_grace_s < 0:
        raise SystemExit("duplex session: --detached-grace-s must not be negative")
    if args.open_timeout_s <= 0:
        raise SystemExit("duplex session: --open-timeout-s must be positive")
    if args.max_sessions_per_principal < 0:
        raise SystemExit("duplex session: --max-sessions-per-principal must not be negative")
    try:
        resume_keys = ResumeKeys.from_environment()
    except DuplexError as err:
        raise SystemExit(f"duplex session: {err.message}") from err
    worker_tls = _worker_tls(args)
    return ServiceConfig(
        plugin=args.plugin,
        workers=workers,
        stage_workers=tuple(stage_workers.items()),
        workers_resolve_interval_s=args.workers_resolve_interval_s,
        max_workers=args.max_workers,
        listen=args.listen,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_sessions=args.max_sessions,
        max_sessions_per_principal=args.max_sessions_per_principal,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_calls_per_principal=args.max_calls_per_principal,
        open_timeout_s=args.open_timeout_s,
        max_streams_per_connection=args.max_streams_per_connection,
        # From the environment only (DUPLEX_RESUME_SECRETS): a secret in argv is in every
        # process listing.
        resume_keys=resume_keys,
        resume_max_age_s=args.resume_max_age_s,
        replica_id=args.replica_id or f"session-{uuid.uuid4().hex[:12]}",
        drain_grace_s=args.drain_grace_s,
        worker_stall_timeout_s=args.worker_stall_timeout_s,
        worker_write_coalesce_ms=args.worker_write_coalesce_ms,
        event_loop=args.event_loop,
        tls=tls,
        auth_tokens=args.auth_tokens,
        auth_jwks=args.auth_jwks,
        auth_audience=args.auth_audience,
        insecure=args.insecure,
        health_listen=args.health_listen,
        reflection=not args.no_reflection,
        worker_tls=worker_tls,
        runner=RunnerConfig(
            idle_timeout_s=args.idle_timeout_s,
            silence_continuation=not args.no_silence_continuation,
            turn_failover=not args.no_turn_failover,
            restart_timeout_s=args.restart_timeout_s,
            max_unconsumed_input_ms=args.max_unconsumed_input_ms,
            max_buffer_bytes=args.max_session_buffer_bytes,
            detached_grace_s=args.detached_grace_s,
        ),
    )


def check_trust(cfg: ServiceConfig) -> None:
    """Refuse what the service would refuse at start, before anything runs: TLS files (its own,
    and those towards the workers) that cannot be read, a token or JWKS file that cannot be used
    (a malformed line is named by its number), an unauthenticated API on anything but loopback
    without --insecure. Raises ``DuplexError`` (``invalid_config``)."""
    from duplex.tls import ChannelCredentials, server_credentials
    from session_service.trust.auth import authenticator_for

    authenticator_for(cfg, warn=False)  # the server warns when it starts
    if cfg.tls is not None:
        server_credentials(cfg.tls)  # readable
        _check_pem(cfg.tls)
    if cfg.worker_tls is not None:
        ChannelCredentials(cfg.worker_tls)  # readable


def _check_pem(tls: ServerTLS) -> None:
    """The TLS files hold what they should (gRPC would only fail each handshake)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    def bad(flag: str, path: Path, what: str) -> BadRequestError:
        return BadRequestError(ErrorCode.INVALID_CONFIG, f"{flag} {path}: {what}")

    try:
        chain = x509.load_pem_x509_certificates(tls.cert.read_bytes())
    except ValueError:
        raise bad("--tls-cert", tls.cert, "not a PEM certificate chain") from None
    try:
        key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise bad("--tls-key", tls.key, "not an unencrypted PEM private key") from None
    if chain[0].public_key() != key.public_key():
        raise bad("--tls-key", tls.key, "is not the key of --tls-cert")
    if tls.client_ca is not None:
        try:
            x509.load_pem_x509_certificates(tls.client_ca.read_bytes())
        except ValueError:
            raise bad("--tls-client-ca", tls.client_ca, "not a PEM certificate") from None


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    try:
        plugin = load_plugin(cfg.plugin)
        check_trust(cfg)
    except DuplexError as err:
        print(f"duplex session: {err.message}", file=sys.stderr)
        return 2
    from session_service.api.server import run  # the server only once the arguments are good

    return run(cfg, plugin)


if __name__ == "__main__":
    sys.exit(main())
