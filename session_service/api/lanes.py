"""``ConverseMany``: many sessions ("lanes") of one caller on one stream.

A backend that holds many conversations pays gRPC's per-message cost once per message, not once
per event: each ``ClientBatch`` carries events of several lanes, and each ``ServerBatch`` carries
whatever all of the stream's lanes have to say at that moment. A lane is what one ``Converse``
call is, and reuses all of it: the same runner, the same single outbound queue (so nothing
overtakes ``audio_cancelled``), the same attach, detach and resume.

- The stream's **reader** routes each event to its lane, in order. A lane's first event must be
  ``open`` or ``resume``; it is started in a task of its own (an open waits on a worker: the
  other lanes go on meanwhile), and its later events wait, bounded, until it is open.
- The handler **writes**. Each lane's session queue tells the stream when it may have something
  (``Outbound.listen``); the writer then takes what every such lane holds (up to ``MAX_DRAIN``
  events each) into one ``ServerBatch``, writes it, and tells each queue it is written
  (``Outbound.wrote``): so, as on ``Converse``, the queue knows when a lane's last event is out
  (a resume elsewhere waits for it). There is no task per lane: a lane costs the stream a task
  switch only while it opens.

One stream shares one flow control: a lane whose session's mailbox is full holds up the stream's
reading (as it would hold up its own ``Converse`` stream), and a client that stops reading is cut
off as a slow consumer, every lane with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from duplex.errors import BadRequestError, CapacityError, DuplexError, ErrorCode, InternalError
from duplex.v1 import session_pb2
from session_service.api.calls import (
    MAX_REFUSED_BEFORE_OPEN,
    CallCut,
    close_if_current,
    half_closed,
    let_go,
    not_open_error,
    open_or_resume,
    read_messages,
    refusal,
    slow_consumer,
    unparsable,
)
from session_service.metrics import ERRORS_BY_CODE, EVENTS_IN, LANES
from session_service.session.manager import SessionManager
from session_service.session.runner import SessionRunner

log = logging.getLogger(__name__)

#: Lanes one stream may hold (open, or opening) at once. Each lane's session also counts against
#: the caller's and the replica's session limits.
MAX_LANES = 1024

#: Longest lane name, in characters (printable ASCII).
MAX_LANE_NAME = 64

#: Events of one lane taken into one message (the rest go in the next).
MAX_DRAIN = 64

#: Events a lane holds while its open is under way; beyond it the stream's reading waits.
MAX_PENDING = 64

#: Size a server message is cut at (what the lanes have to say beyond it goes in the next).
MAX_MESSAGE_BYTES = 1024 * 1024

#: Answers of the stream's own (refusals, errors about names or messages, lane ends) that may
#: wait unwritten; beyond it the client is not reading them and is cut off as a slow consumer.
#: (A lane's own events wait in its session's queue, bounded there.)
MAX_UNWRITTEN_ANSWER_BYTES = 1024 * 1024

_Context = grpc.aio.ServicerContext[session_pb2.ClientBatch, session_pb2.ServerBatch]


def lane_name_ok(name: str) -> bool:
    """Whether ``name`` may name a lane: 1..``MAX_LANE_NAME`` printable ASCII characters."""
    return 0 < len(name) <= MAX_LANE_NAME and name.isascii() and name.isprintable()


def ended(err: DuplexError | None) -> session_pb2.LaneEnded:
    """How a lane ended: what the ``Converse`` call would have ended with (OK for None)."""
    if err is None:
        return session_pb2.LaneEnded()
    return session_pb2.LaneEnded(
        status=err.status.value[0], code=err.code, message=err.message, retryable=err.retryable
    )


#: What a stream writes: (lane, event or lane end, its size in bytes).
_Output = tuple[str, session_pb2.ServerEvent | session_pb2.LaneEnded, int]


def _batches(items: list[_Output]) -> Iterator[tuple[session_pb2.ServerBatch, int]]:
    """``items`` as messages of about ``MAX_MESSAGE_BYTES`` at most (one item larger than that
    goes alone), so a client's receive limit (4 MiB by gRPC's default) is never reached; each
    with how many of ``items`` are in it and the messages before it."""
    batch, size = session_pb2.ServerBatch(), 0
    for i, (lane, item, item_size) in enumerate(items):
        n = item_size + len(lane) + 16
        if size and size + n > MAX_MESSAGE_BYTES:
            yield batch, i
            batch, size = session_pb2.ServerBatch(), 0
        out = batch.outputs.add(lane=lane)
        if isinstance(item, session_pb2.LaneEnded):
            out.ended.CopyFrom(item)
        else:
            out.event.CopyFrom(item)
        size += n
    if size:
        yield batch, len(items)


@dataclass(eq=False, slots=True)
class _Lane:
    name: str
    runner: SessionRunner | None = None
    attachment: int = 0
    pending: list[session_pb2.ClientEvent] = field(default_factory=list)
    """Events that came while the open was under way (or are being handed on after it)."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once ``pending`` is handed on (or the open failed): the reader may post directly."""
    opening: asyncio.Task[None] | None = None
    """The task that opens it (``_open``)."""


