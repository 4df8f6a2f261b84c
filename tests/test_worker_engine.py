"""The engine and its failure modes, with small fake models: fairness, per-request model errors,
legacy outputs that fail closed, a fatal engine crash, and the step interval."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from duplex.audio import PCM16K_MONO
from duplex.errors import from_rpc_error
from duplex.fence import Fence
from tests.worker_helpers import APPEND, COMMIT, FRAME, RESPOND, RunClient, error_codes, pcm, sub, worker
from worker_service.cli import build_parser, config_from_args
from worker_service.config import WorkerConfig
from worker_service.engine import Engine
from worker_service.engine_types import AbortOlder, Enqueue, OwnerStep, QueueCounter, Work
from worker_service.model import RequestNews, StepBatch, StepModel, StepResult, run_as_helper
from worker_service.models.synthetic import SyntheticModel


@dataclass(eq=False)
class _St:
    sid: str
    replying: int = 0


class FakeModel(StepModel[_St]):
    """Emits a legacy dict; ``mode`` picks a failure."""

    model_id = "fake"
    audio_format = PCM16K_MONO
    frame_samples = FRAME
    device = torch.device("cpu")

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode

    def parse_options(self, params: Mapping[str, object]) -> object:
        return dict(params)

    def create_state(self, session_id: str) -> _St:
        return _St(session_id)

    def release_state(self, state: _St) -> None:
        pass

    def set_options(self, state: _St, options: object) -> None:
        pass

    def commit(self, state: _St) -> int:
        return 1

    def clear(self, state: _St) -> None:
        pass

    def respond(self, state: _St) -> None:
        state.replying = 3

    def cancel_response(self, state: _St) -> None:
        state.replying = 0

    def is_responding(self, state: _St) -> bool:
        return state.replying > 0

    def step(self, batch: StepBatch[_St]) -> StepResult:
        if self.mode == "crash":
            raise RuntimeError("boom")
        news: list[RequestNews | None] = [None] * len(batch.states)
        ids, audio = [], []
        for i, st in enumerate(batch.states):
            if st.sid == "bad":
                news[i] = RequestNews(error="broken")
            if st.replying:
                st.replying -= 1
                ids.append(batch.req_ids[i])
                audio.append(np.zeros(FRAME, np.float32))
        meta: dict[str, object] = {"sparse_audio": ["1"], "req_id": ids}
        if self.mode == "bad_marker":
            meta = {"sparse_audio": True, "req_id": ids}  # a bool is not a legal carrier
        return StepResult(outputs={"audio": audio, "meta": meta}, news=news)


def test_round_robin_beyond_max_batch_on_the_free_clock() -> None:
    seen: list[list[str]] = []
    done = threading.Event()

    def sink(items: list[tuple[str, OwnerStep]]) -> None:
        for _, step in items:
            if step.step:
                seen.append([rid for rid, _ in step.batch])
        if sum(len(b) for b in seen) >= 30:
            done.set()

    engine = Engine(FakeModel, sink=sink, max_batch=2, clock="free")
    cmds = []
    for i in range(3):
        work = Work(
            APPEND, Fence(f"s{i}", 1, 0), "o", f"r{i}", seq=1, frames=np.zeros((10, FRAME), np.float32)
        )
        cmds.append(Enqueue(work, QueueCounter()))
    engine.submit(cmds)
    engine.start()
    try:
        assert done.wait(10)
    finally:
        engine.stop()
    assert all(len(b) <= 2 for b in seen)
    counts = {r: sum(b.count(r) for b in seen) for r in ("r0", "r1", "r2")}
    assert counts == {"r0": 10, "r1": 10, "r2": 10}
    # Fair while all three had work: nobody waits more than one step.
    first_steps = seen[:9]
    for r in ("r0", "r1", "r2"):
        assert sum(b.count(r) for b in first_steps) >= 5


async def test_model_error_is_per_request_and_bad_legacy_output_fails_closed() -> None:
    before = _fail_closed("illegal_marker")
    async with worker(model_factory=lambda device: FakeModel("bad_marker")) as (_, stub):
        run = RunClient(stub, "o1")
        from duplex.v1 import worker_pb2

        for s in ("bad", "good"):
            await stub.Attach(worker_pb2.AttachRequest(session_id=s, epoch=1, owner="o1"), timeout=5)
        run.send(
            sub("rb", "bad", APPEND, seq=1, data=pcm(np.zeros(FRAME, np.float32))),
            sub("rg", "good", APPEND, seq=1, data=pcm(np.zeros(FRAME, np.float32))),
            sub("rg", "good", COMMIT),
            sub("rg", "good", RESPOND, turn=1),
        )
        msgs = await run.until(lambda m: any(u.input_seq == 1 and u.request_id == "rg" for u in m.updates))
        msgs += await run.quiet(0.3)
        assert error_codes(msgs, "rb") == ["model_error"]
        assert not error_codes(msgs, "rg")
        # The declaration carried a bool marker: every AUDIO step routed nothing.
        assert not any(m.outputs.audio for m in msgs)
        assert sum(1 for m in msgs for e in m.batch if e.request_id == "rg") >= 3
        run.close()
    assert _fail_closed("illegal_marker") >= before + 3


async def test_engine_crash_ends_streams_with_internal_and_stops_serving() -> None:
    async with worker(model_factory=lambda device: FakeModel("crash")) as (server, stub):
        from duplex.v1 import worker_pb2

        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        run.send(sub("r1", "s1", APPEND, seq=1, data=pcm(np.zeros(FRAME, np.float32))))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run.recv(5)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        async with grpc.aio.insecure_channel(server.address) as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_synthetic_model_replies_sparsely() -> None:
    factory = lambda device: SyntheticModel(device, hidden_size=32, layers=2, emit_every=2, reply_frames=4)  # noqa: E731
    async with worker(model_factory=factory) as (_, stub):
        from duplex.v1 import worker_pb2

        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        run.send(
            sub("r1", "s1", APPEND, seq=1, data=pcm(np.zeros(2 * FRAME, np.float32))),
            sub("r1", "s1", COMMIT),
            sub("r1", "s1", RESPOND, turn=1),
        )
        msgs = await run.until(lambda m: any(u.response_finished for u in m.updates))
        stepped = [m for m in msgs if m.step and m.batch]
        with_audio = [m for m in stepped if m.outputs.audio]
        assert len(with_audio) == 4
        assert all(m.outputs.sparse_audio and list(m.outputs.req_id) == ["r1"] for m in with_audio)
        assert all(len(m.outputs.audio[0].pcm) == 2 * FRAME for m in with_audio)
        assert len(stepped) > len(with_audio)  # every other step of the reply is silent
        run.close()


def _fail_closed(cause: str) -> float:
    return REGISTRY.get_sample_value("duplex_sparse_fail_closed_total", {"cause": cause}) or 0.0


class _LongFrames(FakeModel):
    """4 s frames: step intervals of seconds, so that the tests wait on nothing a busy machine
    could stretch."""

    frame_samples = 4 * PCM16K_MONO.sample_rate_hz


class _Steps:
    """A sink recording, in order and with the time it came, each step's requests and each update
    that came apart from a step."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, list[str]]] = []
        self.cond = threading.Condition()

    def __call__(self, items: list[tuple[str, OwnerStep]]) -> None:
        now = time.monotonic()
        with self.cond:
            for _, step in items:
                if step.step:
                    self.events.append((now, "step", [rid for rid, _ in step.batch]))
                for u in step.updates:
                    if u.error is not None:
                        self.events.append((now, "error", [u.request_id]))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[tuple[float, str, list[str]]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= n, timeout), self.events
            return list(self.events)


