"""The session's view of a worker it is placed on, and how a session is placed on one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from duplex.v1 import worker_pb2


class WorkerHandle(Protocol):
    """The runner's view of the worker its session is placed on (a ``WorkerLink``)."""

    address: str
    worker_id: str | None  # the worker's own id (Describe), named in resume tokens; None: unknown

    @property
    def healthy(self) -> bool: ...

    def submit(self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False) -> asyncio.Future[None]:
        """Queue submissions; the future resolves once they are written to the Run stream.
        ``prompt``: the client hears of them once written (an ``input_ack``): the link writes
        them at its next write point, not only once a tick."""
        ...

    def abort(self, abort: worker_pb2.Abort) -> None: ...

    def release(self, release: worker_pb2.Release) -> None: ...


#: (session_id, epoch, takeover) -> (worker, granted epoch); raises a DuplexError.
Placer = Callable[[str, int, bool], Awaitable[tuple[WorkerHandle, int]]]
