"""``duplex worker``: run one worker process (see docs/worker-protocol.md for the contract)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from duplex.errors import DuplexError
from duplex.serving import (
    EVENT_LOOPS,
    event_loop_name,
    run_service,
    running_loop_name,
    settle_heap,
    split_host_port,
    stop_signals,
)
from duplex.tls import ServerTLS
from worker_service.config import (
    CLOCKS,
    DEFAULT_ATTACH_LEASE_S,
    DEFAULT_LLM_CONCURRENCY,
    DEFAULT_LLM_TIMEOUT_S,
    DEFAULT_MAX_CLOSED_SESSIONS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_TOMBSTONE_TTL_S,
    LLM_KEY_ENV,
    WorkerConfig,
)
from worker_service.models import MODELS
from worker_service.server import WorkerServer

logger = logging.getLogger("worker_service")

#: ``--max-sessions`` of ``--model moshi`` when unset: its batch slots (each costs compute).
DEFAULT_MOSHI_SLOTS = 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duplex worker", description="Run a batched model worker (gRPC).")
    p.add_argument("--model", choices=sorted(MODELS), default="parrot")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC HOST:PORT (port 0 = any free port)")
    p.add_argument(
        "--health-listen",
        default="",
        metavar="HOST:PORT",
        help="also serve grpc.health.v1 (and nothing else) in plaintext here, for probes that cannot "
        "speak TLS (default: none)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = any free port)")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda[:i]")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument(
        "--clock",
        choices=CLOCKS,
        default="frame",
        help="the engine's schedule: frame = one model step per frame period for every session "
        "with a frame ready (default; the largest batches, at most one frame period more latency "
        "per hop); free = a step as soon as input is queued (see --step-interval-ms)",
    )
    p.add_argument(
        "--step-interval-ms",
        type=float,
        default=0.0,
        help="with --clock free: least time between the starts of two model steps: inputs "
        "arriving within it share one step (larger batches, less CPU per frame, up to this much "
        "more latency); 0 = step as soon as any input is queued (default)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="most sessions attached at once; an Attach beyond it is refused with "
        "RESOURCE_EXHAUSTED capacity_exhausted (retryable: the session service tries the next "
        f"worker). Unset: {DEFAULT_MAX_SESSIONS}, four session replicas' worth at their default "
        "--max-sessions, about what one worker keeps real-time at --max-batch 256 (moshi: "
        f"{DEFAULT_MOSHI_SLOTS}, its batch slots); 0 = unbounded (not for moshi)",
    )
    p.add_argument(
        "--max-tick-load",
        type=float,
        default=WorkerConfig().max_tick_load,
        help="refuse new sessions (capacity_exhausted) when the measured tick says one more would "
        "take more than this share of the frame period (0 = no bound)",
    )
    p.add_argument("--max-queued-frames", type=int, default=1024, help="per-request input queue bound")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--drain-grace-s", type=float, default=5.0)
    p.add_argument(
        "--orphan-grace-s",
        type=float,
        default=30.0,
        help="release an owner's sessions this long after its last Run stream ended",
    )
    p.add_argument(
        "--attach-lease-s",
        type=float,
        default=DEFAULT_ATTACH_LEASE_S,
        help="release an attached session that got no submission or abort within this time "
        "of its Attach when its owner has no Run stream then (an owner that attached and never "
        f"came to use it); 0 = never; default {DEFAULT_ATTACH_LEASE_S:g} s",
    )
    p.add_argument("--torch-threads", type=int, default=0, help="0 = torch's default")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=WorkerConfig().event_loop,
        help="the asyncio event loop (auto: uvloop where installed)",
    )
    trust = p.add_argument_group(
        "trust",
        "mutual TLS: callers (session replicas) present a certificate of the client CA, and the "
        "worker authorizes every session by its identity. Without TLS the worker serves only on "
        "a loopback address unless --insecure is given.",
    )
    trust.add_argument("--tls-cert", type=Path, default=None, metavar="PATH", help="server certificate (PEM)")
    trust.add_argument("--tls-key", type=Path, default=None, metavar="PATH", help="its private key (PEM)")
    trust.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        metavar="PATH",
        help="CA whose client certificates are required (mutual TLS)",
    )
    trust.add_argument(
        "--insecure",
        action="store_true",
        help="serve without client authentication on a non-loopback address (anyone who reaches "
        "the port can drive and take sessions)",
    )
    trust.add_argument(
        "--takeover-identities",
        default=None,
        metavar="ID[,ID...]",
        help="certificate identities allowed to take sessions over (default: those of "
        "--session-identities; neither given: any the client CA signed)",
    )
    trust.add_argument(
        "--session-identities",
        default=None,
        metavar="ID[,ID...]",
        help="certificate identities allowed to own sessions at all (Attach, Run, Release): the session "
        "tier's; any other is refused with PERMISSION_DENIED (default: those of --takeover-identities; "
        "neither given: any the client CA signed)",
    )
    trust.add_argument(
        "--tombstone-ttl-s",
        type=float,
        default=DEFAULT_TOMBSTONE_TTL_S,
        help="how long a session closed for good stays refused (default: 24 h, the resume token lifetime)",
    )
    trust.add_argument(
        "--max-closed-sessions",
        type=int,
        default=DEFAULT_MAX_CLOSED_SESSIONS,
        help="most closed-session tombstones kept (the oldest are forgotten first)",
    )
    parrot = p.add_argument_group("parrot model")
    parrot.add_argument("--silence-ms", type=float, default=None)
    parrot.add_argument("--pitch-semitones", type=float, default=None)
    parrot.add_argument("--threshold", type=float, default=None)
    parrot.add_argument("--no-auto-commit", action="store_true")
    moshi = p.add_argument_group(
        "moshi model",
        "Kyutai's Moshi and models of its layout (PersonaPlex-class), model-native full duplex, "
        "served in a fixed batch of --max-sessions slots",
    )
    moshi.add_argument(
        "--checkpoint",
        default=None,
        metavar="REPO_OR_DIR",
        help="a Hugging Face repo id (fetched into the Hugging Face cache) or a local directory in "
        "its layout (config.json, LM and Mimi weights, tokenizer); `duplex moshi-checkpoint DIR` "
        "writes a small random one",
    )
    moshi.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature of text and audio (0 = greedy; unset: the checkpoint's own)",
    )
    moshi.add_argument(
        "--top-k", type=int, default=None, help="top-k of text and audio (unset: the checkpoint's)"
    )
    moshi.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the LM's dtype (auto: float32 on a CPU, bfloat16 on a GPU)",
    )
    chat = p.add_argument_group(
        "chat model",
        "a chat stage (--model chat): a language model on any OpenAI-compatible chat server "
        "(vLLM, SGLang, ...), streamed over /v1/chat/completions. The API key is read from "
        f"--llm-key-file, else from the environment variable {LLM_KEY_ENV} (never a flag value: "
        "process lists show those); neither: no key",
    )
    chat.add_argument(
        "--llm-url",
        default=None,
        metavar="URL",
        help="the server's API base URL, e.g. http://127.0.0.1:8000/v1",
    )
    chat.add_argument("--llm-model", default=None, metavar="NAME", help="the model the server serves")
    chat.add_argument(
        "--llm-key-file", default=None, metavar="PATH", help="a file whose first line is the server's API key"
    )
    chat.add_argument(
        "--llm-timeout-s",
        type=float,
        default=DEFAULT_LLM_TIMEOUT_S,
        help="the longest the server may take to answer, and then to send each next piece; also the "
        "longest a request waits for a free slot (past it the turn fails upstream_unavailable, "
        "retryable; default: %(default)s)",
    )
    chat.add_argument(
        "--llm-concurrency",
        type=int,
        default=DEFAULT_LLM_CONCURRENCY,
        help="requests this worker streams from the server at once (default: %(default)s)",
    )
    synth = p.add_argument_group("synthetic model")
    synth.add_argument("--hidden-size", type=int, default=None)
    synth.add_argument("--layers", type=int, default=None)
    synth.add_argument("--emit-every", type=int, default=None)
    synth.add_argument("--reply-frames", type=int, default=None)
    synth.add_argument(
        "--inject-invalid-sparse",
        action="store_true",
        help="fault injection (to test alerting): every audio step declares an invalid sparse "
        "marker, so it fails closed and is counted; never in production",
    )
    return p


def _tls_from_args(args: argparse.Namespace) -> ServerTLS | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    return ServerTLS(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)


def _identities(value: str | None, flag: str) -> frozenset[str] | None:
    if value is None:
        return None
    ids = frozenset(i.strip() for i in value.split(",") if i.strip())
    if not ids:
        raise ValueError(f"{flag} needs at least one identity")
    return ids


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    split_host_port(args.listen)  # validates HOST:PORT
    event_loop_name(args.event_loop)  # uvloop asked for where it is not installed
    max_sessions = args.max_sessions
    if max_sessions is None:
        max_sessions = DEFAULT_MOSHI_SLOTS if args.model == "moshi" else DEFAULT_MAX_SESSIONS
    if args.model == "moshi":
        if not args.checkpoint:
            raise ValueError("--model moshi needs --checkpoint REPO_OR_DIR")
        if max_sessions < 1:
            raise ValueError("--model moshi needs --max-sessions of at least 1 (its batch slots)")
        moshi: dict[str, object] = {"checkpoint": args.checkpoint, "slots": max_sessions, "dtype": args.dtype}
        if args.temperature is not None:
            moshi["temperature"] = args.temperature
        if args.top_k is not None:
            moshi["top_k"] = args.top_k
    elif args.checkpoint or args.temperature is not None or args.top_k is not None or args.dtype != "auto":
        raise ValueError("--checkpoint, --temperature, --top-k and --dtype are options of --model moshi")
    chat_flags = args.llm_url is not None or args.llm_model is not None or args.llm_key_file is not None
    if args.model != "chat" and chat_flags:
        raise ValueError("--llm-url, --llm-model and --llm-key-file are options of --model chat")
    if args.model == "moshi":
        options: dict[str, object] = moshi
    elif args.model == "chat":
        if not args.llm_url or not args.llm_model:
            raise ValueError("--model chat needs --llm-url URL and --llm-model NAME")
        options = {
            "url": args.llm_url,
            "model": args.llm_model,
            "api_key_file": args.llm_key_file or "",
            "timeout_s": args.llm_timeout_s,
            "concurrency": args.llm_concurrency,
        }
    elif args.model == "parrot":
        keys = {
            "silence_ms": args.silence_ms,
            "pitch_semitones": args.pitch_semitones,
            "threshold": args.threshold,
        }
        options = {k: v for k, v in keys.items() if v is not None}
        if args.no_auto_commit:
            options["auto_commit"] = False
    else:
        keys = {
            "hidden_size": args.hidden_size,
            "layers": args.layers,
            "emit_every": args.emit_every,
            "reply_frames": args.reply_frames,
        }
        options = {k: v for k, v in keys.items() if v is not None}
        if args.inject_invalid_sparse:
            options["invalid_sparse"] = True
    host = split_host_port(args.listen)[0]
    config = WorkerConfig(
        model=args.model,
        listen=args.listen,
        metrics_host=host,
        metrics_port=args.metrics_port,
        device=args.device,
        max_batch=args.max_batch,
        clock=args.clock,
        step_interval_ms=args.step_interval_ms,
        max_sessions=max_sessions,
        max_tick_load=args.max_tick_load,
        max_queued_frames=args.max_queued_frames,
        drain_grace_s=args.drain_grace_s,
        orphan_grace_s=args.orphan_grace_s,
        attach_lease_s=args.attach_lease_s,
        torch_threads=args.torch_threads,
        model_options=options,
        tls=_tls_from_args(args),
        insecure=args.insecure,
        health_listen=args.health_listen,
        takeover_identities=_identities(args.takeover_identities, "--takeover-identities"),
        session_identities=_identities(args.session_identities, "--session-identities"),
        tombstone_ttl_s=args.tombstone_ttl_s,
        max_closed_sessions=args.max_closed_sessions,
        event_loop=args.event_loop,
    )
    # Without --worker-id the config's own default (a fresh random id) stands.
    return dataclasses.replace(config, worker_id=args.worker_id) if args.worker_id else config


async def serve(config: WorkerConfig) -> int:
    server = WorkerServer(config)
    with stop_signals() as stop:
        await server.start()
        settle_heap()  # the model is loaded: its objects are there for good
        metrics = f"{config.metrics_host}:{server.metrics.port}" if server.metrics else ""
        announce = {
            "event": "listening",
            "grpc": server.address,
            "metrics": metrics,
            "event_loop": running_loop_name(),
        }
        if server.health_port:
            announce["health"] = f"{split_host_port(config.health_listen)[0]}:{server.health_port}"
        print(json.dumps(announce), flush=True)
        model = server.state.model
        assert model is not None
        logger.info(
            "worker %s serving model %s on %s at %s",
            config.worker_id,
            model.model_id,
            model.device,
            server.address,
        )
        await stop.wait()
        logger.info("draining")
        await server.stop()
        logger.info("stopped")
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        return run_service(serve(config), config.event_loop)
    except (DuplexError, ValueError) as exc:
        print(f"duplex worker: {exc}", file=sys.stderr)
        return 2