def _append(i: int, frames: int = 1) -> Enqueue:
    pcm_frames = np.zeros((frames, _LongFrames.frame_samples), np.float32)
    work = Work(APPEND, Fence(f"s{i}", 1, 0), "o", f"r{i}", seq=1, frames=pcm_frames)
    return Enqueue(work, QueueCounter())


@contextmanager
def _stepped_once(
    model: type[FakeModel], *, step_interval_s: float, max_batch: int = 8
) -> Iterator[tuple[Engine, _Steps]]:
    """A running engine whose first step (r0, one frame) is done: the interval runs from it."""
    steps = _Steps()
    engine = Engine(model, sink=steps, max_batch=max_batch, step_interval_s=step_interval_s, clock="free")
    engine.start()
    try:
        engine.submit([_append(0)])
        steps.wait_for(1)  # the first step starts at once: no step before it
        yield engine, steps
    finally:
        engine.stop()


def test_step_interval_gathers_the_inputs_that_arrive_within_it_into_one_step() -> None:
    with _stepped_once(_LongFrames, step_interval_s=0.5) as (engine, steps):
        for i in (1, 2, 3):
            time.sleep(0.03)  # without the interval, each would take a step of its own
            engine.submit([_append(i)])
        events = steps.wait_for(2)
    assert [(kind, rids) for _, kind, rids in events] == [("step", ["r0"]), ("step", ["r1", "r2", "r3"])]
    # The second waited out the interval (timed at the sink, after each step: some slack for
    # a thread scheduled late; without the interval it would come ~0.03 s after the first).
    assert events[1][0] - events[0][0] >= 0.35


