"""A link to one worker: its channel, its description and this replica's one Run stream to it.

The link's sender task coalesces every pending submission, abort and release into ONE
``WorkerCommand`` per loop iteration (the hop is never one message per frame), written at the
worker's tick's write point (``write_pacing``: once a tick, a learnt lead ahead of it, against
a worker that says which commands made its ticks; an abort at once; a lone session never held
back). Its reader hands each ``StepOutput`` to the router. A link that loses its stream is
unhealthy at once, tells the router (its sessions get ``worker_unavailable`` and move on their
next submission), then reconnects with jittered backoff; the channel's own reconnect backoff is
capped the same way, so a worker restarted after a long outage is back within
``backoff_max_s`` or so.

With ``credentials`` (mutual TLS towards the workers) the channel is a TLS channel made from
``ChannelCredentials.current()``; a reconnect asks again and, when the certificate files changed
(a rotated Secret), replaces the channel, so the next connection uses the new certificate.

A watchdog task per stream polls the link's ``Liveness`` (``session_service.workers.liveness``) a few
times per stall timeout; when the worker has owed something and sent nothing for
``stall_timeout_s``, the link is lost exactly as if the stream had dropped, and reconnects with
backoff, so a worker that resumes answering comes back.

Nothing the worker holds for this replica outlives a lost link: a release that cannot be sent
(the link is down, or the write that carried it failed) is kept, bounded, and sent first on the
next stream; and every new stream starts with the worker's list of what it holds for this
replica (``StepOutput.held_sessions``), which the router reconciles (``routing.Router``):
whatever this replica no longer holds on this link is released. Sessions with an Attach in
flight on the link are not judged (``attaching``); an Attach that succeeds on a stream that is
gone by then is released again, since placement will not use it.

The worker's own id (``Describe``: ``worker_id``) is what placement ranks it by. Before a link
opens its Run stream it asks its pool to ``claim`` that id: one link per worker id holds a
stream (``placement.WorkerPool.claim``); a link refused stands by, asking again at its slowest
reconnect pace. A link to a discovered address (``tls_name``) checks the worker's certificate
against the name that was resolved, as gRPC's own DNS resolver would, not against the address.

Messages that may reach a client never name the worker (its address) or carry gRPC's own
text; those details are logged here instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence

import grpc

from duplex.clock import MONOTONIC, Clock
from duplex.errors import ErrorCode, UnavailableError, from_rpc_error
from duplex.serving import CHANNEL_OPTIONS
from duplex.tls import ChannelCredentials
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from session_service.metrics import WORKER_COMMAND_SIZE, WORKER_STALLS, WORKER_TICK_COMMANDS, WORKER_TICK_LEAD
from session_service.plugin import DuplexModelPlugin, PluginLoadError, Stage, check_worker
from session_service.workers.command_form import CONTROL, Pending, build_command, frame_bytes_of
from session_service.workers.kept_releases import KeptReleases
from session_service.workers.liveness import Liveness, WorkerStalledError
from session_service.workers.placement import worker_key
from session_service.workers.write_pacing import WritePacer

log = logging.getLogger(__name__)

#: First wait before reconnecting to a lost worker (doubles, jittered, up to ``backoff_max_s``).
BACKOFF_INITIAL_S = 0.1

#: Default stall timeout of a link (``ServiceConfig.worker_stall_timeout_s``); 0 turns it off.
DEFAULT_STALL_TIMEOUT_S = 3.0

#: What a client is told when the session's worker cannot be reached; the details are logged.
UNAVAILABLE_MESSAGE = "the session's worker is unavailable"


def _always(link: WorkerLink, worker_id: str) -> bool:
    return True


def _nothing(link: WorkerLink) -> None:
    pass


def channel_options(backoff_max_s: float) -> list[tuple[str, int]]:
    """Worker channel options: gRPC's own reconnect backoff (1 s growing to 120 s by default)
    would otherwise keep a restarted worker unreachable long after our backoff retries it."""
    return [
        *CHANNEL_OPTIONS,
        ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", max(int(backoff_max_s * 1000), 200)),
    ]


class WorkerLink:
    """One worker: its channel, its description and the replica's one Run stream to it."""

    def __init__(
        self,
        address: str,
        *,
        owner: str,
        plugin: DuplexModelPlugin,
        on_step: Callable[[WorkerLink, worker_pb2.StepOutput], None],
        on_lost: Callable[[WorkerLink], None],
        on_health: Callable[[], None],
        backoff_max_s: float = 5.0,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        clock: Clock = MONOTONIC,
        credentials: ChannelCredentials | None = None,
        tls_name: str | None = None,
        claim: Callable[[WorkerLink, str], bool] = _always,
        release: Callable[[WorkerLink], None] = _nothing,
        write_coalesce_s: float = 0.0,
        stage: Stage | None = None,
    ) -> None:
        """``clock``: what the stall watchdog and the liveness record measure time on;
        ``credentials``: TLS towards the worker (None: plaintext); ``tls_name``: the name the
        worker's certificate must carry (None: the address's host); ``claim`` / ``release``:
        the pool's one-link-per-worker-id rule (``placement.WorkerPool.claim``);
        ``write_coalesce_s``: how long the sender waits, once woken, for more submissions to join
        the command (0: write at once; see ``ServiceConfig.worker_write_coalesce_ms``); ``stage``:
        the plugin's later stage this worker serves (None: its first, or its only model)."""
        self.pacer = WritePacer(write_coalesce_s)
        """When the next command is written (the worker's tick's write point)."""
        self.address = address
        self._tls_name = tls_name
        self._claim = claim
        self._release = release
        self.worker_id: str | None = None
        """The worker's id (``Describe``); None before and once the link failed (not standing by)."""
        self._clock = clock
        WORKER_STALLS.labels(worker=address)  # present at 0 from the start, for alerts
        self.owner = owner
        self._plugin = plugin
        self.stage = stage
        self._on_step = on_step
        self._on_lost = on_lost
        self._on_health = on_health
        self._backoff_max_s = backoff_max_s
        self._credentials = credentials
        self._channel_credentials: grpc.ChannelCredentials | None = None  # the channel's
        self._channel = self._new_channel()
        self._stub = worker_pb2_grpc.DuplexWorkerStub(self._channel)
        self.description: worker_pb2.WorkerDescription | None = None
        self._frame_bytes = 0  # the worker's frame in bytes where it reads APPENDs in columns
        self._healthy = False
        self.generation = 0
        """Counts Run streams: an Attach under one is not held by the worker behind a later one."""
        self._pending = Pending()
        self._kept = KeptReleases()  # releases waiting for a stream
        self._attaching: Counter[str] = Counter()
        """Sessions with an Attach in flight on this link (reconciliation leaves them alone)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.commands_sent = 0
        self._stall_timeout_s = stall_timeout_s
        # A lockstep model's RESPOND owes nothing by itself (it replies only as input comes); a
        # free-running one's (a later stage's too: stepped while its text comes) owes a step.
        free = stage is not None or not plugin.silence_continuation
        self.liveness = Liveness(respond_answers=free, clock=clock.now)
        self.stalls = 0
        """Times this link was declared stalled (lost without the stream breaking)."""

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _new_channel(self) -> grpc.aio.Channel:
        options = channel_options(self._backoff_max_s)
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        self._channel_credentials = self._credentials.current()
        secure_options: list[tuple[str, int | str]] = [*options]
        if self._tls_name is not None:
            secure_options.append(("grpc.ssl_target_name_override", self._tls_name))
        return grpc.aio.secure_channel(self.address, self._channel_credentials, options=secure_options)

    async def _renew_channel(self) -> None:
        """Before a reconnect: a new channel when the TLS files changed since this one was made
        (a channel keeps the credentials it was made with, and reconnects with them)."""
        if self._credentials is None or self._credentials.current() is self._channel_credentials:
            return
        old = self._channel
        self._channel = self._new_channel()
        self._stub = worker_pb2_grpc.DuplexWorkerStub(self._channel)
        log.info("worker %s: TLS credentials changed: reconnecting with the new ones", self.address)
        await old.close()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-link-{self.address}")

    async def close(self) -> None:
        """Stop the link: unhealthy at once (its sessions hear of it now), then the stream ends."""
        self._stopping = True
        self._lose()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    # ---- commands ----------------------------------------------------------------------------

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        """Queue submissions for the next command; resolves when that command is written.
        ``prompt``: their client is answered once they are written (``Pending.prompt``)."""
        if not self._healthy:
            log.debug("worker %s: no stream: submission refused", self.address)
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, UNAVAILABLE_MESSAGE)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if subs:
            self.pacer.submitted(subs[0].request_id)
        pending = self._pending
        pending.submit.extend(subs)
        pending.futures.append(fut)
        pending.prompt |= prompt
        if not pending.urgent and not self.pacer.control_waits and any(s.kind in CONTROL for s in subs):
            pending.urgent = True
            self.pacer.cut_short()
        self._wake.set()
        return fut

    def abort(self, abort: worker_pb2.Abort) -> None:
        if self._healthy:
            self._pending.abort.append(abort)
            self._wake.set()
            self.pacer.cut_short()  # a barge-in does not wait for the tick

    def release(self, release: worker_pb2.Release) -> None:
        """Release a session at the worker: with the next command, or, while the link has no
        stream, first thing on the next one (kept, bounded)."""
        if self._healthy:
            self._pending.release.append(release)
            self._wake.set()
        else:
            self._kept.keep([release])

    @property
    def kept_releases(self) -> list[str]:
        """The sessions whose releases wait for the next stream, oldest first."""
        return self._kept.session_ids()

    def attaching(self, session_id: str) -> bool:
        """Whether an Attach of the session is in flight on this link."""
        return session_id in self._attaching

    def _forget_releases(self, session_id: str) -> None:
        """The session is being attached here again: an unsent release of it is out of date
        (sent after the Attach it would release the new attachment)."""
        self._kept.forget(session_id)
        pending = self._pending.release
        if pending:
            self._pending.release = [r for r in pending if r.fence.session_id != session_id]

    async def attach(self, session_id: str, epoch: int, *, takeover: bool, deadline_s: float) -> int:
        """Bind a session to this replica at ``epoch``; returns the granted epoch.

        An Attach that succeeds after the stream it was made under went away is released again
        (placement does not use it: ``placement.WorkerPool.place`` checks the same thing)."""
        self._forget_releases(session_id)
        generation = self.generation
        self._attaching[session_id] += 1
        try:
            resp = await self._stub.Attach(
                worker_pb2.AttachRequest(
                    session_id=session_id,
                    epoch=epoch,
                    owner=self.owner,
                    takeover=takeover,
                    request_id=session_id,  # a runner's request id is its session's
                ),
                timeout=deadline_s,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc  # placement logs it, with this worker's address
        finally:
            self._attaching[session_id] -= 1
            if self._attaching[session_id] <= 0:
                del self._attaching[session_id]
        granted = int(resp.epoch)
        if not (self._healthy and self.generation == generation):
            fence = common_pb2.Fence(session_id=session_id, epoch=granted)
            self.release(worker_pb2.Release(request_id=session_id, fence=fence))
        return granted

    # ---- the stream ------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while not self._stopping:
            opened = self.generation
            standing_by = False
            try:
                await self._renew_channel()
                desc = await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=5.0)
                check_worker(self._plugin, desc, self.stage)
                worker_id = worker_key(desc, self.address)
                self.description, self._frame_bytes = desc, frame_bytes_of(desc)
                self.worker_id = worker_id
                rate = desc.audio_format.sample_rate_hz
                self.pacer.period = desc.frame_samples / rate if rate and desc.frame_samples else 0.0
                if self._claim(self, worker_id):
                    await self._serve_stream()
                else:
                    standing_by = True  # another link serves this worker (the pool logged it)
            except asyncio.CancelledError:
                raise
            except PluginLoadError as err:
                log.error("worker %s refused: %s", self.address, err.message)
            except WorkerStalledError:
                pass  # logged by the watchdog
            except grpc.RpcError as exc:
                log.warning("worker %s: %s", self.address, from_rpc_error(exc).message)
            except (ConnectionError, asyncio.InvalidStateError) as exc:
                # The stream ended (a write may meet the RPC over): no bug, no traceback.
                log.warning("worker %s: Run stream ended: %s", self.address, exc)
            except Exception:
                log.exception("worker %s: link failed", self.address)
            finally:
                self._lose()
                if not standing_by:
                    self.worker_id = None
            if self.generation != opened:
                backoff = BACKOFF_INITIAL_S  # the stream ran: a fresh failure starts over
            # Jittered exponential backoff: a restarting worker is not stampeded by every replica.
            # Standing by, the link asks again at the slowest pace: the serving link is up.
            wait = self._backoff_max_s if standing_by else backoff
            await asyncio.sleep(wait * (0.5 + random.random()))
            if not standing_by:
                backoff = min(self._backoff_max_s, backoff * 2)

    async def _serve_stream(self) -> None:
        call = self._stub.Run()
        # The releases kept while there was no stream go first, in the stream's first command:
        # the worker applies them before it lists what it holds for this replica.
        kept = self._kept.take()
        try:
            await call.write(worker_pb2.WorkerCommand(owner=self.owner, release=kept, step_columns=True))
        except BaseException:
            self._kept.keep([r for r in kept if r.fence.session_id not in self._kept], count=False)
            raise
        self.generation += 1
        self.pacer.new_stream()
        self.liveness.reset()
        self._healthy = True
        if self._kept:  # released while the first command was being written
            self._pending.release.extend(self._kept.take())
            self._wake.set()
        self._on_health()
        log.info(
            "worker %s: Run stream open (worker %r, model %s)",
            self.address,
            self.worker_id,
            self.description.model_id if self.description else "?",
        )
        # Reader, sender and watchdog: the first of them to end (an error, EOF, a stall) ends
        # the stream, so a hung worker is noticed even while the reader waits for it forever.
        tasks = [
            asyncio.create_task(self._read_loop(call)),
            asyncio.create_task(self._send_loop(call)),
        ]
        if self._stall_timeout_s > 0:
            tasks.append(asyncio.create_task(self._watchdog()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    raise ConnectionError("a Run stream task was cancelled")
                task.result()  # re-raise the failure that ended the stream
            raise ConnectionError("the Run stream ended")
        finally:
            # Unhealthy before any await: nothing may be placed on, or submitted to, a dead stream.
            self._lose()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(asyncio.InvalidStateError):  # the RPC may have ended already
                call.cancel()

    async def _read_loop(
        self, call: grpc.aio.StreamStreamCall[worker_pb2.WorkerCommand, worker_pb2.StepOutput]
    ) -> None:
        heard = self.liveness.heard
        heard_tick = self.pacer.heard_tick
        made, missed, lead = (
            WORKER_TICK_COMMANDS.labels(worker=self.address, outcome="made"),
            WORKER_TICK_COMMANDS.labels(worker=self.address, outcome="missed"),
            WORKER_TICK_LEAD.labels(worker=self.address),
        )
        while True:
            step = await call.read()
            if not isinstance(step, worker_pb2.StepOutput):  # grpc.aio.EOF
                raise ConnectionError("worker closed the Run stream")
            heard(step)
            if step.next_tick_us:
                hits, misses = heard_tick(step.next_tick_us, step.commands_applied)
                if hits or misses:
                    made.inc(hits)
                    missed.inc(misses)
                    lead.set(self.pacer.lead * self.pacer.period)
            try:
                self._on_step(self, step)
            except Exception:
                log.exception("worker %s: routing a step failed", self.address)

    async def _watchdog(self) -> None:
        """Declare the worker stalled when it has owed output and sent none for the timeout.

        Polls two timestamps a few times per timeout (no per-frame timers). A tick that comes
        late (this process's event loop was blocked, so the reader could not run either) is not
        judged: the stall must be the worker's, not ours.
        """
        timeout = self._stall_timeout_s
        interval = min(0.5, max(0.05, timeout / 4))
        clock = self._clock
        due = clock.now() + interval
        while True:
            await clock.sleep(max(0.0, due - clock.now()))
            now = clock.now()
            late = now - due > interval
            due = now + interval
            if late:
                continue
            quiet = self.liveness.quiet_for()
            if quiet >= timeout:
                self.stalls += 1
                WORKER_STALLS.labels(worker=self.address).inc()
                log.warning(
                    "worker %s: stalled: %d requests owed output and nothing came for %.1f s "
                    "(timeout %.1f s); treating it as lost",
                    self.address,
                    self.liveness.owing,
                    quiet,
                    timeout,
                )
                raise WorkerStalledError(f"worker {self.address} stalled for {quiet:.1f} s")

    async def _send_loop(
        self, call: grpc.aio.StreamStreamCall[worker_pb2.WorkerCommand, worker_pb2.StepOutput]
    ) -> None:
        pacer = self.pacer
        while True:
            await self._wake.wait()
            pending = self._pending
            tick = 0.0
            if not (pending.abort or pending.urgent) and pacer.worth_waiting():
                # Every WorkerCommand is a syscall and a wake-up on both ends: submissions of
                # sessions that arrive within the window share one (and the worker's next step).
                # Against a frame clock the window runs to just before the next tick: one
                # command per tick. An abort (a barge-in) goes at once.
                while True:
                    tick, mid = await pacer.until_write_point()
                    # One command a tick: a mid-tick write point is taken only for what its
                    # client hears of once written (an input_ack), an abort or control work.
                    pending = self._pending
                    if not mid or pending.prompt or pending.abort or pending.urgent:
                        break
            self._wake.clear()
            pending, self._pending = self._pending, Pending()
            if not (pending.submit or pending.abort or pending.release):
                continue
            self.liveness.written(pending.submit, pending.abort, pending.release)
            cmd = build_command(pending.submit, pending.abort, pending.release, frame_bytes=self._frame_bytes)
            WORKER_COMMAND_SIZE.observe(len(pending.submit) + len(pending.abort) + len(pending.release))
            try:
                await call.write(cmd)
            except BaseException:
                # Sessions hear of the loss first (their response fails, their turn ends), then
                # the writers waiting on this command: their failure is a consequence, not news.
                # Its releases are kept for the next stream (one that did arrive is ignored).
                # What failed is logged where the stream's end is; the writers get no details.
                self._kept.keep(pending.release)
                self._lose()
                for fut in pending.futures:
                    if not fut.done():
                        fut.set_exception(ConnectionError(UNAVAILABLE_MESSAGE))
                raise
            self.commands_sent += 1
            pacer.wrote(tick)
            for fut in pending.futures:
                if not fut.done():
                    fut.set_result(None)

    def _lose(self) -> None:
        was = self._healthy
        self._healthy = False
        self._release(self)  # this link holds no stream: another address of its worker may
        pending, self._pending = self._pending, Pending()
        self._kept.keep(pending.release)  # unsent: first thing on the next stream
        for fut in pending.futures:
            if not fut.done():
                fut.set_exception(ConnectionError(UNAVAILABLE_MESSAGE))
        if was:
            log.warning("worker %s: Run stream lost", self.address)
            self._on_lost(self)
            self._on_health()
