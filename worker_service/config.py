"""The worker's configuration: one frozen value built by the CLI (or a test) and read everywhere."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from duplex.serving import EVENT_LOOPS
from duplex.tls import ServerTLS

#: How long a closed session's tombstone is kept by default: the lifetime of a resume token.
DEFAULT_TOMBSTONE_TTL_S = 24 * 3600.0

#: Most closed-session tombstones kept by default.
DEFAULT_MAX_CLOSED_SESSIONS = 65_536

#: Most sessions a worker holds at once by default. Finite so that no caller can make a worker
#: hold state without bound; 1024 is four session replicas' worth at their default of 256
#: sessions each (a worker can take over its peers' sessions after they fail), and at
#: ``max_batch`` 256 it already means each session is stepped only every fourth step, about as
#: many as one worker can keep real-time. Per session the worker keeps model state plus up to
#: ``max_queued_frames`` of queued input (~2 MiB at the default), so this also bounds memory.
DEFAULT_MAX_SESSIONS = 1024

#: How long an attached session may wait for its first submission when its owner has no Run stream.
DEFAULT_ATTACH_LEASE_S = 30.0

#: A chat stage (``--model chat``): where its language model server's API key is read from when
#: no ``--llm-key-file`` is given, how long the server may take (``--llm-timeout-s``) and how many
#: requests one worker streams at once (``--llm-concurrency``).
LLM_KEY_ENV: Final = "DUPLEX_LLM_API_KEY"
DEFAULT_LLM_TIMEOUT_S: Final = 30.0
DEFAULT_LLM_CONCURRENCY: Final = 16


def _worker_id() -> str:
    return "worker-" + uuid.uuid4().hex[:8]


#: The longest step interval a config accepts; the model's frame period, checked when the model
#: loads, is the bound that matters (a request must keep real time).
MAX_STEP_INTERVAL_MS = 1000.0

Clock = Literal["frame", "free"]
"""The engine's schedule (``worker_service.engine``): ``frame`` ticks once per frame period and
steps every runnable request; ``free`` steps whenever there is work."""
CLOCKS: Final[tuple[Clock, ...]] = ("frame", "free")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs to start; model-specific knobs live in ``model_options``."""

    model: str = "parrot"
    """Registered model name (``worker_service.models.MODELS``)."""
    listen: str = "127.0.0.1:0"
    """gRPC ``HOST:PORT``; port 0 picks a free port."""
    metrics_host: str = "127.0.0.1"
    """Interface of the Prometheus ``/metrics`` HTTP endpoint."""
    metrics_port: int = 0
    """Port of ``/metrics``; 0 picks a free port, -1 disables it (in-process tests)."""
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    max_batch: int = 256
    """Most requests stepped in one model step; more are served round-robin."""
    clock: Clock = "frame"
    """The engine's schedule: ``frame`` (one model step per frame period for every session with
    a frame ready: the largest batches, at most one frame period more latency per hop) or
    ``free`` (a step as soon as input is queued, with ``step_interval_ms``)."""
    step_interval_ms: float = 0.0
    """With ``clock="free"``: least time between the starts of two model steps (0 = step as
    soon as any input is queued). Inputs arriving within it share one step: larger batches and
    less CPU per frame under partial load, for up to this much more latency per hop. ``max_batch`` runnable
    requests, or a request with more than one frame queued, step at once. It must be below the
    model's frame period (32 ms for both models here; checked when the model loads): a model
    that steps replies without input (not lockstep) generates one frame per request per step."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    """Most sessions attached at once (0 = unbounded); an Attach beyond it is refused with
    RESOURCE_EXHAUSTED ``capacity_exhausted`` (retryable)."""
    max_tick_load: float = 0.9
    """Frame clock: a new session is refused (``capacity_exhausted``, retryable: placement tries
    the next worker) when the measured tick (``duplex_worker_tick_load``) says one more would
    take more than this share of the frame period; 0 = no bound. So a worker at its real-time
    limit sends new sessions elsewhere instead of every session slowing down."""
    max_queued_frames: int = 1024
    """Per-request input queue bound, in frames (~33 s at 32 ms); APPENDs beyond it get ``capacity``."""
    max_output_steps: int = 2048
    """Per-owner output queue bound, in StepOutputs; an owner that falls this far behind is cut off."""
    worker_id: str = field(default_factory=_worker_id)
    """This worker's id (logs, Describe)."""
    orphan_grace_s: float = 30.0
    """How long an owner's sessions keep their model state after its last Run stream ended; an
    owner that has not reconnected by then (crashed, cut off) has its sessions released."""
    attach_lease_s: float = DEFAULT_ATTACH_LEASE_S
    """A session that gets no submission or abort within this time of its Attach is released
    when its owner has no Run stream then (nobody would ever release it otherwise; an owner that
    has one knows what it holds and reconciles it whenever a stream opens); 0 = never."""
    drain_grace_s: float = 5.0
    """On SIGTERM: how long in-flight replies may run on before the streams are ended."""
    torch_threads: int = 0
    """Intra-op threads of the engine's torch (0 = torch's default)."""
    model_options: Mapping[str, object] = field(default_factory=dict)
    """Model construction options (e.g. ``silence_ms``, ``hidden_size``), validated by the model."""
    tls: ServerTLS | None = None
    """TLS of the worker API; with ``client_ca``, mutual TLS: an owner's identity is its
    certificate's, and fencing authorizes by it."""
    insecure: bool = False
    """Serve in plaintext on a non-loopback address (otherwise refused at start)."""
    health_listen: str = ""
    """``HOST:PORT`` of a plaintext listener serving only ``grpc.health.v1`` (for probes that
    cannot speak TLS); "" = none."""
    takeover_identities: frozenset[str] | None = None
    """Certificate identities allowed to take a session over from another owner (None: those of
    ``session_identities``; both None: any identity the client CA signed)."""
    session_identities: frozenset[str] | None = None
    """Certificate identities allowed to own sessions at all (``Attach``, ``Run`` and with it
    ``Release``): the session tier's. A CA signs many services; any other identity is refused
    with PERMISSION_DENIED ``identity_not_allowed``. None: those of ``takeover_identities``;
    both None: any identity the client CA signed."""
    tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S
    """How long a session closed for good (``Release.closed``) stays refused (``session_closed``):
    the lifetime of a resume token."""
    max_closed_sessions: int = DEFAULT_MAX_CLOSED_SESSIONS
    """Most closed-session tombstones kept; beyond it the oldest is forgotten early."""
    event_loop: str = "auto"
    """The asyncio event loop the service runs on (``duplex.serving.EVENT_LOOPS``): ``uvloop``,
    ``asyncio`` (the standard library's), or ``auto``: uvloop where it is installed."""

    @property
    def mutual_tls(self) -> bool:
        """Clients must present a certificate of the client CA: fencing authorizes by its identity."""
        return self.tls is not None and self.tls.client_ca is not None

    def __post_init__(self) -> None:
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0.0 <= self.step_interval_ms <= MAX_STEP_INTERVAL_MS:
            raise ValueError(f"step_interval_ms must be between 0 and {MAX_STEP_INTERVAL_MS:g}")
        if not 0 <= self.max_tick_load <= 10:
            raise ValueError("max_tick_load must be in [0, 10]")
        if self.max_sessions < 0:
            raise ValueError("max_sessions must be >= 0")
        if self.max_queued_frames < 1:
            raise ValueError("max_queued_frames must be >= 1")
        if self.orphan_grace_s < 0:
            raise ValueError("orphan_grace_s must be >= 0")
        if self.attach_lease_s < 0:
            raise ValueError("attach_lease_s must be >= 0")
        if self.max_output_steps < 1:
            raise ValueError("max_output_steps must be >= 1")
        if not self.tombstone_ttl_s > 0:
            raise ValueError("tombstone_ttl_s must be > 0")
        if self.max_closed_sessions < 1:
            raise ValueError("max_closed_sessions must be >= 1")
        if self.takeover_identities is not None and not self.mutual_tls:
            raise ValueError(
                "takeover identities need mutual TLS (a client CA): without it callers have none"
            )
        if self.session_identities is not None and not self.mutual_tls:
            raise ValueError("session identities need mutual TLS (a client CA): without it callers have none")

    @property
    def owner_identities(self) -> frozenset[str] | None:
        """Who may own sessions here (None: any identity the client CA signed)."""
        return self.session_identities if self.session_identities is not None else self.takeover_identities

    @property
    def takeover_allowed(self) -> frozenset[str] | None:
        """Who may take a session over from another owner (None: any identity that may own)."""
        return self.takeover_identities if self.takeover_identities is not None else self.owner_identities