class _NoState(_LongFrames):
    def create_state(self, session_id: str) -> _St:
        if session_id == "s9":
            raise RuntimeError("no state for this one")
        return _St(session_id)


def test_commands_are_applied_during_the_step_interval_and_a_full_batch_steps_at_once() -> None:
    with _stepped_once(_NoState, step_interval_s=3.0, max_batch=2) as (engine, steps):
        engine.submit([_append(1)])  # waits for the interval...
        engine.submit([_append(9)])  # ...but this command is applied now: its error comes at once
        events = steps.wait_for(2)
        assert [(kind, rids) for _, kind, rids in events[1:]] == [("error", ["r9"])]
        assert events[1][0] - events[0][0] < 2.0  # well before the interval ends
        engine.submit([_append(2)])  # r1 and r2 runnable: max_batch, no more waiting
        events = steps.wait_for(3)
    assert [(kind, rids) for _, kind, rids in events[2:]] == [("step", ["r1", "r2"])]
    assert events[2][0] - events[0][0] < 2.0


def test_a_request_behind_steps_at_once_and_the_interval_stays_below_the_frame_period() -> None:
    with _stepped_once(_LongFrames, step_interval_s=1.5) as (engine, steps):
        engine.submit([_append(1, frames=2)])  # two frames queued: behind, its first steps at once
        events = steps.wait_for(3)
    assert [(kind, rids) for _, kind, rids in events] == [
        ("step", ["r0"]),
        ("step", ["r1"]),
        ("step", ["r1"]),
    ]
    assert events[1][0] - events[0][0] < 1.0  # well before the interval ends
    assert events[2][0] - events[1][0] >= 1.2  # one frame left: no longer behind, so it waits
    # An interval a model's frame could not keep up with fails the engine as it loads.
    failed: list[BaseException] = []
    engine = Engine(
        FakeModel, sink=lambda items: None, step_interval_s=0.032, on_fatal=failed.append, clock="free"
    )
    engine.start()
    engine.stop()
    assert engine.dead is not None and "frame period (32 ms)" in str(engine.dead) and failed == [engine.dead]


def test_step_interval_is_bounded_in_the_config() -> None:
    assert WorkerConfig().step_interval_ms == 0.0
    args = build_parser().parse_args(["--step-interval-ms", "8"])
    assert config_from_args(args).step_interval_ms == 8.0
    assert WorkerConfig(step_interval_ms=16.0).step_interval_ms == 16.0
    for bad in (-1.0, 1000.5, float("nan")):
        with pytest.raises(ValueError, match="step_interval_ms"):
            WorkerConfig(step_interval_ms=bad)
    with pytest.raises(ValueError, match="step_interval_s"):
        Engine(FakeModel, sink=lambda items: None, step_interval_s=-0.1)


