"""The one place a session's server events are numbered and queued for its client.

Every event goes through ``Emitter`` onto the session's single outbound queue
(``session_service.outbound``), so event ids are numbered in one place and nothing can
overtake ``audio_cancelled``. Response output (audio and transcript deltas) is queued bound to
its epoch, so the queue drops it once the epoch moves on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from duplex.clock import Clock
from duplex.errors import DuplexError
from duplex.v1 import session_pb2
from session_service.ack_window import Ack
from session_service.metrics import ERRORS_BY_CODE, LATENCY_ACK
from session_service.outbound import Outbound


class Emitter:
    """Numbers server events (``se_1``, ``se_2``, ...) and queues them on ``outbound``.

    Queuing raises ``OutboundOverflow`` when the client stopped reading; the runner closes
    the session then."""

    def __init__(self, outbound: Outbound, clock: Clock, *, coalesce_acks: bool = True) -> None:
        self.outbound = outbound
        self._clock = clock
        self._coalesce_acks = coalesce_acks
        self.count = 0
        """Events numbered so far (a session taken over continues from its token's count)."""

    def event(self, which: str, msg: Any) -> session_pb2.ServerEvent:
        """A numbered event with ``which`` set to ``msg``, not queued."""
        self.count += 1
        return session_pb2.ServerEvent(event_id=f"se_{self.count}", **{which: msg})

    def emit(self, which: str, msg: Any) -> None:
        """Queue an event that is always delivered (lifecycle, acks, errors)."""
        self.outbound.put(self.event(which, msg))

    def emit_output(self, event: session_pb2.ServerEvent, epoch: int) -> None:
        """Queue response output built by the data plane; it dies with ``epoch``."""
        self.count += 1
        event.event_id = f"se_{self.count}"
        self.outbound.put(event, epoch=epoch)

    def error(self, err: DuplexError, event_id: str = "") -> None:
        """An ``error`` event (counted by code); ``event_id`` names the client event it answers."""
        ERRORS_BY_CODE[err.code].inc()
        self.emit(
            "error",
            session_pb2.Error(code=err.code, message=err.message, event_id=event_id, retryable=err.retryable),
        )

    def acks(self, acks: Iterable[Ack]) -> None:
        """``input_ack`` events, with the append-to-ack latency of every append they cover."""
        for ack in acks:
            # Folded into an ack still queued when the client is behind; else built in place,
            # with no intermediate message to copy (this runs once per client chunk).
            if not (self._coalesce_acks and self.outbound.merge_ack(ack.seq, ack.epoch)):
                self.count += 1
                ev = session_pb2.ServerEvent(event_id=f"se_{self.count}")
                ev.input_ack.seq = ack.seq
                ev.input_ack.epoch = ack.epoch
                self.outbound.put(ev)
            now = self._clock.now()
            for received in ack.received:
                LATENCY_ACK.observe(now - received)
