"""The single per-session queue of server events: FIFO, purgeable by epoch, re-attachable.

Every event for a client passes through ONE queue, so nothing can overtake ``audio_cancelled``.
When the epoch advances the queue drops audio of older epochs still waiting in it, and the
consumer checks the epoch once more as it takes an event out (belt and braces).

A resume re-attaches the queue to a new stream. The stream it displaces may be writing an event
it took just before (a write is an await); the new stream takes nothing until that write is
done, so nothing the old stream sends can follow what the new one sends (an ``audio_cancelled``
on the new stream is never followed by older audio on the old one). A displaced stream that does
not finish its write within ``HANDOVER_TIMEOUT_S`` (its client stopped reading) is cut off.

Events are numbered here (``se_1``, ``se_2``, ...), as a stream takes them, not when they are
queued: ids follow the order in which the client receives them. ``opened``, put at the head of
the queue for a resumed stream, therefore comes before, and is numbered before, the events that
waited for that stream; output dropped on the way out (its epoch was left) takes no number; a
displaced stream's farewell takes one only when that stream takes it. So a client that resumes
gets ids that go on exactly after the last it received, unless events were taken by the stream
it left and lost with it (written into a connection that then failed).

A stream takes events in one of two ways. A ``Converse`` stream has a task per session waiting
in ``get``. A ``ConverseMany`` stream, which holds many sessions, has one writer for all of them:
each session's queue calls the stream back (``listen``) when it may have something, and the writer
then ``take``s what is there without waiting, and says when it has ``wrote`` it. The handover
rules are the same for both, and a session may move between the two kinds of stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from duplex.v1 import session_pb2
from session_service.metrics import COALESCED_ACKS, DROPPED, EVENTS_OUT
from session_service.session.lifecycle import DropReason


@dataclass(slots=True)
class _Item:
    event: session_pb2.ServerEvent
    epoch: int | None  # set for epoch-bound output (audio/text deltas); None = always delivered
    size: int
    front: bool = False  # queued ahead of everything (``put_front``)


#: How long a new stream waits for the stream it displaced to finish its last write.
HANDOVER_TIMEOUT_S = 1.0


class Outbound:
    """Server events of one session, consumed by whichever stream is attached now."""

    def __init__(
        self, current_epoch: Callable[[], int], *, limit: int = 8192, limit_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self._current_epoch = current_epoch
        self._limit = limit
        self._limit_bytes = limit_bytes
        self._bytes = 0
        self._items: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._attachment = 0
        self._farewells: dict[int, session_pb2.ServerEvent] = {}
        self._closed = False
        self.overflowed = False
        """The client stopped reading: a ``put`` passed a limit. Nothing more is queued; the
        session's shell checks this once per item it handles and closes the session
        (``slow_consumer``). A state, not an exception every emit could raise."""
        self._writer = 0
        """The attachment whose last taken event may still be being written (0: none)."""
        self._written = asyncio.Event()
        self._written.set()
        self._cut_offs: dict[int, Callable[[], None]] = {}
        self._listeners: dict[int, Callable[[], None]] = {}
        self._handover_timer: tuple[int, asyncio.TimerHandle] | None = None
        """(the displaced writer a ``take`` waits for, the timer that cuts it off)."""
        self._taken: list[_Item] = []
        """What the writer (``_writer``) took and has not said it wrote (``unsent`` puts it back)."""
        self.on_audio: Callable[[session_pb2.AudioDelta], None] | None = None
        """Told of each audio event as a stream takes it (the session's ``pacing``)."""
        self.numbered = 0
        """Events numbered so far, ``se_1`` .. ``se_<numbered>`` (a session taken over from
        another replica starts from the count its token and the client's ``last_event_id`` say)."""

    def __len__(self) -> int:
        return len(self._items)

    def _number(self, event: session_pb2.ServerEvent) -> None:
        self.numbered += 1
        event.event_id = f"se_{self.numbered}"

    def next_ids_at_most(self) -> int:
        """An upper bound of the number the next event queued will get: what was numbered, what
        waits, and it (what waits may be dropped on the way out: it is never below)."""
        return self.numbered + len(self._items) + 1

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, event: session_pb2.ServerEvent, *, epoch: int | None = None) -> None:
        """Queue an event; ``epoch`` marks output that must die with its epoch."""
        if self._closed or self.overflowed:
            return
        size = event.ByteSize()
        if len(self._items) >= self._limit or self._bytes + size > self._limit_bytes:
            self.overflowed = True
            return
        self._bytes += size
        self._items.append(_Item(event, epoch, size))
        self._signal()

    def merge_ack(self, seq: int, epoch: int) -> bool:
        """Fold an ``input_ack`` into the one at the tail of the queue, when that one is of the
        same epoch and not yet taken: acks are cumulative (the highest seq handed on), so a
        client that reads more slowly than it appends gets one ack for the appends it had not
        yet been told of, not a message each. False: nothing merged (queue a new ack)."""
        if not self._items:
            return False
        tail = self._items[-1]
        if tail.epoch is not None or not tail.event.HasField("input_ack"):
            return False
        ack = tail.event.input_ack
        if ack.epoch != epoch or ack.seq >= seq:
            return False
        ack.seq = seq
        COALESCED_ACKS.inc()
        return True

    def put_front(self, event: session_pb2.ServerEvent) -> None:
        """Queue an event ahead of everything else (``opened`` on a resumed stream)."""
        if not self._closed:
            size = event.ByteSize()
            self._bytes += size
            self._items.appendleft(_Item(event, None, size, front=True))
            self._signal()

    def purge_before(self, epoch: int) -> int:
        """Drop queued epoch-bound output older than ``epoch``; returns how many."""
        keep = deque(i for i in self._items if i.epoch is None or i.epoch >= epoch)
        dropped = len(self._items) - len(keep)
        if dropped:
            self._items = keep
            self._bytes = sum(i.size for i in keep)
            DROPPED[DropReason.PURGED].inc(dropped)
        return dropped

    @property
    def current_attachment(self) -> int:
        return self._attachment

    def attach(
        self,
        *,
        farewell: session_pb2.ServerEvent | None = None,
        cut_off: Callable[[], None] | None = None,
    ) -> int:
        """A new stream takes over consumption; the previous consumer gets ``farewell`` (when
        given) as its last event at its next get, then None. ``cut_off`` ends the new stream's
        call should it, once displaced in turn, not finish a write in time."""
        if farewell is not None and self._attachment:
            self._farewells[self._attachment] = farewell
        self._attachment += 1
        if cut_off is not None:
            self._cut_offs[self._attachment] = cut_off
        self._signal()
        return self._attachment

    def _signal(self) -> None:
        """Something may be there to take: wake ``get`` and call the listeners."""
        self._wake.set()
        self._tell_listeners()

    def _tell_listeners(self) -> None:
        for on_ready in self._listeners.values():
            on_ready()

    def listen(self, attachment: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready`` (at once, from whichever code queues) whenever the stream holding
        ``attachment`` may have something to ``take``: an event queued, the queue closed, the
        stream displaced (its farewell waits), or a displaced stream's last write done. Until
        ``detached``."""
        self._listeners[attachment] = on_ready

    def detached(self, attachment: int) -> None:
        """The stream holding ``attachment`` ended: it writes nothing more."""
        self._cut_offs.pop(attachment, None)
        self._farewells.pop(attachment, None)
        self._listeners.pop(attachment, None)
        self._wrote(attachment)

    def wrote(self, attachment: int) -> None:
        """The stream holding ``attachment`` has written everything it took (``take``)."""
        self._wrote(attachment)

    def _wrote(self, attachment: int) -> None:
        if self._writer == attachment:
            self._writer = 0
            self._taken = []
            self._written.set()
            if self._handover_timer is not None and self._handover_timer[0] == attachment:
                self._handover_timer[1].cancel()
                self._handover_timer = None
            if attachment != self._attachment:  # a displaced stream's last write: the new one may go
                self._tell_listeners()

    def _handed_over(self, attachment: int) -> bool:
        """Whether the stream holding ``attachment`` may take now: no displaced stream is still
        writing. If one is, the timer that cuts it off after ``HANDOVER_TIMEOUT_S`` is armed
        (once per displaced writer, whichever kind of stream waits for it)."""
        writer = self._writer
        if writer in (0, attachment):
            return True
        if self._handover_timer is None or self._handover_timer[0] != writer:
            timer = asyncio.get_running_loop().call_later(HANDOVER_TIMEOUT_S, self._handover_late, writer)
            self._handover_timer = (writer, timer)
        return False

    def _handover_late(self, writer: int) -> None:
        """A displaced stream did not finish its write in time: cut it off, and let the new
        one go."""
        self._handover_timer = None
        if self._writer == writer:
            cut_off = self._cut_offs.pop(writer, None)
            if cut_off is not None:
                cut_off()
            self._wrote(writer)

    def close(self, *, drop: bool = False) -> None:
        """No more events; consumers drain what is queued (or nothing, with ``drop``: the memory
        goes at once), then get None."""
        self._closed = True
        if drop:
            self._items.clear()
            self._bytes = 0
        self._signal()

    async def get(self, attachment: int) -> session_pb2.ServerEvent | None:
        """The next event for the stream holding ``attachment``; None when it should end.

        A stream calls it again only once it has written the event it got before: that is how
        the queue knows a displaced stream's last write is done."""
        self._wrote(attachment)
        while True:
            if attachment != self._attachment:
                return self._farewell(attachment)
            if not self._handed_over(attachment):
                self._written.clear()
                await self._written.wait()  # set by the displaced stream's write, or its cut-off
                continue
            item = self._next()
            if item is not None:
                self._writer = attachment
                self._taken = [item]
                return item.event
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()

    def take(self, attachment: int, limit: int) -> tuple[list[tuple[session_pb2.ServerEvent, int]], bool]:
        """Up to ``limit`` events for the stream holding ``attachment``, numbered, each with its
        size in bytes as it was queued plus its id (an ack folded into it since may be a byte or
        two more), without waiting, and whether that stream should end once it has written them
        (it was displaced: its farewell is its last event; or the queue is closed and empty).
        ``get``'s rules hold: nothing is taken while a displaced stream's last write is not
        done (the listener is called when it is, or when that stream is cut off after
        ``HANDOVER_TIMEOUT_S``), and the stream says when it has written what it took
        (``wrote``) before it takes again."""
        if attachment != self._attachment:
            farewell = self._farewell(attachment)
            return ([(farewell, farewell.ByteSize())] if farewell is not None else []), True
        if not self._handed_over(attachment):
            return [], False
        taken: list[_Item] = []
        while len(taken) < limit:
            item = self._next()
            if item is None:
                break
            taken.append(item)
        events = [(item.event, item.size) for item in taken]
        if taken:
            self._writer = attachment
            self._taken = taken
        return events, self._closed and not self._items

    def unsent(self, attachment: int, count: int | None = None) -> None:
        """The stream holding ``attachment`` could not write the last ``count`` (None: all) of
        the events it took last: its call ended first (dropped, cancelled). They go back to the
        head of the queue (behind an ``opened`` put there for a resumed stream), to be numbered
        again when taken, so the stream that resumes the session gets them. Only while that
        stream is still their writer and nothing was numbered after them: a stream cut off for
        not writing in time (``HANDOVER_TIMEOUT_S``) may already have let another one take."""
        if self._writer != attachment or self._closed or self.overflowed:
            return
        keep = 0 if count is None else max(len(self._taken) - count, 0)
        back = self._taken[keep:]
        if not back or back[-1].event.event_id != f"se_{self.numbered}":
            return
        del self._taken[keep:]
        at = 0
        while at < len(self._items) and self._items[at].front:
            at += 1
        for item in reversed(back):
            item.size -= len(item.event.event_id) + 2
            item.event.ClearField("event_id")
            self.numbered -= 1
            if item.front and at:
                continue  # an ``opened`` the resumed stream's own ``opened`` supersedes
            self._items.insert(at, item)
            self._bytes += item.size
        self._signal()

    def _farewell(self, attachment: int) -> session_pb2.ServerEvent | None:
        """The last event of the displaced stream holding ``attachment``, numbered now (a stream
        that ended before it took its farewell costs the session no number)."""
        farewell = self._farewells.pop(attachment, None)
        if farewell is not None:
            self._number(farewell)
        return farewell

    def get_nowait(self) -> session_pb2.ServerEvent | None:
        """The next deliverable event, or None when none is queued now."""
        item = self._next()
        return item.event if item is not None else None

    def _next(self) -> _Item | None:
        """The next deliverable item, numbered, with its size as it goes out."""
        while self._items:
            item = self._items.popleft()
            self._bytes -= item.size
            if item.epoch is not None and item.epoch < self._current_epoch():  # its epoch was left
                DROPPED[DropReason.STALE_EPOCH].inc()
                continue
            self._number(item.event)
            item.size += len(item.event.event_id) + 2  # the id's field: a tag and a length byte
            kind = item.event.WhichOneof("event") or "none"
            EVENTS_OUT[kind].inc()
            if kind == "audio_delta" and self.on_audio is not None:
                self.on_audio(item.event.audio_delta)
            return item
        return None