class _SecondFrames(FakeModel):
    """1 s frames: a frame clock ticking once a second."""

    frame_samples = PCM16K_MONO.sample_rate_hz


class _FreeSecondFrames(_SecondFrames):
    free_running = True


def _frames(i: int, frames: int) -> Enqueue:
    work = Work(
        APPEND,
        Fence(f"s{i}", 1, 0),
        "o",
        f"r{i}",
        seq=1,
        frames=np.zeros((frames, _SecondFrames.frame_samples), np.float32),
    )
    return Enqueue(work, QueueCounter())


def test_the_frame_clock_steps_every_runnable_request_once_per_tick() -> None:
    steps = _Steps()
    engine = Engine(_SecondFrames, sink=steps, max_batch=2)  # the frame clock is the default
    engine.start()
    try:
        engine.submit([_frames(0, 1)])
        steps.wait_for(1)  # the first tick is at once
        time.sleep(0.3)  # past the tick's late joins (a quarter of its period)
        for i in (1, 2, 3):
            time.sleep(0.05)  # on the free clock each would take a step of its own, at once
            engine.submit([_frames(i, 1)])
        events = steps.wait_for(3)
    finally:
        engine.stop()
    # All three in the next tick: one step for the batch, in chunks of max_batch.
    assert [(kind, rids) for _, kind, rids in events] == [
        ("step", ["r0"]),
        ("step", ["r1", "r2"]),
        ("step", ["r3"]),
    ]
    assert events[1][0] - events[0][0] >= 0.7  # waited for the tick (one frame period)
    assert events[2][0] - events[1][0] < 0.5  # the chunks of one tick go together


def test_input_that_comes_just_after_a_tick_it_missed_joins_it_late() -> None:
    """Input of a request the tick did not step, coming within a quarter period after the tick
    began (a command late for it), is stepped at once; a request the tick stepped waits for the
    next tick, and so does input coming after the quarter."""
    steps = _Steps()
    engine = Engine(_SecondFrames, sink=steps)
    late = REGISTRY.get_sample_value("duplex_worker_late_joins_total") or 0.0
    engine.start()
    try:
        engine.submit([_frames(0, 1)])
        t0 = steps.wait_for(1)[0][0]  # the first tick is at once
        engine.submit([_frames(1, 1), _frames(0, 1)], appends_only=True)  # late for it
        events = steps.wait_for(2)
        time.sleep(max(0.0, t0 + 0.35 - time.monotonic()))  # past the quarter
        engine.submit([_frames(2, 1)], appends_only=True)
        events = steps.wait_for(3)
    finally:
        engine.stop()
    assert [rids for _, _, rids in events] == [["r0"], ["r1"], ["r0", "r2"]]
    assert events[1][0] - t0 < 0.2  # s1 joined the first tick, late; s0 had stepped in it
    assert events[2][0] - t0 >= 0.9  # the next tick
    assert (REGISTRY.get_sample_value("duplex_worker_late_joins_total") or 0.0) - late == 1


def test_on_the_frame_clock_an_append_waits_for_the_tick_without_waking_the_engine() -> None:
    """Each wake of the engine thread is a GIL hand-over on the worker's event loop: an append
    arriving while the engine waits for its next tick is applied at that tick, not at once (two
    commands a tick cost a third more per session-frame when each woke it). Control work
    still wakes it at once."""
    steps = _Steps()
    engine = Engine(_SecondFrames, sink=steps)
    engine.start()
    try:
        engine.submit([_frames(0, 2)])  # one frame a tick: s0 stays runnable, the engine waits
        steps.wait_for(1)
        time.sleep(0.3)  # past the tick's late joins (a quarter of its period)
        engine.submit([_frames(1, 1)], appends_only=True)  # as the worker's command handler says
        time.sleep(0.2)
        assert engine.active_requests == 1  # s1's append waits in the inbox for the tick
        engine.submit([AbortOlder("s0", 2)])  # control: woken at once, s1 applied with it
        deadline = time.monotonic() + 0.5
        while engine.active_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.active_requests == 2
    finally:
        engine.stop()


