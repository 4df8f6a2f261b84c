"""``duplex realtime``: the OpenAI Realtime API over WebSocket and WebRTC, in front of a session
service, and a page to talk in at ``/``.

Announces itself with one JSON line on stdout (``{"event": "listening", "realtime": HOST:PORT,
"metrics": HOST:PORT, ...}``); SIGTERM or SIGINT drains it (new connections refused, open ones
given ``--drain-grace-s``, then closed with 1001).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
from pathlib import Path
from typing import Any

from duplex.errors import DuplexError
from duplex.serving import (
    EVENT_LOOPS,
    run_service,
    running_loop_name,
    serve_metrics,
    settle_heap,
    split_host_port,
    stop_signals,
)
from duplex.tls import ClientTLS, is_loopback
from realtime_service import cors
from realtime_service.client_secrets import SecretKeys
from realtime_service.connection import Limits
from realtime_service.server import EdgeConfig, EdgeServer
from session_service.trust.auth import Authenticator, JwksVerifier, TokenFile

log = logging.getLogger("duplex.realtime")

DEFAULT_PORT = 8765


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplex realtime",
        description="Serve the OpenAI Realtime API (GA events) over WebSocket at /v1/realtime and WebRTC "
        "at /v1/realtime/calls, each connection or call a session of the session service (many on one "
        "ConverseMany stream), and a page to talk in at /.",
    )
    p.add_argument(
        "--listen", default=f"127.0.0.1:{DEFAULT_PORT}", help="HTTP and WebSocket HOST:PORT (port 0 = any)"
    )
    p.add_argument("--session", default="127.0.0.1:50051", help="the session service's HOST:PORT")
    p.add_argument("--model", default="", help="model for a URL that names none (default: the service's)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=9466, help="/metrics port (0 = any)")
    p.add_argument("--max-connections", type=int, default=1024, help="WebSockets held at once (0 = no bound)")
    p.add_argument(
        "--max-connections-per-principal",
        type=int,
        default=64,
        help="WebSockets one principal holds (0 = no bound)",
    )
    p.add_argument(
        "--max-message-bytes", type=int, default=1024 * 1024, help="largest client frame (closes 1009)"
    )
    p.add_argument(
        "--max-queued-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="output queued for a client that does not read before it is cut off (1008)",
    )
    p.add_argument(
        "--idle-timeout-s", type=float, default=300.0, help="close after this long without client events"
    )
    p.add_argument("--drain-grace-s", type=float, default=10.0)
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a page origin (https://app.example.com) that may call /v1/realtime/calls and "
        "/client_secrets; repeat for more (none by default but the edge's own page)",
    )
    rtc = p.add_argument_group(
        "WebRTC",
        "Calls (POST /v1/realtime/calls): the media is UDP on the addresses and ports below, one port "
        "per call and address.",
    )
    rtc.add_argument("--max-calls", type=int, default=64, help="WebRTC calls held at once (0 = no bound)")
    rtc.add_argument(
        "--max-calls-per-principal",
        type=int,
        default=8,
        help="WebRTC calls one principal holds (0 = no bound)",
    )
    rtc.add_argument(
        "--webrtc-address",
        action="append",
        default=[],
        metavar="IP",
        help="a local address ICE offers (repeat for more; default: the --listen address, or every "
        "interface's when it is 0.0.0.0)",
    )
    rtc.add_argument(
        "--webrtc-ports",
        default="",
        metavar="LOW-HIGH",
        help="UDP port range of the calls' media (default: any)",
    )
    rtc.add_argument(
        "--webrtc-public-address",
        default="",
        metavar="IP",
        help="the address candidates announce instead of the local one (a 1:1 NAT in front of the edge)",
    )
    rtc.add_argument(
        "--webrtc-connect-timeout-s",
        type=float,
        default=10.0,
        help="ICE and DTLS must complete this long after the answer, or the call ends",
    )
    rtc.add_argument(
        "--webrtc-media-timeout-s",
        type=float,
        default=10.0,
        help="a call from whose browser nothing arrives this long has vanished and ends",
    )
    rtc.add_argument(
        "--client-secret-keys",
        type=Path,
        metavar="PATH",
        help="KID:SECRET lines sealing client secrets, the same on every replica (default: a random "
        "key of this process)",
    )
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto")
    trust = p.add_argument_group(
        "TLS and credentials",
        "The bearer token a client sends (the SDKs' api_key) is passed through to the session "
        "service, which checks it. With --auth-tokens or --auth-jwks (the session service's files) "
        "the edge checks it too, before the WebSocket opens, and bounds connections per principal.",
    )
    trust.add_argument(
        "--tls-cert", type=Path, metavar="PATH", help="serve wss:// with this certificate chain"
    )
    trust.add_argument("--tls-key", type=Path, metavar="PATH", help="the private key of --tls-cert")
    trust.add_argument(
        "--auth-tokens", type=Path, metavar="PATH", help="token file (PRINCIPAL:SHA256_HEX lines)"
    )
    trust.add_argument("--auth-jwks", type=Path, metavar="PATH", help="JWKS file for JWT bearer tokens")
    trust.add_argument("--auth-audience", default="", metavar="AUD", help="the aud a JWT must carry")
    trust.add_argument("--session-ca", type=Path, metavar="PATH", help="TLS to the session service: its CA")
    trust.add_argument("--session-cert", type=Path, metavar="PATH", help="client certificate towards it")
    trust.add_argument("--session-key", type=Path, metavar="PATH", help="its private key")
    trust.add_argument(
        "--insecure", action="store_true", help="serve plaintext ws:// on an address that is not loopback"
    )
    return p


def config_from_args(args: argparse.Namespace) -> EdgeConfig:
    """Raises ValueError for arguments that cannot work together."""
    host, port = split_host_port(args.listen)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None and not is_loopback(host) and not args.insecure:
        raise ValueError(f"{host} is not loopback: serve TLS (--tls-cert/--tls-key) or pass --insecure")
    for name in ("max_connections", "max_connections_per_principal"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_message_bytes < 1024 or args.max_queued_bytes < 64 * 1024 or args.idle_timeout_s <= 0:
        raise ValueError("--max-message-bytes >= 1024, --max-queued-bytes >= 65536, --idle-timeout-s > 0")
    for origin in args.cors_origin:
        cors.normalize(origin)
    session_tls = None
    if args.session_ca is not None:
        session_tls = ClientTLS(ca=args.session_ca, cert=args.session_cert, key=args.session_key)
    return EdgeConfig(
        listen_host=host,
        listen_port=port,
        session_target=args.session,
        model=args.model,
        limits=Limits(idle_timeout_s=args.idle_timeout_s, max_queued_bytes=args.max_queued_bytes),
        max_connections=args.max_connections,
        max_connections_per_principal=args.max_connections_per_principal,
        max_message_bytes=args.max_message_bytes,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        session_tls=session_tls,
        drain_grace_s=args.drain_grace_s,
        cors_origins=tuple(args.cors_origin),
        calls=call_settings(args, host),
        client_secret_keys=SecretKeys.from_file(args.client_secret_keys) if args.client_secret_keys else None,
    )


def ice_addresses(args: argparse.Namespace, listen_host: str) -> tuple[str, ...]:
    """``--webrtc-address``, else the --listen address (every interface's for 0.0.0.0)."""
    from realtime_service.webrtc.ice import host_addresses

    if args.webrtc_address:
        return tuple(args.webrtc_address)
    host = listen_host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return host_addresses()
    if host == "localhost":
        return ("127.0.0.1",)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host_addresses()
    return (host,)


def call_settings(args: argparse.Namespace, listen_host: str) -> Any:
    """The ``CallSettings`` of the flags (None where aiortc is not installed: WebRTC is off)."""
    try:
        from realtime_service.webrtc.calls import CallSettings
        from realtime_service.webrtc.ice import IcePolicy, parse_ports
    except ImportError:
        if args.webrtc_address or args.webrtc_ports or args.webrtc_public_address:
            raise ValueError("--webrtc-* flags need WebRTC: pip install 'duplex-serving[webrtc]'") from None
        return None
    for name in ("max_calls", "max_calls_per_principal"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.webrtc_connect_timeout_s <= 0 or args.webrtc_media_timeout_s <= 0:
        raise ValueError("--webrtc-connect-timeout-s and --webrtc-media-timeout-s must be > 0")
    policy = IcePolicy(
        addresses=ice_addresses(args, listen_host),
        ports=parse_ports(args.webrtc_ports) if args.webrtc_ports else None,
        public_address=args.webrtc_public_address,
    )
    return CallSettings(
        max_calls=args.max_calls,
        max_calls_per_principal=args.max_calls_per_principal,
        ice=policy,
        connect_timeout_s=args.webrtc_connect_timeout_s,
        media_timeout_s=args.webrtc_media_timeout_s,
    )


def authenticator(args: argparse.Namespace) -> Authenticator:
    if args.auth_audience and args.auth_jwks is None:
        raise ValueError("--auth-audience needs --auth-jwks")
    return Authenticator(
        tokens=TokenFile(args.auth_tokens) if args.auth_tokens is not None else None,
        jwks=JwksVerifier(args.auth_jwks, args.auth_audience) if args.auth_jwks is not None else None,
    )


async def serve(config: EdgeConfig, auth: Authenticator, metrics_host: str, metrics_port: int) -> int:
    server = EdgeServer(config, auth)
    port = await server.start()
    metrics = serve_metrics(metrics_host, metrics_port)
    settle_heap()
    announce = {
        "event": "listening",
        "realtime": f"{config.listen_host}:{port}",
        "metrics": f"{metrics_host}:{metrics.port}",
        "event_loop": running_loop_name(),
    }
    print(json.dumps(announce), flush=True)
    log.info(
        "Realtime API at %s://%s:%d/v1/realtime (WebRTC: /v1/realtime/calls, %s; the page: /) "
        "-> session service %s",
        "wss" if config.tls_cert else "ws",
        config.listen_host,
        port,
        "on" if server.calls is not None else "off",
        config.session_target,
    )
    with stop_signals() as stop:
        await stop.wait()
        await server.drain()
    metrics.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        auth = authenticator(args)
    except (ValueError, OSError, DuplexError) as exc:
        print(f"duplex realtime: {exc}", file=sys.stderr)
        return 2
    return run_service(serve(config, auth, args.metrics_host, args.metrics_port), args.event_loop)


if __name__ == "__main__":
    sys.exit(main())
