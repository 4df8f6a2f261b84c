"""The worker link's sender: submissions that arrive within the coalescing window share one
``WorkerCommand``; without a window each is written at once."""

from __future__ import annotations

import asyncio
import contextlib

from duplex.v1 import worker_pb2
from session_service.plugins.parrot import ParrotPlugin
from session_service.worker_link import WorkerLink


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


async def _send(coalesce_s: float) -> list[list[str]]:
    """Three sessions submit 10 ms apart; returns the request ids of each command written."""
    link, call = _link(coalesce_s), _Recorder()
    sender = asyncio.create_task(link._send_loop(call))  # type: ignore[arg-type]
    try:
        written = []
        for sid in ("s1", "s2", "s3"):
            written.append(link.submit([worker_pb2.Submission(request_id=sid)]))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*written), 2)  # every writer hears its write
        return [[sub.request_id for sub in cmd.submit] for cmd in call.commands]
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender


async def test_submissions_within_the_window_share_one_command() -> None:
    assert await _send(0.2) == [["s1", "s2", "s3"]]


async def test_without_a_window_each_submission_is_written_at_once() -> None:
    assert await _send(0.0) == [["s1"], ["s2"], ["s3"]]
