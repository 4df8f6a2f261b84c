"""The fence: ``(session_id, epoch, turn_id)``, the one type both tiers use for it.

Every submission to a worker carries a fence and every output carries one back. The epoch is
the fencing token proper (cancel, barge-in and takeover advance it); the turn says which
response output belongs to. Where each tier checks a fence, and what it counts when the check
fails, is listed in ``docs/worker-protocol.md`` ("Where fences are checked").
"""

from __future__ import annotations

from dataclasses import dataclass

from duplex.v1 import common_pb2

__all__ = ["MAX_EPOCH", "MAX_REQUESTED_EPOCH", "Fence"]

#: The highest epoch a fence can carry (``uint64`` on the wire): nothing may grant a higher one.
MAX_EPOCH = 2**64 - 1

#: The highest epoch a caller may ask a worker for (an Attach, a submission). What lies above,
#: up to ``MAX_EPOCH``, only takeovers grant, one at a time: no caller can set a fence that a
#: legitimate owner's takeover cannot pass (a session at 2**64-1 could never be taken over).
#: Epochs advance by one per cancel or move; nothing legitimate comes near it.
MAX_REQUESTED_EPOCH = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Fence:
    """``(session_id, epoch, turn_id)``: carried by every submission, checked on every output."""

    session_id: str
    """The session the work belongs to (the worker keys model state by it)."""
    epoch: int
    """The session's fencing token; output of an older epoch is never delivered."""
    turn_id: int
    """The turn: output of an older turn than the active response's is never delivered."""

    @classmethod
    def from_proto(cls, msg: common_pb2.Fence) -> Fence:
        return cls(msg.session_id, msg.epoch, msg.turn_id)

    def to_proto(self) -> common_pb2.Fence:
        return common_pb2.Fence(session_id=self.session_id, epoch=self.epoch, turn_id=self.turn_id)

    def write_to(self, msg: common_pb2.Fence) -> None:
        """Fill ``msg`` (a submessage field) in place: no message is built and copied, which
        matters on the per-frame path."""
        msg.session_id = self.session_id
        msg.epoch = self.epoch
        msg.turn_id = self.turn_id

    def with_turn(self, turn_id: int) -> Fence:
        return Fence(self.session_id, self.epoch, turn_id)