async def test_the_command_handler_says_appends_only_exactly_when_a_command_holds_nothing_else() -> None:
    from duplex.v1 import worker_pb2
    from worker_service.engine_types import CommandMark

    said: list[bool] = []
    async with worker(model_factory=lambda device: FakeModel()) as (server, stub):
        submit = server.engine.submit

        def recording(commands: list[object], *, appends_only: bool = False) -> None:
            if any(not isinstance(c, CommandMark) or c.count for c in commands):  # not a stream's end
                said.append(appends_only)
            submit(commands, appends_only=appends_only)  # type: ignore[arg-type]

        server.engine.submit = recording  # type: ignore[method-assign]
        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        frame = pcm(np.zeros(FRAME, np.float32))
        run.send(sub("r1", "s1", APPEND, seq=1, data=frame))
        await run.until(lambda m: any(u.input_seq == 1 for u in m.updates))
        run.send(sub("r1", "s1", APPEND, seq=2, data=frame), sub("r1", "s1", COMMIT))
        await run.until(lambda m: any(u.committed_samples for u in m.updates))
        run.close()
    # Commands of APPENDs alone (the first may be the stream's empty opening one), then the COMMIT's.
    assert said[-1] is False and all(said[:-1]) and len(said) >= 2, said


def test_a_request_behind_catches_up_by_extra_frames_in_the_next_ticks() -> None:
    steps = _Steps()
    engine = Engine(_SecondFrames, sink=steps, max_batch=8)
    # Queued before the engine starts: both are there for the first tick.
    engine.submit([_frames(0, 5), _frames(1, 3)])
    engine.start()
    try:
        events = steps.wait_for(5)
    finally:
        engine.stop()
    assert [rids for _, _, rids in events] == [
        ["r0", "r1"],  # the tick's step
        ["r0", "r1"],  # catching up: r0 is behind; r1 still has a frame and shares the step
        ["r0", "r1"],
        ["r0"],  # r0 still has two left: behind
        ["r0"],  # next tick: one left after a step is not behind, so it waited for this tick
    ]
    t = [when for when, _, _ in events]
    assert t[3] - t[0] < 0.5  # four steps in the first tick
    assert t[4] - t[3] >= 0.7  # then one per tick


def test_a_free_running_model_is_stepped_as_its_input_comes() -> None:
    steps = _Steps()
    engine = Engine(_FreeSecondFrames, sink=steps)  # asks for free steps: the clock does not apply
    engine.start()
    try:
        engine.submit([_frames(0, 3)])
        events = steps.wait_for(3)
    finally:
        engine.stop()
    assert [rids for _, _, rids in events] == [["r0"], ["r0"], ["r0"]]
    assert events[2][0] - events[0][0] < 0.7  # not one a second


def test_the_clock_is_a_config_choice() -> None:
    assert WorkerConfig().clock == "frame"
    assert config_from_args(build_parser().parse_args(["--clock", "free"])).clock == "free"
    with pytest.raises(ValueError, match="clock"):
        WorkerConfig(clock="fast")  # type: ignore[arg-type]  # what the check is for
    with pytest.raises(ValueError, match="clock"):
        Engine(FakeModel, sink=lambda items: None, clock="fast")  # type: ignore[arg-type]  # likewise


@pytest.mark.parametrize("clock", ["frame", "free"])
async def test_a_step_says_when_the_next_tick_is(clock: str) -> None:
    from duplex.v1 import worker_pb2

    async with worker(model_factory=lambda device: FakeModel(), clock=clock) as (_, stub):
        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        run.send(sub("r1", "s1", APPEND, seq=1, data=pcm(np.zeros(FRAME, np.float32))))
        msgs = await run.until(lambda m: m.step > 0)
        run.close()
    step = next(m for m in msgs if m.step > 0)
    if clock == "frame":
        assert 0 < step.next_tick_us <= 32_000  # within one frame period of the step
        assert step.commands_applied == 2  # the stream's first command and the APPEND's
    else:
        assert step.next_tick_us == 0  # no clock to announce
        assert step.commands_applied == 0  # nor any tick a command could make


