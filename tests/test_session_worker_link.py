"""The worker link's sender: submissions of sessions that arrive within the coalescing window
share one ``WorkerCommand``; a lone session, or a link without a window, is written at once."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from duplex.v1 import common_pb2, worker_pb2
from session_service.plugins.parrot import ParrotPlugin
from session_service.workers.link import WorkerLink


class _Recorder:
    """A Run call that records the commands written to it."""

    def __init__(self) -> None:
        self.commands: list[worker_pb2.WorkerCommand] = []
        self.written_at: list[float] = []
        """The loop's time of each write."""

    async def write(self, cmd: worker_pb2.WorkerCommand) -> None:
        self.commands.append(cmd)
        self.written_at.append(asyncio.get_running_loop().time())


def _link(coalesce_s: float) -> WorkerLink:
    link = WorkerLink(
        "127.0.0.1:9",
        owner="replica-c",
        plugin=ParrotPlugin(),
        on_step=lambda _l, _s: None,
        on_lost=lambda _l: None,
        on_health=lambda: None,
        write_coalesce_s=coalesce_s,
    )
    link._healthy = True  # as on an open stream (the test drives the sender itself)
    return link


async def _send(coalesce_s: float, sids: tuple[str, ...], *, warm: tuple[str, ...] = ()) -> list[list[str]]:
    """``warm`` sessions submit every 10 ms for a while, then ``sids`` submit 10 ms apart;
    returns the request ids of each command written after the warm-up."""
    link, call = _link(coalesce_s), _Recorder()
    sender = asyncio.create_task(link._send_loop(call))  # type: ignore[arg-type]
    try:
        # 50 ms of the warm sessions submitting (the link looks who does), well inside one
        # 200 ms window: a warm-up as long as the window could end just after a look and leave
        # the next one empty, a stall of a few ms deciding the test.
        warming = []
        for _ in range(5):
            warming += [link.submit([worker_pb2.Submission(request_id=sid)]) for sid in warm]
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*warming), 2)  # every warm-up command written
        before = len(call.commands)
        written = []
        for sid in sids:
            written.append(link.submit([worker_pb2.Submission(request_id=sid)]))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*written), 2)  # every writer hears its write
        return [[sub.request_id for sub in cmd.submit] for cmd in call.commands[before:]]
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender


async def test_submissions_of_sessions_within_the_window_share_one_command() -> None:
    assert await _send(0.2, ("s1", "s2", "s3"), warm=("s1", "s2")) == [["s1", "s2", "s3"]]


async def test_a_lone_session_is_never_held_back_by_the_window() -> None:
    # Nobody else submits on the link: waiting would only slow this session down.
    assert await _send(0.2, ("s1", "s1", "s1"), warm=("s1",)) == [["s1"], ["s1"], ["s1"]]


async def test_without_a_window_each_submission_is_written_at_once() -> None:
    assert await _send(0.0, ("s1", "s2", "s3"), warm=("s1", "s2")) == [["s1"], ["s2"], ["s3"]]


async def test_without_a_window_the_link_keeps_no_record_of_who_submits() -> None:
    link = _link(0.0)
    for i in range(100):
        link.submit([worker_pb2.Submission(request_id=f"s{i}")])
    assert link.pacer.senders == set()  # nothing to look at: it must not grow with every session


def test_the_write_window_flag_is_bounded() -> None:
    from session_service.api.cli import config_from_args

    base = ["--plugin", "session_service.plugins.parrot:ParrotPlugin", "--workers", "127.0.0.1:1"]
    assert config_from_args(base).worker_write_coalesce_ms == 2.0
    assert config_from_args([*base, "--worker-write-coalesce-ms", "0"]).worker_write_coalesce_ms == 0
    for bad in ("-1", "51", "nan"):
        with pytest.raises(SystemExit):
            config_from_args([*base, "--worker-write-coalesce-ms", bad])


def test_next_tick_is_the_first_one_not_past_and_never_one_already_written_for() -> None:
    from session_service.workers.write_pacing import next_tick

    assert next_tick(now=10.0, announced=10.5, period=1.0, written_for=0.0) == 10.5
    # Announced ticks are projected forward a period at a time.
    assert next_tick(now=12.2, announced=10.5, period=1.0, written_for=0.0) == 12.5
    # A command was written for 12.5 already: what comes after it waits for 13.5.
    assert next_tick(now=12.2, announced=10.5, period=1.0, written_for=12.5) == 13.5


async def _clocked(subs_then_abort: bool) -> tuple[list[worker_pb2.WorkerCommand], list[float], float]:
    """A link told the worker's next tick is 0.3 s away (a 0.5 s frame period); three sessions
    submit 10 ms apart, then (``subs_then_abort``) an abort comes. Returns the commands written,
    when each was written, and when the first submission was made."""
    link, call = _link(0.002), _Recorder()
    written_at = call.written_at
    loop = asyncio.get_running_loop()
    link.pacer.period = 0.5
    link.pacer.tick_at = loop.time() + 0.3
    sender = asyncio.create_task(link._send_loop(call))  # type: ignore[arg-type]
    try:
        # Warm: several sessions submit, so the link waits for others (a lone one would not).
        link.pacer.shared, link.pacer.senders_since = True, loop.time()
        t0 = loop.time()
        futures = []
        for sid in ("s1", "s2", "s3"):
            futures.append(link.submit([worker_pb2.Submission(request_id=sid)]))
            await asyncio.sleep(0.01)
        if subs_then_abort:
            link.abort(worker_pb2.Abort(request_id="s2"))
        await asyncio.wait_for(asyncio.gather(*futures), 2)
        return call.commands, written_at, t0
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender


