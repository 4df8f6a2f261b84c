"""Configuration of the session service, as frozen dataclasses built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from duplex.serving import EVENT_LOOPS
from duplex.tls import ClientTLS, ServerTLS
from session_service.trust.resume_tokens import DEFAULT_MAX_AGE_S, ResumeKeys


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """What one session runner needs to know about its limits."""

    idle_timeout_s: float = 300.0
    """Close a session after this many seconds without client events and without an active response."""
    coalesce_acks: bool = True
    """Fold an ``input_ack`` into one still queued for the client (same epoch, not yet written):
    acks are cumulative, so a client that reads behind its appends gets one message for them,
    not one each. Off: an ack per append (unit tests of the ack window read each one)."""
    mailbox_size: int = 256
    """Client events queued per session before the reader waits (backpressure to the client)."""
    outbound_limit: int = 8192
    """Server events queued per session; a client that falls further behind is disconnected."""
    max_buffer_bytes: int = 4 * 1024 * 1024
    """Bytes queued per session in each direction: client events waiting in the mailbox (the
    client is then read no further: backpressure), and server events waiting for the client (in
    the client's output format, so upsampled sizes count; a client that falls further behind is
    cut off as a slow consumer). The turn's input kept for failover (``session_service.session.replay``)
    is bounded by it too, twice over (committed input, and input since): at most the plugin's
    ``replay_window_s`` of worker audio each (parrot: 15 s, ~480 KB). A session holds at most
    twice this plus that."""
    detached_grace_s: float = 30.0
    """How long a session whose stream ended without ``close`` waits for a resume before it is
    closed for good (capacity comes back; its token is then dead)."""
    submit_timeout_s: float = 5.0
    """How long an append waits for its submission to be written to the worker stream (looked at
    about once a second, not timed per append: it fails within a second after)."""
    max_silence_frames: int = 940
    """Silence frames fed per response at most (about 30 s of 32 ms frames)."""
    silence_continuation: bool = True
    """Feed real-time silence while a response plays and the client sends no audio, so worker
    turn detection (barge-in) keeps running."""
    max_unconsumed_input_ms: int = 2000
    """Backpressure through input acks: while more than this much audio (in worker frames) has
    been handed to the worker but not yet consumed by it (``RequestUpdate.input_seq``), input
    acks are held and released as the worker catches up. A client that waits for acks then
    never overruns the worker's per-request input queue. 0 = ack on hand-off, never hold."""
    turn_failover: bool = True
    """When the model can be replayed (``DuplexModelPlugin.replayable``): keep the current
    turn's input so that a worker lost mid-turn costs the user nothing (``session_service.session.replay``);
    off, a lost worker fails the turn."""
    restart_timeout_s: float = 3.0
    """A response restarted on another worker after its worker was lost must send its first audio
    within this long of its ``response_started`` (the replay of the turn's input, then the model's
    own latency), or it ends ``response_done{FAILED, worker_unavailable}``: a caller waits a
    bounded time, never on silence (looked at about once a second: it fails within a second
    after)."""

    def __post_init__(self) -> None:
        if not self.restart_timeout_s > 0:
            raise ValueError("restart_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class EvictionLimits:
    """Evictions (``session_service.workers.eviction``) waiting for a worker not reachable from this
    replica: how many, and for how long."""

    max_pending: int = 4096
    """Evictions waiting for a worker not reachable from this replica, at most; beyond it the
    oldest is dropped (counted ``dropped``). As many as a worker link keeps releases."""
    ttl_s: float = 300.0
    """How long an eviction waits for its worker (counted ``expired`` after): well beyond what
    a previous owner holds a session it lost (a replica's detached grace, a worker's orphan
    grace: 30 s by default)."""

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if not self.ttl_s > 0:
            raise ValueError("ttl_s must be > 0")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """The whole process: where it listens, which workers it drives, which plugin it loads."""

    plugin: str
    """Dotted path of the model plugin, ``module:Class`` or ``module.Class``."""
    workers: tuple[str, ...]
    """Worker addresses (``HOST:PORT``), or ONE ``dns:[//DNS_SERVER[:PORT]/]NAME:PORT`` target whose
    A and AAAA records are the workers, re-resolved while the service runs
    (``session_service.workers.discovery``). Placement ranks workers by their own ids, so replicas agree
    whatever addresses each one dials."""
    stage_workers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """A plugin served in stages (``DuplexModelPlugin.stages``): the workers of each stage after
    the first, by stage name, each as ``workers`` is (a list, or one ``dns:`` target), each its
    own pool. The first stage's are ``workers``."""
    workers_resolve_interval_s: float = 10.0
    """With a ``dns:`` target: how often its name is resolved again (also at once, at most once a
    second, when a worker link is lost)."""
    max_workers: int = 64
    """Most worker links: a longer static list is refused, a DNS answer is cut to this many."""
    listen: str = "127.0.0.1:50051"
    """gRPC listen address; port 0 picks a free port."""
    metrics_host: str = "127.0.0.1"
    """Host of the Prometheus ``/metrics`` endpoint."""
    metrics_port: int = 9464
    """Port of the ``/metrics`` endpoint; 0 picks a free port, -1 serves none (in-process tests)."""
    max_sessions: int = 256
    """Most concurrent sessions this replica accepts (RESOURCE_EXHAUSTED beyond)."""
    resume_max_age_s: float = DEFAULT_MAX_AGE_S
    """How long a resume token stays valid after it was issued (``go_away`` and resumes hand out
    fresh ones)."""
    resume_keys: ResumeKeys | None = None
    """Keys of resume tokens (the first encrypts, all decrypt); replicas that share them resume
    each other's sessions. None: a random key of this process (tokens work on this replica only)."""
    replica_id: str = ""
    """This replica's owner id towards the workers (unique per process)."""
    drain_grace_s: float = 10.0
    """On SIGTERM, how long in-flight responses may run before sessions are closed."""
    open_timeout_s: float = 5.0
    """How long a new stream may take to send its open (or resume): an unopened call holds a
    call slot of its caller (``max_calls_per_principal``) for at most this long."""
    attach_timeout_s: float = 5.0
    """Deadline of a worker Attach call."""
    worker_backoff_max_s: float = 5.0
    """Longest wait between reconnect attempts to a lost worker."""
    worker_stall_timeout_s: float = 3.0
    """Application-level liveness of a worker link: when the worker owes output (APPENDs not yet
    reported consumed, a COMMIT not yet answered, a free-running model's RESPOND not yet
    stepped) and has sent no ``StepOutput`` for this long, the link is treated as lost, like a
    dropped stream (its sessions get ``worker_unavailable`` and move on their next submission;
    the link reconnects with backoff). Catches a hung worker (SIGSTOP, a wedged GPU, a
    deadlocked engine) long before TCP/HTTP2 keepalive would. An idle link is never stalled.
    Keep it above the worker's slowest model step. 0 turns the check off."""
    worker_write_coalesce_ms: float = 2.0
    """How long a worker link, once it has something to send, waits for more before it writes
    the ``WorkerCommand``: appends of sessions that arrive within the window travel in one
    message and are stepped in one batch. Every message costs a syscall and a wake-up on both
    ends, so this trades up to this much hop latency for CPU on both tiers (``make bench``
    measures both). 0 writes at once. On uvloop (``event_loop``) the wait is rounded to whole
    milliseconds."""
    event_loop: str = "auto"
    """The asyncio event loop the service runs on (``duplex.serving.EVENT_LOOPS``): ``uvloop``,
    ``asyncio`` (the standard library's), or ``auto``: uvloop where it is installed. Each
    session-frame wakes several tasks and futures, and gRPC hands every completed read and write
    to the loop: uvloop does each for less CPU (about 5 % of the session service's, measured by
    hand with this flag: docs/operations.md, "The event loop"). Its timers count whole milliseconds."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Per-session limits."""
    tls: ServerTLS | None = None
    """TLS of the session API; with ``client_ca``, clients must present a certificate signed by
    it, and its identity is their principal."""
    auth_tokens: Path | None = None
    """Bearer tokens: a file of ``PRINCIPAL:SHA256_HEX`` lines (the hex SHA-256 of each token),
    re-read when it changes."""
    auth_jwks: Path | None = None
    """JWT bearer tokens verified against this local JWKS file (with ``auth_audience``)."""
    auth_audience: str = ""
    """The ``aud`` a JWT must carry."""
    insecure: bool = False
    """Serve without authentication on a non-loopback address (otherwise refused at start)."""
    reflection: bool = True
    """Serve gRPC server reflection (authenticated like the API)."""
    max_sessions_per_principal: int = 0
    """Most sessions one principal holds on this replica (RESOURCE_EXHAUSTED beyond; 0 = only
    ``max_sessions``)."""
    max_concurrent_rpcs: int = 0
    """Authenticated calls in progress at once (streams that have not opened yet count too);
    beyond it a new call is refused with RESOURCE_EXHAUSTED ``too_many_calls`` before its
    handler runs (``session_service.api.admission``). 0: twice ``max_sessions`` plus 64 (resumes
    overlapping the streams they replace)."""
    max_calls_per_principal: int = 0
    """Calls one principal may have in progress at once, opened or not (RESOURCE_EXHAUSTED
    ``too_many_calls`` beyond): one caller's idle calls cannot take the slots of another's
    opens. 0: twice ``max_sessions_per_principal`` plus 16 when that is set, else
    ``max_sessions`` plus 16; always below ``max_concurrent_rpcs``. Without authentication every
    caller is one and the same: only ``max_concurrent_rpcs`` applies."""
    max_streams_per_connection: int = 0
    """HTTP/2 streams one client connection may hold open (``grpc.max_concurrent_streams``).
    0: ``max_sessions`` plus 16, so one backend multiplexing all its calls on one connection
    can still use the whole replica."""
    health_listen: str = ""
    """``HOST:PORT`` of a plaintext listener serving only ``grpc.health.v1`` (for probes that
    cannot speak TLS); "" = none."""
    worker_tls: ClientTLS | None = None
    """Mutual TLS towards the workers (the CA that signed them, this replica's certificate)."""
    evictions: EvictionLimits = field(default_factory=EvictionLimits)
    """How many evictions (a resumed session moved off the worker its token names, which is
    told to drop it) wait for a worker not reachable from this replica, and for how long."""

    @property
    def concurrent_rpcs(self) -> int:
        """``max_concurrent_rpcs`` with its default applied."""
        return self.max_concurrent_rpcs or 2 * self.max_sessions + 64

    @property
    def calls_per_principal(self) -> int:
        """``max_calls_per_principal`` with its default applied."""
        if self.max_calls_per_principal:
            return self.max_calls_per_principal
        per = self.max_sessions + 16
        if self.max_sessions_per_principal:
            per = 2 * self.max_sessions_per_principal + 16
        return max(1, min(per, self.concurrent_rpcs - 1))

    @property
    def streams_per_connection(self) -> int:
        """``max_streams_per_connection`` with its default applied."""
        return self.max_streams_per_connection or self.max_sessions + 16

    def __post_init__(self) -> None:
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}")
