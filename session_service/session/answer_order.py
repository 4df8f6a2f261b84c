"""The order a session's appends are answered in, when some answers wait for a write.

An append the runner applies at once (in the client stream's reader, ``SessionRunner.post``) is
acked only once the worker link has written it; an append after it may be answered sooner (a
part of a frame, a refusal). ``AnswerOrder`` gives every append a place in line and runs the
answers in that order, whenever each is ready; the runner waits for the line to empty before
anything else it handles, as it did when it awaited each write itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["AnswerOrder"]


class AnswerOrder:
    """Runs each append's answer in the order the appends came, whenever each is ready: an
    append applied at once is answered when its write is done, and none overtakes it."""

    def __init__(self, *, closed: Callable[[], bool]) -> None:
        self._closed = closed
        self._issued = 0
        self._next = 0
        self._ready: dict[int, Callable[[], None]] = {}
        self._settled: asyncio.Future[None] | None = None

    async def settled(self) -> None:
        """Returns once every append so far is answered (the runner handles its next item
        then, as it did when it awaited each append's write itself)."""
        while self._next < self._issued:
            if self._settled is None:
                self._settled = asyncio.get_running_loop().create_future()
            await self._settled

    def later(self) -> int:
        """A place in line for an answer given later (``then``)."""
        self._issued += 1
        return self._issued - 1

    def now(self, answer: Callable[[], None]) -> None:
        """An answer ready now: given at once unless an earlier one waits."""
        if self._next == self._issued:  # the common case: nothing waits, nothing to store
            self._issued += 1
            self._next += 1
            if not self._closed():
                answer()
            return
        self.then(self.later(), answer)

    def then(self, ticket: int, answer: Callable[[], None]) -> None:
        """The answer of ``ticket`` is ready: given with every ready one in line after it
        (none once the session is closed)."""
        self._ready[ticket] = answer
        while self._next in self._ready:
            ready = self._ready.pop(self._next)
            self._next += 1
            if not self._closed():
                ready()
        if self._next == self._issued and self._settled is not None:
            self._settled.set_result(None)
            self._settled = None
