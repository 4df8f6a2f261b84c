"""The engine: ONE thread owns torch and the device and steps every request that has work.

Continuous batching (vLLM v1 style): requests join and leave between steps; each step takes
runnable requests (up to ``max_batch`` per step), consumes at most one input frame per request,
runs one batched model step, and hands per-owner results to ``sink`` without waiting for anyone
(the server's sink is ``loop.call_soon_threadsafe`` into bounded per-owner queues). When nothing
is runnable the thread blocks on a condition: no busy waiting.

**The frame clock** (``clock="frame"``, the default): duplex models run in lockstep, one model
step per frame period for every stream (moshi-server's fixed slots). The engine ticks once per
frame period of the model; a tick steps EVERY runnable request (in chunks of ``max_batch``), so
the batch is every session with a frame ready (or a reply to advance), whatever its client's
transport or append size. Input arriving between ticks waits for the next one (at most one
frame period), unless it comes just after a tick that did not step its request (a late join).
A request more than one frame behind after the tick's step (a burst, a replay after a move, a
client sending faster than real time) catches up by extra frames: up to ``CATCH_UP_STEPS`` more
steps per tick while the tick has used less than ``CATCH_UP_BUDGET`` of its period, each taking
every request that still has a frame queued, so the behind share steps instead of each taking
steps of its own. A tick that starts late does not make the next ones bunch up: the clock
starts again from it. The tick is ``frame_clock.FrameClock``, a layer of the engine.

``clock="free"`` steps as soon as there is work (round-robin beyond ``max_batch``), optionally no
sooner than ``step_interval_s`` after the previous step started (inputs arriving meanwhile join
one larger batch; a full batch, or a request more than one frame behind, steps at once; the
interval must be below the frame period). A model that must run free (``StepModel.free_running``)
gets it whatever the engine was asked for.

The asyncio side talks to the engine only through ordered commands (``Enqueue``, ``AbortOlder``,
``ReleaseSession``, ``CommandMark``) applied between steps: model state and queues need no
locks. A per-request failure becomes that request's error update (vLLM v1); one escaping the
batched step is fatal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

import numpy as np
import torch

from duplex.fence import Fence
from duplex.v1 import common_pb2
from worker_service import metrics
from worker_service.config import CLOCKS, Clock
from worker_service.engine_types import (
    APPEND,
    CLEAR,
    COMMIT,
    RESPOND,
    AbortOlder,
    CommandMark,
    CommandMarks,
    EngineCommand,
    EngineDeadError,
    Enqueue,
    OwnerStep,
    Sink,
    Update,
    Work,
)
from worker_service.frame_clock import FrameClock
from worker_service.model import FloatArray, StepBatch, StepModel
from worker_service.sparse_adapter import adapt_multimodal_outputs
from worker_service.step_outputs import Request, collect_news, model_failure, route_audio

logger = logging.getLogger(__name__)

#: Admission: below this many sessions a tick's cost is mostly its fixed part (the batch's Python,
#: a model's per-step overhead), so one more is not taken to cost a per-session share of it.
ESTIMATE_FROM = 4


class Engine(FrameClock):
    """Continuous-batching engine around one ``StepModel``; see the module docstring."""

    def __init__(
        self,
        model_factory: Callable[[], StepModel[Any]],
        *,
        sink: Sink,
        max_batch: int = 256,
        on_ready: Callable[[StepModel[Any]], object] | None = None,
        on_fatal: Callable[[BaseException], object] | None = None,
        torch_threads: int = 0,
        step_interval_s: float = 0.0,
        clock: Clock = "frame",
    ) -> None:
        if step_interval_s < 0:
            raise ValueError("step_interval_s must be >= 0")
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}")
        self._factory = model_factory
        self._sink = sink
        self._max_batch = max_batch
        self._on_ready = on_ready
        self._on_fatal = on_fatal
        self._torch_threads = torch_threads
        self._step_interval = step_interval_s
        self._clock: Clock = clock
        self._period = 0.0
        """Frame clock: the model's frame period in seconds (0: the free clock)."""
        self._cond = threading.Condition()
        self._inbox: list[EngineCommand] = []
        self._awaiting_tick = False  # the thread waits for the frame clock's tick (work is due then)
        self._late_until = 0.0  # ``time.monotonic()`` until which input may still join the last tick
        self._tick_no = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="duplex-engine", daemon=True)
        self.model: StepModel[Any] | None = None
        self.dead: BaseException | None = None
        # Engine-thread state.
        self._requests: dict[str, Request] = {}
        self._marks = CommandMarks()
        self._runnable: OrderedDict[str, Request] = OrderedDict()
        self._queued_units = 0
        self._step_no = 0
        self._next_step_at = 0.0
        """``time.monotonic()`` before which no step starts (a step interval or the next tick)."""
        self._fmt: common_pb2.AudioFormat | None = None
        self.tick_load = 0.0

    def takes_one_more(self, sessions: int, max_load: float) -> bool:
        """Whether one more session keeps the measured tick within ``max_load`` of the frame
        period (0: no bound). A model stepping a fixed batch costs the same with it; any other
        is taken to cost in proportion to its ``sessions`` (attached now), once there are enough
        of them (``ESTIMATE_FROM``) for the per-session share to outweigh a tick's fixed cost."""
        load, model = self.tick_load, self.model
        if not max_load or not load or model is None:
            return True
        if model.fixed_batch or sessions < ESTIMATE_FROM:
            return load <= max_load
        return load * (sessions + 1) / sessions <= max_load

    # -- the asyncio side's API (thread-safe) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, commands: Sequence[EngineCommand], *, appends_only: bool = False) -> None:
        """Queue commands for the engine thread (applied in order before its next step).
        ``appends_only``: the caller knows they are all APPENDs; on the frame clock they wait for
        the tick anyway and do not wake a thread waiting for it (each wake is a GIL hand-over)."""
        if self.dead is not None:
            raise EngineDeadError()
        if not commands:
            return
        with self._cond:
            self._inbox.extend(commands)
            if not (appends_only and self._awaiting_tick and time.monotonic() >= self._late_until):
                self._cond.notify()

    @property
    def idle(self) -> bool:
        """No queued commands and no runnable request (a racy snapshot, for draining)."""
        return not self._inbox and not self._runnable

    @property
    def steps(self) -> int:
        return self._step_no

    @property
    def active_requests(self) -> int:
        """Requests holding model state (a racy snapshot of the engine thread's table; what
        ``duplex_worker_active_requests`` shows after the engine's next iteration)."""
        return len(self._requests)

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            # Inference mode for the thread's lifetime: the model's state tensors are created
            # and updated in place under it, with no autograd bookkeeping.
            with torch.inference_mode():
                model = self._factory()
                frame_s = model.frame_samples / model.audio_format.sample_rate_hz
                if self._step_interval >= frame_s:
                    raise ValueError(
                        f"the step interval ({1000 * self._step_interval:g} ms) must be below the "
                        f"model's frame period ({1000 * frame_s:g} ms)"
                    )
                if self._clock == "frame" and not model.free_running:
                    self._period = frame_s
                self.model = model
                self._fmt = model.audio_format.to_proto()
                if self._on_ready is not None:
                    self._on_ready(model)
                while self._iterate(model):
                    pass
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.dead = exc
        logger.critical("engine failed; the worker stops serving", exc_info=exc)
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _iterate(self, model: StepModel[Any]) -> bool:
        with self._cond:
            while not self._stopping and not self._inbox:
                if not self._runnable:
                    self._cond.wait()
                    continue
                wait = self._step_wait()
                if wait <= 0:
                    break
                self._awaiting_tick = bool(self._period)
                self._cond.wait(wait)  # a command may wake it early: applied at once, the step waits on
                self._awaiting_tick = False
            if self._stopping:
                return False
            commands, self._inbox = self._inbox, []
        news: dict[str, list[Update]] = {}
        self._apply(model, commands, news)
        results: list[tuple[str, OwnerStep]] = []
        step_outputs: list[tuple[str, OwnerStep]] = []
        if self._runnable and self._step_wait() <= 0:
            if self._period:
                step_outputs = self._tick(model, news)
            else:
                step_outputs = self._step(model, news, self._select())
        elif self._runnable and time.monotonic() < self._late_until:
            step_outputs = self._late_join(model, news)
        results = [(owner, OwnerStep(step=0, updates=u)) for owner, u in news.items() if u]
        results.extend(step_outputs)
        metrics.ACTIVE_REQUESTS.set(len(self._requests))
        metrics.QUEUE_DEPTH.labels(queue="input").set(self._queued_units)
        if results:
            self._sink(results)
        return True

    def _step_wait(self) -> float:
        """Seconds until the next step may start (<= 0: now)."""
        if self._period:
            return self._next_step_at - time.monotonic()
        if (
            not self._step_interval
            or len(self._runnable) >= self._max_batch
            or self._queued_units > len(self._runnable)  # someone is behind
        ):
            return 0.0
        return self._next_step_at - time.monotonic()

    # -- commands --------------------------------------------------------------------------------

    def _apply(
        self, model: StepModel[Any], commands: list[EngineCommand], news: dict[str, list[Update]]
    ) -> None:
        for cmd in commands:
            if isinstance(cmd, Enqueue):
                self._enqueue(model, cmd, news)
            elif isinstance(cmd, AbortOlder):
                self._abort_older(model, cmd)
            elif isinstance(cmd, CommandMark):
                self._marks.apply(cmd)
            else:
                self._release(model, cmd.session_id)

    def _enqueue(self, model: StepModel[Any], cmd: Enqueue, news: dict[str, list[Update]]) -> None:
        work = cmd.work
        sid = work.fence.session_id
        req = self._requests.get(sid)
        if req is None:
            try:
                state = model.create_state(sid)
            except Exception as exc:
                cmd.counter.retired += work.units
                news.setdefault(work.owner, []).append(model_failure(work, exc))
                return
            req = self._requests[sid] = Request(sid, work.owner, work.request_id, state, cmd.counter)
        if work.fence.epoch < req.epoch:
            # Fenced on the asyncio side already; kept as a guard for the invariant.
            cmd.counter.retired += work.units
            metrics.FENCED.labels(reason="aborted").inc()
            return
        if work.fence.epoch > req.epoch:
            self._drop_older(model, req, work.fence.epoch)
        if work.owner != req.owner:
            self._hand_over(req, work, news)
        req.owner, req.request_id, req.counter = work.owner, work.request_id, cmd.counter
        req.queue.append(work)
        self._queued_units += work.units
        if sid not in self._runnable:
            self._runnable[sid] = req
        if self._period and work.kind != APPEND and len(req.queue) == 1:
            # Frame clock: control work with no input ahead of it (a RESPOND, a COMMIT) is not a
            # model step: applied now, not at the next tick, so a reply starts up to a frame
            # period sooner (the parrot computes it meanwhile).
            self._prepare(model, req, news)

    def _hand_over(self, req: Request, work: Work, news: dict[str, list[Update]]) -> None:
        """The first work of an owner that took the session over: a turn the model ended that
        nothing answered is told to it again (the news went to the previous owner, perhaps dead
        before acting on it; the model does not end a turn twice). Its own RESPOND, COMMIT or
        CLEAR answers the turn itself."""
        if req.unanswered is None:
            return
        if work.kind == APPEND:
            fence = Fence(req.session_id, req.epoch, work.fence.turn_id)
            news.setdefault(work.owner, []).append(
                Update(work.request_id, fence, turn_ended=True, committed_samples=req.unanswered)
            )
            metrics.TURNS_HANDED_OVER.inc()
        req.unanswered = None

    def _abort_older(self, model: StepModel[Any], cmd: AbortOlder) -> None:
        req = self._requests.get(cmd.session_id)
        if req is not None and cmd.epoch > req.epoch:
            self._drop_older(model, req, cmd.epoch, keep_input=cmd.keep_input)
            if not req.queue and not model.is_responding(req.state):
                self._runnable.pop(req.session_id, None)

    def _drop_older(
        self, model: StepModel[Any], req: Request, epoch: int, *, keep_input: bool = False
    ) -> None:
        """The session moved to ``epoch``: its reply and queued work of older epochs go. With
        ``keep_input`` (its owner's cancel) queued input stays, taken under ``epoch``: a user who
        talks over a reply (a barge-in heard while input is still queued, as after a move) loses
        none of what they said. Append seqs go on then; otherwise they restart with the epoch."""
        req.epoch = epoch
        if not keep_input:
            req.seq_done = req.seq_reported = 0
        kept: deque[Work] = deque()
        for work in req.queue:
            if work.fence.epoch >= epoch:
                kept.append(work)
                continue
            if keep_input and work.kind != RESPOND:
                work.fence = Fence(work.fence.session_id, epoch, work.fence.turn_id)
                kept.append(work)
                continue
            req.counter.retired += work.units
            self._queued_units -= work.units
            metrics.FENCED.labels(reason="aborted").inc()
        req.queue = kept
        if req.reply_fence is not None and req.reply_fence.epoch < epoch:
            model.cancel_response(req.state)
            req.reply_fence = None
            metrics.FENCED.labels(reason="aborted").inc()
        elif model.model_native:
            model.cancel_response(req.state)  # what it says now is not heard until it falls silent

    def _release(self, model: StepModel[Any], session_id: str) -> None:
        req = self._requests.pop(session_id, None)
        self._runnable.pop(session_id, None)
        if req is None:
            return
        for work in req.queue:
            req.counter.retired += work.units
            self._queued_units -= work.units
        req.queue.clear()
        try:
            model.release_state(req.state)
        except Exception:
            logger.exception("model failed to release a request's state")

    # -- one step --------------------------------------------------------------------------------

    def _prepare(
        self, model: StepModel[Any], req: Request, news: dict[str, list[Update]]
    ) -> FloatArray | None:
        """Run the request's leading control submissions; take at most one input frame."""
        while req.queue:
            work = req.queue[0]
            try:
                if work.options is not None:
                    model.set_options(req.state, work.options)
                    work.options = None
                if work.kind == APPEND:
                    assert work.frames is not None
                    frame: FloatArray = work.frames[work.pos]
                    work.pos += 1
                    req.counter.retired += 1
                    self._queued_units -= 1
                    req.input_fence = work.fence
                    req.input_replay = work.replay
                    if work.pos == len(work.frames):
                        req.queue.popleft()
                        req.seq_done = work.seq
                    return frame
                req.queue.popleft()
                req.counter.retired += 1
                self._queued_units -= 1
                req.unanswered = None  # RESPOND, COMMIT and CLEAR each answer an ended turn
                if work.kind == COMMIT:
                    n = model.commit(req.state)
                    news.setdefault(work.owner, []).append(
                        Update(work.request_id, work.fence, committed_samples=n)
                    )
                elif work.kind == RESPOND:
                    model.respond(req.state)
                    req.reply_fence = work.fence
                elif work.kind == CLEAR:
                    model.clear(req.state)
            except Exception as exc:
                if work.kind == APPEND and req.queue and req.queue[0] is work:
                    req.queue.popleft()
                    req.counter.retired += work.units
                    self._queued_units -= work.units
                news.setdefault(work.owner, []).append(model_failure(work, exc))
        return None

    def _select(self) -> list[Request]:
        runnable = self._runnable
        if len(runnable) <= self._max_batch:
            return list(runnable.values())
        chosen = list(islice(runnable.values(), self._max_batch))
        # Round-robin: the chosen go to the back of the line.
        for req in chosen:
            runnable.move_to_end(req.session_id)
        return chosen

    def _step(
        self, model: StepModel[Any], news: dict[str, list[Update]], chosen: list[Request]
    ) -> list[tuple[str, OwnerStep]]:
        t0 = time.perf_counter()
        batch: list[Request] = []
        fences: list[Fence] = []
        rows: list[FloatArray | None] = []
        replayed: list[bool] = []
        for req in chosen:
            frame = self._prepare(model, req, news)
            # A lockstep model advances a reply only with an input frame, so a replying request
            # without one has nothing to step until input arrives (no spinning).
            replying = (
                req.reply_fence is not None
                and model.is_responding(req.state)
                and (frame is not None or not model.lockstep)
            )
            if frame is None and not replying:
                if not req.queue:
                    self._runnable.pop(req.session_id, None)
                continue
            fence = req.reply_fence if replying else req.input_fence
            assert fence is not None
            req.tick = self._tick_no
            batch.append(req)
            fences.append(fence)
            rows.append(frame)
            replayed.append(frame is not None and req.input_replay)
        if not batch:
            return []
        if self._step_interval and not self._period:
            self._next_step_at = time.monotonic() + self._step_interval
        self._step_no += 1
        size = len(batch)
        frames = np.zeros((size, model.frame_samples), dtype=np.float32)
        has_input = np.zeros(size, dtype=np.bool_)
        for i, row in enumerate(rows):
            if row is not None:
                frames[i] = row
                has_input[i] = True
        req_ids = [r.session_id for r in batch]
        cpu0 = time.thread_time()
        result = model.step(
            StepBatch(req_ids=req_ids, states=[r.state for r in batch], frames=frames, has_input=has_input)
        )
        metrics.MODEL_STEP_CPU.inc(time.thread_time() - cpu0)
        outputs = adapt_multimodal_outputs(
            result.outputs, output_type=result.output_type, batch_req_ids=req_ids, audio_format=self._fmt
        )
        per_owner: dict[str, OwnerStep] = {}
        for req, fence in zip(batch, fences, strict=True):
            out = per_owner.get(req.owner)
            if out is None:
                out = per_owner[req.owner] = OwnerStep(step=self._step_no, output_type=outputs.output_type)
            out.batch.append((req.request_id, fence))
        route_audio(outputs, batch, per_owner)
        collect_news(model, batch, fences, replayed, result.news, per_owner)
        for req in batch:
            if req.reply_fence is not None and not model.is_responding(req.state):
                req.reply_fence = None
            if not req.queue and (req.reply_fence is None or model.lockstep):
                self._runnable.pop(req.session_id, None)
        metrics.BATCH_SIZE.observe(size)
        metrics.STEP_DURATION.observe(time.perf_counter() - t0)
        return list(per_owner.items())