class LaneStream:
    """One ``ConverseMany`` call."""

    def __init__(
        self, manager: SessionManager, context: _Context, *, principal: str, open_timeout_s: float
    ) -> None:
        self._manager = manager
        self._context = context
        self._principal = principal
        self._open_timeout_s = open_timeout_s
        self._lanes: dict[str, _Lane] = {}
        self._out: list[_Output] = []
        """The stream's own answers, written before the lanes' events of the same message."""
        self._ready: dict[_Lane, None] = {}
        """Lanes whose session queue may have something to take (in the order they said so)."""
        self._wake = asyncio.Event()
        self._refused = 0
        self._opened_any = False
        self._half_closed = False
        self._dropped = False
        self._cut = CallCut(context)
        self._answer_bytes = 0
        """Bytes of the stream's own answers in ``_out`` (``MAX_UNWRITTEN_ANSWER_BYTES``)."""

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self._write_loop()
            await self._cut.wait()  # when cut: the call ends with the cut's status, not OK
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await self._let_go()

    # ---- writing -----------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while not (self._dropped or self._cut.done):
            if not (self._out or self._ready):
                if self._half_closed and not self._lanes:
                    return  # every lane ended after the client half-closed: the call is done
                self._wake.clear()
                await self._wake.wait()
                continue
            items, self._out = self._out, []
            self._answer_bytes = 0
            answers = len(items)
            took, over = self._take(items)
            written = 0
            try:
                for batch, written_after in _batches(items):
                    if not await self._cut.write(batch):
                        return  # the call is over (``_let_go`` lets every lane go)
                    written = written_after
            finally:
                # What the call ended before writing goes back to its sessions' queues, for
                # the streams that resume them.
                self._unsent(took, items[max(written, answers) :])
            for lane in took:
                assert lane.runner is not None
                lane.runner.outbound.wrote(lane.attachment)
            for lane in over:
                self._lane_over(lane)

    def _take(self, items: list[_Output]) -> tuple[list[_Lane], list[_Lane]]:
        """What the ready lanes' sessions have to say, into ``items``; the lanes that took
        something, and those that end once it is written."""
        ready, self._ready = self._ready, {}
        took: list[_Lane] = []
        over: list[_Lane] = []
        for lane in ready:
            if lane.runner is None or self._lanes.get(lane.name) is not lane:
                continue  # ended (its name may already be another lane's)
            events, ends = lane.runner.outbound.take(lane.attachment, MAX_DRAIN)
            if events:
                items.extend((lane.name, ev, size) for ev, size in events)
                took.append(lane)
            if ends:
                over.append(lane)
            elif len(events) == MAX_DRAIN:
                self._ready[lane] = None  # more may wait: the next message
        return took, over

    def _unsent(self, took: list[_Lane], unwritten: list[_Output]) -> None:
        """``unwritten``, events the lanes in ``took`` took last, go back to their queues."""
        counts: dict[str, int] = {}
        for name, _, _ in unwritten:
            counts[name] = counts.get(name, 0) + 1
        for lane in took:
            if lane.name in counts and lane.runner is not None:
                lane.runner.outbound.unsent(lane.attachment, counts[lane.name])

    def _lane_over(self, lane: _Lane) -> None:
        """The lane's session ended (or another stream resumed it, and its farewell is out)."""
        assert lane.runner is not None
        lane.runner.outbound.detached(lane.attachment)
        self._end_lane(lane, None)

    def _mark(self, lane: _Lane) -> None:
        self._ready[lane] = None
        self._wake.set()

    def _answer(self, lane: str, item: session_pb2.ServerEvent | session_pb2.LaneEnded) -> None:
        """Queue an answer of the stream's own; cut the client off if they pile up unread."""
        size = item.ByteSize()
        self._answer_bytes += size
        if self._answer_bytes > MAX_UNWRITTEN_ANSWER_BYTES:
            self._slow_consumer()
            return
        self._out.append((lane, item, size))
        self._wake.set()

    def _stream_error(self, message: str, event_id: str = "") -> None:
        """An ``invalid_event`` about the stream itself (lane ""): a message or a lane name not
        usable."""
        self._refused += 1
        self._answer("", refusal(ErrorCode.INVALID_EVENT, message, event_id, self._refused))

    def _end_call(self, err: DuplexError) -> None:
        """End the whole call with ``err``'s status, from any task (``CallCut``)."""
        self._cut(err)
        self._wake.set()

    def _slow_consumer(self) -> None:
        self._end_call(slow_consumer("the stream"))

    # ---- reading -----------------------------------------------------------------------------

    async def _read(self) -> None:
        it = aiter(read_messages(self._context, session_pb2.ClientBatch))
        deadline = asyncio.get_running_loop().time() + self._open_timeout_s
        try:
            while True:
                try:
                    if self._opened_any:
                        batch = await anext(it)
                    else:
                        async with asyncio.timeout_at(deadline):
                            batch = await anext(it)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    self._end_call(BadRequestError(ErrorCode.SESSION_NOT_OPEN, "no open or resume in time"))
                    return
                if batch is None:
                    self._stream_error(unparsable("ClientBatch"))
                else:
                    for item in batch.events:
                        await self._route(item)
                if not self._opened_any and self._refused > MAX_REFUSED_BEFORE_OPEN:
                    self._end_call(
                        BadRequestError(
                            ErrorCode.SESSION_NOT_OPEN,
                            f"no open or resume in the first {MAX_REFUSED_BEFORE_OPEN} events",
                        )
                    )
                    return
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError, grpc.aio.AbortError):
            self._lost()
            return
        except Exception:
            log.exception("reading a ConverseMany stream failed")
            self._lost()
            return
        if not await half_closed(self._context):
            self._lost()
            return
        self._half_closed = True
        for lane in list(self._lanes.values()):
            if lane.ready.is_set() and lane.runner is not None:
                await close_if_current(lane.runner, lane.attachment)  # one opening closes once open
        self._wake.set()

    def _lost(self) -> None:
        self._dropped = True
        self._wake.set()

    async def _route(self, item: session_pb2.LaneEvent) -> None:
        name, ev = item.lane, item.event
        lane = self._lanes.get(name)
        if lane is None:
            if not lane_name_ok(name):  # (a lane's name was looked at when it opened)
                self._stream_error(
                    f"a lane is named by 1 to {MAX_LANE_NAME} printable ASCII characters", ev.event_id
                )
                return
            # Counted here: no runner sees it (a runner counts the events it is given).
            kind = ev.WhichOneof("event")
            EVENTS_IN[kind or "none"].inc()
            if kind not in ("open", "resume"):
                self._refused += 1
                self._answer(name, not_open_error(ev.event_id, self._refused))
                return
            if len(self._lanes) >= MAX_LANES:
                err = CapacityError(ErrorCode.CAPACITY_EXHAUSTED, f"a stream holds at most {MAX_LANES} lanes")
                ERRORS_BY_CODE[err.code].inc()
                self._answer(name, ended(err))
                return
            self._opened_any = True
            lane = self._lanes[name] = _Lane(name)
            LANES.inc()
            lane.opening = asyncio.create_task(self._open(lane, ev))
            return
        while not lane.ready.is_set():
            if len(lane.pending) < MAX_PENDING:
                lane.pending.append(ev)
                return
            await lane.ready.wait()  # the open is slow and the client keeps sending: wait
        if lane.runner is not None and self._lanes.get(name) is lane:
            await lane.runner.post(ev)
        else:
            await self._route(item)  # the lane ended meanwhile (its open failed): the name is free

    async def _open(self, lane: _Lane, ev: session_pb2.ClientEvent) -> None:
        try:
            runner, acks_on_output = await open_or_resume(self._manager, ev, principal=self._principal)
        except DuplexError as err:
            self._end_lane(lane, err)
            return
        except Exception:
            log.exception("opening lane %r failed", lane.name)
            self._end_lane(lane, InternalError(ErrorCode.INTERNAL, "the session could not be opened"))
            return
        assert runner is not None  # a lane starts only with open or resume
        lane.runner = runner
        lane.attachment = runner.attach_stream(
            on_slow_consumer=self._slow_consumer, cut_off=self._slow_consumer, acks_on_output=acks_on_output
        )
        runner.outbound.listen(lane.attachment, lambda: self._mark(lane))
        self._mark(lane)  # ``opened`` is queued already
        while lane.pending:  # in order, before anything the reader gets from now on
            await runner.post(lane.pending.pop(0))
        lane.ready.set()
        if self._half_closed:
            await close_if_current(runner, lane.attachment)

    def _end_lane(self, lane: _Lane, err: DuplexError | None) -> None:
        if err is not None:
            ERRORS_BY_CODE[err.code].inc()
        lane.pending.clear()
        lane.ready.set()
        if self._lanes.get(lane.name) is lane:
            del self._lanes[lane.name]
            LANES.dec()
        self._answer(lane.name, ended(err))

    # ---- the end -----------------------------------------------------------------------------

    async def _let_go(self) -> None:
        """The call is over: opens under way stop, and a session whose stream this was waits
        the detached grace for a resume (as after a dropped ``Converse``)."""
        lanes = list(self._lanes.values())
        self._lanes.clear()
        LANES.dec(len(lanes))
        tasks = [lane.opening for lane in lanes if lane.opening is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for lane in lanes:
            if lane.runner is not None:
                let_go(lane.runner, lane.attachment)