async def test_each_step_says_how_many_of_the_streams_commands_it_had() -> None:
    """``commands_applied`` counts the stream's commands (its first is 1) applied when the step
    began: a step that consumed a command's frame counts that command, the count never goes
    down, and never counts a command not yet sent. A new stream counts from 1 again, and the
    engine forgets the count of a stream that ended."""
    from duplex.v1 import worker_pb2

    async with worker(model_factory=lambda device: FakeModel()) as (server, stub):
        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        sent = 1
        carried: dict[int, int] = {}  # seq -> the number of the command that carried it
        for seq in range(1, 7):
            run.send(sub("r1", "s1", APPEND, seq=seq, data=pcm(np.zeros(FRAME, np.float32))))
            sent += 1
            carried[seq] = sent
            if seq % 2:
                await asyncio.sleep(0.05)  # some commands between ticks, some together
        msgs = await run.until(lambda m: m.step > 0 and any(u.input_seq == 6 for u in m.updates))
        steps = [m for m in msgs if m.step > 0]
        counts = [m.commands_applied for m in steps]
        assert counts == sorted(counts) and counts[-1] == sent
        for m in steps:
            for u in m.updates:
                if u.input_seq:
                    assert m.commands_applied >= carried[u.input_seq]
        run.close()
        engine = server.engine
        await asyncio.sleep(0.1)
        run2 = RunClient(stub, "o1")
        run2.send(sub("r1", "s1", APPEND, seq=7, data=pcm(np.zeros(FRAME, np.float32))))
        msgs = await run2.until(lambda m: m.step > 0)
        assert next(m for m in msgs if m.step > 0).commands_applied == 2
        run2.close()
        for _ in range(100):  # the engine applies the stream's end at its next iteration
            if not len(engine._marks):
                break
            await asyncio.sleep(0.05)
        assert len(engine._marks) == 0


def test_the_end_of_an_older_stream_leaves_a_newer_streams_count() -> None:
    from worker_service.engine_types import CommandMark, CommandMarks

    marks = CommandMarks()
    marks.apply(CommandMark("o1", stream=1, count=5))
    marks.apply(CommandMark("o1", stream=2, count=1))  # the owner reconnected
    marks.apply(CommandMark("o1", stream=1, count=0))  # the old stream's end comes late
    assert marks.count("o1") == 1
    marks.apply(CommandMark("o1", stream=2, count=0))
    assert marks.count("o1") == 0 and len(marks) == 0


def test_on_the_frame_clock_control_work_with_no_input_ahead_is_applied_as_it_comes() -> None:
    """A COMMIT with no frame queued before it is not a model step: its news comes at once, not
    at the next tick; one behind a queued frame waits for that frame's tick (order is kept)."""
    steps = _Steps()
    engine = Engine(_SecondFrames, sink=steps)
    committed: list[float] = []

    def sink(items: list[tuple[str, OwnerStep]]) -> None:
        steps(items)
        if any(u.committed_samples for _, step in items for u in step.updates):
            committed.append(time.monotonic())

    engine = Engine(_SecondFrames, sink=sink)
    engine.start()
    try:
        engine.submit([_frames(0, 1)])
        steps.wait_for(1)  # the first tick; the next is a second away
        t0 = time.monotonic()
        engine.submit([Enqueue(Work(COMMIT, Fence("s0", 1, 0), "o", "r0"), QueueCounter())])
        deadline = time.monotonic() + 5
        while not committed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert committed and committed[0] - t0 < 0.5  # well before the next tick
        # Behind a frame, a COMMIT waits for that frame's step: no reordering.
        engine.submit([_frames(0, 1), Enqueue(Work(COMMIT, Fence("s0", 1, 0), "o", "r0"), QueueCounter())])
        while len(committed) < 2 and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        events = steps.wait_for(2)
        assert len(committed) == 2 and committed[1] >= events[1][0] - 0.01
    finally:
        engine.stop()


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _model_cpu(part: str) -> float:
    return REGISTRY.get_sample_value("duplex_worker_model_cpu_seconds_total", {"part": part}) or 0.0