async def test_against_a_frame_clock_the_link_writes_by_the_tick_just_before_it() -> None:
    commands, written_at, t0 = await _clocked(False)
    assert [[s.request_id for s in c.submit] for c in commands] == [["s1", "s2", "s3"]]
    # Written for the tick (0.3 s away, less the lead), not after the 2 ms window.
    assert written_at[0] - t0 >= 0.15


async def test_an_abort_does_not_wait_for_the_tick() -> None:
    commands, written_at, t0 = await _clocked(True)
    assert [s.request_id for s in commands[0].submit] == ["s1", "s2", "s3"]
    assert [a.request_id for a in commands[0].abort] == ["s2"]
    assert written_at[0] - t0 < 0.15  # at once, well before the tick's write point


# ---- one command per tick, against a worker that says which commands its steps had --------------


def test_a_worker_that_says_what_its_steps_had_judges_each_command_and_moves_the_lead() -> None:
    """Commands written for a tick are judged by the first step of that tick: made when the
    worker had them (``commands_applied`` at least their number), missed otherwise. A miss widens
    the lead by ``LEAD_MISS``, a command that made it narrows it by ``LEAD_MADE``, within bounds;
    commands for a later tick wait for theirs."""
    from session_service.workers import write_pacing as wp

    async def run() -> None:
        loop = asyncio.get_running_loop()
        pacer = wp.WritePacer(0.002)
        pacer.period = 1.0
        pacer.new_stream()  # the stream's first command is number 1
        assert not pacer.told and pacer.heard_tick(500_000) == (0, 0)  # an older worker: not told
        assert not pacer.told
        now = loop.time()
        pacer.wrote(now + 1.0)  # command 2, for the tick 1 s away
        pacer.wrote(now + 2.0)  # command 3, for the tick after
        # A step of the tick before them (it announces the next tick 1 s away): nothing judged.
        assert pacer.heard_tick(1_000_000, commands_applied=1) == (0, 0) and pacer.told
        # The step of command 2's tick (announcing the one 2 s away) had it: made, lead narrows.
        assert pacer.heard_tick(2_000_000, commands_applied=2) == (1, 0)
        assert pacer.lead == pytest.approx(wp.LEAD_START - wp.LEAD_MADE)
        # The step of command 3's tick had only 2 commands: command 3 missed it, lead widens.
        assert pacer.heard_tick(3_000_000, commands_applied=2) == (0, 1)
        assert pacer.lead == pytest.approx(wp.LEAD_START - wp.LEAD_MADE + wp.LEAD_MISS)
        for _ in range(20):
            pacer.wrote(loop.time())
            pacer.heard_tick(1_000_000, commands_applied=1)  # each missed its tick
        assert pacer.lead == wp.LEAD_MAX
        for _ in range(1000):
            pacer.wrote(loop.time())
            pacer.heard_tick(1_000_000, commands_applied=pacer.commands)
        assert pacer.lead == wp.LEAD_MIN
        # A new stream (the worker may be an older one): told again only by its steps.
        pacer.new_stream()
        assert not pacer.told and pacer.commands == 1 and not pacer._targets

    asyncio.run(run())


@pytest.mark.parametrize("told", [False, True])
async def test_a_control_submission_waits_for_the_tick_only_where_the_worker_says_its_commands(
    told: bool,
) -> None:
    """Against a worker that says ``commands_applied`` (one command per tick) a RESPOND (or a
    COMMIT, a CLEAR) waits for the tick's write point with the APPENDs: the worker still applies
    it ahead of the tick. Against one that does not, it is written at once with what is pending
    (the link's older pacing). An abort goes at once either way."""
    from tests.worker_helpers import wait_until

    link, call = _link(0.002), _Recorder()
    loop = asyncio.get_running_loop()
    link.pacer.period = 0.5
    link.pacer.tick_at = loop.time() + 0.4
    link.pacer.told = told
    written_at = call.written_at
    sender = asyncio.create_task(link._send_loop(call))  # type: ignore[arg-type]
    try:
        link.pacer.shared, link.pacer.senders_since = True, loop.time()
        t0 = loop.time()
        first = link.submit([worker_pb2.Submission(request_id="s1", kind=worker_pb2.SUBMISSION_KIND_APPEND)])
        await asyncio.sleep(0.02)
        respond = link.submit(
            [worker_pb2.Submission(request_id="s2", kind=worker_pb2.SUBMISSION_KIND_RESPOND)]
        )
        await asyncio.wait_for(asyncio.gather(first, respond), 2)
        assert [[s.request_id for s in c.submit] for c in call.commands] == [["s1", "s2"]]
        if told:  # the lead before the tick 0.4 s away: 0.4 - 0.25 * 0.5 = 0.275 s
            assert written_at[0] - t0 >= 0.2
        else:  # at once, not at the tick's write point
            assert written_at[0] - t0 < 0.2
        link.submit([worker_pb2.Submission(request_id="s3", kind=worker_pb2.SUBMISSION_KIND_APPEND)])
        t1 = loop.time()
        link.abort(worker_pb2.Abort(request_id="s3"))
        await wait_until(lambda: len(call.commands) == 2)
        assert written_at[1] - t1 < 0.2  # the next tick's write point is ~0.5 s away
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender


