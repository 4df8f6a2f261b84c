"""The worker link's sender: submissions of sessions that arrive within the coalescing window
share one ``WorkerCommand``; a lone session, or a link without a window, is written at once."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from duplex.v1 import worker_pb2
from session_service.plugins.parrot import ParrotPlugin
from session_service.workers.link import WorkerLink


class _Recorder:
    """A Run call that records the commands written to it."""

    def __init__(self) -> None:
        self.commands: list[worker_pb2.WorkerCommand] = []

    async def write(self, cmd: worker_pb2.WorkerCommand) -> None:
        self.commands.append(cmd)


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
    assert link._senders == set()  # nothing to look at: it must not grow with every session


def test_the_write_window_flag_is_bounded() -> None:
    from session_service.api.cli import config_from_args

    base = ["--plugin", "session_service.plugins.parrot:ParrotPlugin", "--workers", "127.0.0.1:1"]
    assert config_from_args(base).worker_write_coalesce_ms == 2.0
    assert config_from_args([*base, "--worker-write-coalesce-ms", "0"]).worker_write_coalesce_ms == 0
    for bad in ("-1", "51", "nan"):
        with pytest.raises(SystemExit):
            config_from_args([*base, "--worker-write-coalesce-ms", bad])