class _BusyStep(_LongFrames):
    """Each step spends 20 ms of CPU in the model's own code, and so does making a request's
    state, which is not a step."""

    def create_state(self, session_id: str) -> _St:
        _burn(0.1)
        return super().create_state(session_id)

    def step(self, batch: StepBatch[_St]) -> StepResult:
        _burn(0.02)
        return super().step(batch)


def test_the_model_step_cpu_counter_holds_the_steps_alone() -> None:
    before = _model_cpu("step")
    with _stepped_once(_BusyStep, step_interval_s=0.0) as (engine, steps):
        engine.submit([_append(1), _append(2)])
        steps.wait_for(2)
        counted = _model_cpu("step") - before
    # Two or three steps of 20 ms each; not the three states' 300 ms made around them.
    assert 0.04 <= counted < 0.1


def test_run_as_helper_counts_its_work_as_the_model_s_and_returns_its_result() -> None:
    before = _model_cpu("helpers")
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_as_helper(lambda: (_burn(0.03), 7)[1])))
    thread.start()
    thread.join(10)
    assert result == [7]
    assert _model_cpu("helpers") - before >= 0.03
    with pytest.raises(ZeroDivisionError):  # a failure is the caller's, its CPU still counted
        run_as_helper(lambda: (_burn(0.01), 1 // 0)[1])
    assert _model_cpu("helpers") - before >= 0.04


class _SlowFrames(FakeModel):
    """100 ms frames whose step takes 60 ms of wall time: a tick load of about 0.6, over the
    bound of the test below whatever the number of sessions."""

    frame_samples = PCM16K_MONO.sample_rate_hz // 10

    def step(self, batch: StepBatch[_St]) -> StepResult:
        time.sleep(0.06)
        return super().step(batch)


def test_one_more_session_is_taken_while_the_measured_tick_says_it_keeps_real_time() -> None:
    engine = Engine(FakeModel, sink=lambda items: None)
    engine.model = FakeModel()
    assert engine.takes_one_more(4, 0.9)  # nothing measured yet
    engine.tick_load = 0.6
    assert engine.takes_one_more(4, 0.9)  # 0.6 * 5 / 4 = 0.75
    assert not engine.takes_one_more(5, 0.7)  # 0.6 * 6 / 5 = 0.72
    engine.tick_load = 0.72
    assert engine.takes_one_more(8, 0.81) and not engine.takes_one_more(8, 0.8)  # 0.72 * 9 / 8 = 0.81
    # With few sessions a tick's cost is mostly fixed: taken while the tick is within the bound.
    assert engine.takes_one_more(1, 0.9) and not engine.takes_one_more(1, 0.7)
    assert engine.takes_one_more(1, 0)  # no bound
    engine.model.fixed_batch = True  # slots: one more costs nothing more
    assert engine.takes_one_more(100, 0.9) and not engine.takes_one_more(100, 0.5)


async def test_a_worker_at_its_real_time_limit_refuses_new_sessions_and_counts_them() -> None:
    from duplex.v1 import worker_pb2

    refused = {"reason": "real_time"}
    before = REGISTRY.get_sample_value("duplex_worker_sessions_refused_total", refused) or 0.0
    async with worker(model_factory=lambda device: _SlowFrames(), max_tick_load=0.5) as (_, stub):
        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        run.send(sub("r1", "s1", APPEND, seq=1, data=pcm(np.zeros(20 * 1600, np.float32))))
        await run.until(lambda m: m.step >= 5)
        # Each tick's step takes about 0.6 of the frame, past the bound: no new session.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Attach(worker_pb2.AttachRequest(session_id="s2", epoch=1, owner="o1"), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert from_rpc_error(err.value).code == "capacity_exhausted"
        assert "real time" in (err.value.details() or "")
        # The session it holds is not refused anything.
        await stub.Attach(worker_pb2.AttachRequest(session_id="s1", epoch=1, owner="o1"), timeout=5)
        run.close()
    assert REGISTRY.get_sample_value("duplex_worker_sessions_refused_total", refused) == before + 1