async def test_against_a_live_worker_the_link_writes_one_command_per_tick() -> None:
    """Four sessions append a frame each every frame period, at their own phases, to a real
    worker on its frame clock: the link learns that the worker says what its steps had, writes
    about one command per tick (not one per session, nor two per tick), judges its commands,
    and every frame is consumed."""
    from prometheus_client import REGISTRY

    from tests.session_helpers import worker_server
    from tests.worker_helpers import wait_until

    acked: dict[str, int] = {}

    def on_step(_link: WorkerLink, step: worker_pb2.StepOutput) -> None:
        for u in step.updates:
            if u.input_seq:
                acked[u.fence.session_id] = max(acked.get(u.fence.session_id, 0), u.input_seq)
        for rid, seq in zip(step.columns.request_id, step.columns.input_seq, strict=False):
            if seq:
                acked[rid] = max(acked.get(rid, 0), seq)

    sids = [f"t{i}" for i in range(4)]
    frame = b"\x10\x00" * 512
    async with worker_server() as worker:
        link = WorkerLink(
            f"127.0.0.1:{worker.port}",
            owner="replica-t",
            plugin=ParrotPlugin(),
            on_step=on_step,
            on_lost=lambda _l: None,
            on_health=lambda: None,
            write_coalesce_s=0.002,
        )
        link.start()
        try:
            await wait_until(lambda: link.healthy)
            for sid in sids:
                assert await link.attach(sid, 1, takeover=False, deadline_s=5) == 1
            loop = asyncio.get_running_loop()
            period = link.pacer.period

            async def session(i: int, sid: str, seqs: range) -> None:
                await asyncio.sleep(i * period / 4)  # each its own phase
                start = loop.time()
                for n, seq in enumerate(seqs, 1):
                    fence = common_pb2.Fence(session_id=sid, epoch=1)
                    append = worker_pb2.Submission(
                        request_id=sid,
                        fence=fence,
                        kind=worker_pb2.SUBMISSION_KIND_APPEND,
                        seq=seq,
                        pcm=frame,
                    )
                    link.submit([append])
                    await asyncio.sleep(max(0.0, start + n * period - loop.time()))

            def judged() -> float:
                return sum(
                    REGISTRY.get_sample_value(
                        "duplex_session_worker_tick_commands_total", {"worker": link.address, "outcome": o}
                    )
                    or 0.0
                    for o in ("made", "missed")
                )

            await asyncio.gather(*(session(i, sid, range(1, 16)) for i, sid in enumerate(sids)))  # it learns
            assert link.pacer.told
            before, judged_before, t0 = link.commands_sent, judged(), loop.time()
            await asyncio.gather(*(session(i, sid, range(16, 61)) for i, sid in enumerate(sids)))
            ticks = (loop.time() - t0) / period
            written = link.commands_sent - before
            assert written <= ticks + 3, (written, ticks)  # two a tick would be ~2 * ticks
            await wait_until(lambda: all(acked.get(sid) == 60 for sid in sids), within=5)
            assert judged() - judged_before >= written / 2  # judged as their ticks' steps came
        finally:
            await link.close()


@pytest.mark.parametrize("prompt", [False, True])
async def test_what_is_answered_once_written_takes_the_mid_tick_write_point(prompt: bool) -> None:
    """One command a tick, unless a submission's client is answered once it is written (an
    input_ack): then the command goes at the mid-tick write point too, so such acks wait at
    most half a period for the write, not a whole one."""
    link, call = _link(0.002), _Recorder()
    loop = asyncio.get_running_loop()
    link.pacer.period = 0.5
    link.pacer.tick_at = loop.time() + 0.45  # the mid point is 0.2 s away, the tick 0.45 s
    link.pacer.told = True
    sender = asyncio.create_task(link._send_loop(call))  # type: ignore[arg-type]
    try:
        link.pacer.shared, link.pacer.senders_since = True, loop.time()
        t0 = loop.time()
        append = worker_pb2.Submission(request_id="s1", kind=worker_pb2.SUBMISSION_KIND_APPEND)
        await asyncio.wait_for(link.submit([append], prompt=prompt), 2)
        waited = call.written_at[0] - t0
        lead = link.pacer.lead * 0.5
        if prompt:  # the mid point less the lead
            assert 0.2 - lead - 0.05 <= waited < 0.2
        else:  # the tick less the lead
            assert waited >= 0.45 - lead - 0.05
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
