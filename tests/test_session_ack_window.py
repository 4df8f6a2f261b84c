"""The input-ack window (``session_service.session.ack_window``): pure, so checked as a property.

Whatever order appends, worker consumption reports and resets come in, the window must
(1) never acknowledge an append while more than its bound of audio is unconsumed, except when
the worker's input position starts over; (2) eventually acknowledge every append, each exactly
once, in order; (3) never hold anything when the bound is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from session_service.session.ack_window import Ack, AckWindow

FRAME_MS = 32.0

# An operation: ("append", frames) | ("consume", how many of the outstanding APPENDs) | ("reset",)
op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 4)),
    st.tuples(st.just("consume"), st.integers(0, 6)),
    st.tuples(st.just("reset")),
)


@dataclass
class Driver:
    """Plays a client, a runner and a worker around one window, checking every answer."""

    window: AckWindow
    epoch: int = 1
    client_seq: int = 0
    worker_seq: int = 0
    consumed_seq: int = 0
    appended: list[tuple[int, int]] = field(default_factory=list)
    acked: list[Ack] = field(default_factory=list)

    def take(self, acks: tuple[Ack, ...], *, may_exceed: bool = False) -> None:
        for ack in acks:
            assert ack.received, ack
            if self.window.bound and not may_exceed:
                # (1): an ack goes out only while the worker is within the bound.
                assert self.window.unconsumed <= self.window.bound
            self.acked.append(ack)

    def append(self, frames: int) -> None:
        self.client_seq += 1
        self.appended.append((self.client_seq, self.epoch))
        if frames:
            self.worker_seq += 1
            self.window.handed_on(self.worker_seq, frames)
        self.take(self.window.ack(self.client_seq, self.epoch, float(self.client_seq)))

    def consume(self, n: int) -> None:
        self.consumed_seq = min(self.worker_seq, self.consumed_seq + n)
        self.take(self.window.consumed(self.consumed_seq))

    def reset(self) -> None:
        self.take(self.window.reset(), may_exceed=True)
        self.epoch += 1  # a reset is what a cancel does; seqs of the runner's worker restart
        self.worker_seq = self.consumed_seq = 0


def _play(hold_ms: int, ops: list[tuple[object, ...]]) -> Driver:
    d = Driver(AckWindow(hold_ms=hold_ms, frame_ms=FRAME_MS))
    for o in ops:
        if o[0] == "append":
            d.append(int(o[1]))  # type: ignore[call-overload]
        elif o[0] == "consume":
            d.consume(int(o[1]))  # type: ignore[call-overload]
        else:
            d.reset()
    d.reset()  # whatever is still held goes out
    return d


def _check_complete_and_ordered(d: Driver) -> None:
    # (2): every append acknowledged exactly once (an ack covers all appends since the previous
    # one of its epoch), acks in order, each naming the highest seq it covers.
    covered: list[tuple[int, int]] = []
    pending = list(d.appended)
    for ack in d.acked:
        n = len(ack.received)
        batch, pending = pending[:n], pending[n:]
        assert len(batch) == n, (ack, pending)
        assert {e for _, e in batch} == {ack.epoch}, (ack, batch)
        assert batch[-1][0] == ack.seq, (ack, batch)
        assert list(ack.received) == [float(s) for s, _ in batch]
        covered.extend(batch)
    assert pending == [] and covered == d.appended


@settings(max_examples=300, deadline=None)
@given(hold_ms=st.sampled_from([32, 96, 200]), ops=st.lists(op, max_size=60))
def test_acks_respect_the_bound_and_every_append_is_acked_once_in_order(
    hold_ms: int, ops: list[tuple[object, ...]]
) -> None:
    _check_complete_and_ordered(_play(hold_ms, ops))


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(op, max_size=60))
def test_with_the_bound_off_nothing_is_ever_held(ops: list[tuple[object, ...]]) -> None:
    d = Driver(AckWindow(hold_ms=0, frame_ms=FRAME_MS))
    for o in ops:
        if o[0] == "append":
            before = len(d.acked)
            d.append(int(o[1]))  # type: ignore[call-overload]
            assert len(d.acked) == before + 1 and d.window.held == 0
        elif o[0] == "consume":
            d.consume(int(o[1]))  # type: ignore[call-overload]
    _check_complete_and_ordered(_play(0, ops))


def test_held_acks_go_out_as_one_per_epoch_carrying_the_highest_seq() -> None:
    w = AckWindow(hold_ms=96, frame_ms=FRAME_MS)  # 3 frames
    assert w.bound == 3
    out: list[Ack] = []
    for seq in range(1, 7):
        w.handed_on(seq, 1)
        out += w.ack(seq, 1, float(seq))
    assert [a.seq for a in out] == [1, 2, 3] and w.held == 3 and w.unconsumed == 6
    assert w.consumed(2) == ()  # 4 still unconsumed
    (released,) = w.consumed(3)
    assert (released.seq, released.epoch, released.received) == (6, 1, (4.0, 5.0, 6.0))
    assert w.held == 0 and w.unconsumed == 3


@dataclass
class StrictDriver(Driver):
    """``until_consumed``: also checks that no ack names an append the worker has not consumed."""

    wseq_of: dict[tuple[int, int], int] = field(default_factory=dict)
    """(client seq, epoch) -> the worker seq that carried it (or the last one before it)."""

    def append(self, frames: int) -> None:
        super().append(frames)
        self.wseq_of[(self.client_seq, self.epoch)] = self.worker_seq

    def take(self, acks: tuple[Ack, ...], *, may_exceed: bool = False) -> None:
        for ack in acks:
            if not may_exceed:
                # The append an ack names (and so every one it covers) was consumed.
                assert self.wseq_of.get((ack.seq, ack.epoch), 0) <= self.consumed_seq, (
                    ack,
                    self.consumed_seq,
                )
        super().take(acks, may_exceed=True)


@settings(max_examples=300, deadline=None)
@given(hold_ms=st.sampled_from([0, 96]), ops=st.lists(op, max_size=60))
def test_until_consumed_acks_only_consumed_input_and_still_every_append_once_in_order(
    hold_ms: int, ops: list[tuple[object, ...]]
) -> None:
    d = StrictDriver(AckWindow(hold_ms=hold_ms, frame_ms=FRAME_MS))
    d.window.hold_until_consumed(True)
    for o in ops:
        if o[0] == "append":
            d.append(int(o[1]))  # type: ignore[call-overload]
        elif o[0] == "consume":
            d.consume(int(o[1]))  # type: ignore[call-overload]
        else:
            d.reset()
    d.reset()
    _check_complete_and_ordered(d)


def test_until_consumed_releases_each_ack_as_its_append_is_consumed_and_switching_off_frees_them() -> None:
    w = AckWindow(hold_ms=0, frame_ms=FRAME_MS)
    assert w.hold_until_consumed(True) == ()
    for seq in range(1, 4):
        w.handed_on(seq, 1)
        assert w.ack(seq, 1, float(seq)) == ()
    (first,) = w.consumed(2)  # 1 and 2 consumed: one ack covers both; 3 waits
    assert (first.seq, first.received) == (2, (1.0, 2.0)) and w.held == 1
    (rest,) = w.hold_until_consumed(False)  # a stream that reads acks as events: out at once
    assert (rest.seq, rest.received) == (3, (3.0,)) and w.held == 0
