"""``benchmarks.frame_trace`` counts the hand-offs it observes -- between threads, between asyncio
tasks and loop callbacks, and the queue and event wake-ups behind them -- instead of naming
them from a fixed table; and it traces a 20 ms append that completes one worker frame."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading

import pytest

from benchmarks import frame_trace
from benchmarks.frame_trace import WORKER_FRAME, Recorder, priming

HERE = "tests/test_frame_trace.py"


def step(x: int) -> int:
    return x + 1


def crunch(x: int) -> int:
    return x * 2


async def scenario(rec: Recorder) -> None:
    """task producer -(asyncio.Queue)-> task consumer -(queue.Queue)-> a thread
    -(call_soon_threadsafe)-> a loop callback -(asyncio.Event)-> this task, strictly in turn."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[int] = asyncio.Queue()
    tq: queue.Queue[int] = queue.Queue()
    done = asyncio.Event()

    def on_loop(x: int) -> None:
        step(x)
        done.set()

    def worker() -> None:
        x = crunch(tq.get(timeout=30))
        loop.call_soon_threadsafe(on_loop, x)

    async def consumer() -> None:
        x = step(await q.get())
        tq.put(x)

    async def producer() -> None:
        q.put_nowait(step(0))

    thread = threading.Thread(target=worker, name="helper")
    thread.start()
    waiting = asyncio.create_task(consumer())
    await asyncio.sleep(0)  # the consumer waits on the queue
    rec.armed = True
    asyncio.create_task(producer())  # noqa: RUF006  # it ends before `done` is set
    await asyncio.wait_for(done.wait(), 30)
    rec.armed = False
    await waiting
    thread.join(30)


def test_recorder_counts_each_hand_off_and_the_wake_up_behind_it() -> None:
    rec = Recorder(packages=(HERE,))
    threading.setprofile(rec)
    sys.setprofile(rec)
    try:
        asyncio.run(scenario(rec))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    kinds = [h.kind for h in rec.handoffs]
    assert kinds == ["task", "thread", "thread", "task"]
    via = [[note.split(" in ")[0] for note in h.via] for h in rec.handoffs]
    assert via == [
        ["asyncio.Queue.put_nowait"],
        ["queue.Queue.put"],
        ["loop.call_soon_threadsafe"],
        ["asyncio.Event.set"],
    ]
    names = [(rec.name(h.source), rec.name(h.target)) for h in rec.handoffs]
    assert names[0] == (
        "MainThread: task scenario.<locals>.producer",
        "MainThread: task scenario.<locals>.consumer",
    )
    assert names[1][1] == "thread helper"
    assert names[2] == ("thread helper", "MainThread: loop callback")
    assert names[3][1] == "MainThread: task scenario"
    assert [h.function for h in rec.handoffs][1] == f"{HERE}:crunch"
    assert len(rec.wakeups) == 4
    summary = frame_trace.summary(frame_trace.Trace(20.0, 1, rec, 0.01))
    assert (summary["handoffs"], summary["thread_handoffs"], summary["task_handoffs"]) == (4, 2, 2)
    assert summary["queue_handoffs"] == 4
    assert [p["to"] for p in summary["path"]] == [n[1] for n in names]


@pytest.mark.parametrize("append_ms", [20, 32, 40])
def test_priming_leaves_the_traced_append_one_worker_frame_to_complete(append_ms: int) -> None:
    samples = 16 * append_ms
    speech = b"\1\0" * 54_321
    chunks = priming(speech, samples)
    assert b"".join(chunks).startswith(speech)
    assert all(len(c) == 2 * samples for c in chunks[:-2])  # appends of the traced one's size
    held = (sum(len(c) for c in chunks) // 2) % WORKER_FRAME
    assert (held + samples) // WORKER_FRAME == 1
    if samples <= WORKER_FRAME:
        assert held + samples == WORKER_FRAME  # nothing left held back after it


@pytest.mark.process
def test_trace_of_a_20_ms_append_observes_its_hand_offs() -> None:
    """The real thing, in this process: a parrot worker and a session service."""
    t = asyncio.run(frame_trace.trace(20.0))
    s = frame_trace.summary(t)
    assert (t.append_ms, t.worker_frames) == (20.0, 1)
    assert "worker_service/engine.py" in s["modules"]
    assert s["thread_handoffs"] >= 2  # into the engine thread and back to the event loop
    assert s["task_handoffs"] >= 2
    assert s["handoffs"] == len(s["path"]) == s["thread_handoffs"] + s["task_handoffs"]
    assert s["queue_handoffs"] >= 1
