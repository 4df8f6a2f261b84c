"""The one place a session's server events are built and queued for its client.

Every event goes through ``Emitter`` onto the session's single outbound queue
(``session_service.session.outbound``), so nothing can overtake ``audio_cancelled``; the queue
numbers them (``se_N``) as a stream takes them, in the order the client receives them.
Response output (audio and transcript deltas) is queued bound to its epoch, so the queue drops
it once the epoch moves on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from duplex.clock import Clock
from duplex.errors import DuplexError
from duplex.v1 import session_pb2
from session_service.metrics import CARRIED_ACKS, ERRORS_BY_CODE, LATENCY_ACK
from session_service.session.ack_window import Ack
from session_service.session.outbound import Outbound

#: The most characters of a client's ``event_id`` an ``error`` echoes (its first ones): what a
#: client sends must not make the server send back as much (the rest of an error is bounded too).
MAX_ECHOED_EVENT_ID = 256


def echoed_event_id(event_id: str) -> str:
    """A client event's ``event_id`` as an ``error`` answering it carries it: at most its first
    ``MAX_ECHOED_EVENT_ID`` characters."""
    return event_id[:MAX_ECHOED_EVENT_ID]


class Emitter:
    """Builds server events and queues them on ``outbound`` (which numbers them: ``se_1``,
    ``se_2``, ... as they go out).

    A client that stopped reading overflows its queue (``Outbound.overflowed``, a state: nothing
    raises); the runner checks it once per item and closes the session then."""

    def __init__(self, outbound: Outbound, clock: Clock, *, coalesce_acks: bool = True) -> None:
        self.outbound = outbound
        self._clock = clock
        self._coalesce_acks = coalesce_acks
        self.acks_on_output = False
        """The stream reads ``carried_ack``: acks given with ``ride`` wait for the next event."""
        self._riding: tuple[int, int] | None = None
        """(seq, epoch) of the ack waiting to ride on the next event (``acks_on_output``)."""
        self._last_carried: tuple[int, int] | None = None
        """The latest ack, when it went out carried on another event (None: it went alone)."""

    def event(self, which: str, msg: Any) -> session_pb2.ServerEvent:
        """An event with ``which`` set to ``msg``, not queued (numbered as it goes out)."""
        return session_pb2.ServerEvent(**{which: msg})

    def emit(self, which: str, msg: Any) -> None:
        """Queue an event that is always delivered (lifecycle, acks, errors); a riding ack goes
        with it."""
        ev = self.event(which, msg)
        if self._riding is not None:
            self._carry(ev)
        self.outbound.put(ev)

    def emit_output(self, event: session_pb2.ServerEvent, epoch: int) -> None:
        """Queue response output built by the data plane; it dies with ``epoch`` (and so does
        a riding ack of that epoch it carries: an ack of a left epoch means nothing)."""
        if self._riding is not None and self._riding[1] == epoch:
            self._carry(event)
        self.outbound.put(event, epoch=epoch)

    def _carry(self, event: session_pb2.ServerEvent) -> None:
        assert self._riding is not None
        event.carried_ack.seq, event.carried_ack.epoch = self._riding
        self._last_carried = self._riding
        self._riding = None
        CARRIED_ACKS.inc()

    def stop_carrying(self) -> None:
        """The stream now attached does not read ``carried_ack``: the latest ack, if it went out
        carried (on an event this stream may be about to get), is sent again as an
        ``input_ack`` (acks are cumulative: a repeat is harmless, a missing one is not)."""
        self.flush_acks()
        self.acks_on_output = False
        if self._last_carried is not None:
            seq, epoch = self._last_carried
            self._put_ack(seq, epoch)

    def flush_acks(self) -> None:
        """Send a riding ack that found no event to ride on as an ``input_ack`` of its own
        (called at the end of every worker step's news, so none waits longer than that)."""
        if self._riding is not None:
            seq, epoch = self._riding
            self._riding = None
            self._put_ack(seq, epoch)

    def _put_ack(self, seq: int, epoch: int) -> None:
        self._last_carried = None
        if not (self._coalesce_acks and self.outbound.merge_ack(seq, epoch)):
            # Built in place: no intermediate message to copy (this runs once per client chunk).
            ev = session_pb2.ServerEvent()
            ev.input_ack.seq = seq
            ev.input_ack.epoch = epoch
            self.outbound.put(ev)

    def error(self, err: DuplexError, event_id: str = "") -> None:
        """An ``error`` event (counted by code); ``event_id`` names the client event it answers
        (bounded: ``echoed_event_id``)."""
        ERRORS_BY_CODE[err.code].inc()
        self.emit(
            "error",
            session_pb2.Error(
                code=err.code,
                message=err.message,
                event_id=echoed_event_id(event_id),
                retryable=err.retryable,
            ),
        )

    def acks(self, acks: Iterable[Ack], *, ride: bool = False) -> None:
        """Acks, with the append-to-ack latency of every append they cover. Each is an
        ``input_ack`` event (folded into one still queued for a client that is behind), or, with
        ``ride`` on a stream that reads ``carried_ack``, carried on the next event queued (the
        output of the worker step that consumed the input), else sent alone at ``flush_acks``."""
        for ack in acks:
            if ride and self.acks_on_output:
                if self._riding is not None and self._riding[1] != ack.epoch:
                    self.flush_acks()
                self._riding = (ack.seq, ack.epoch)  # acks are cumulative: the latest covers all
            else:
                self.flush_acks()  # acks never overtake each other
                self._put_ack(ack.seq, ack.epoch)
            now = self._clock.now()
            for received in ack.received:
                LATENCY_ACK.observe(now - received)
