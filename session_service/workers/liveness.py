"""Application-level liveness of a worker link: what the worker owes, and since when.

A worker that hangs instead of dying (SIGSTOP, a wedged GPU, a deadlocked engine) keeps its TCP
connection up, so HTTP/2 keepalive would notice it only after tens of seconds. Each link
therefore keeps a ``Liveness`` record of what the worker owes it (per request: APPENDs written
but not yet reported consumed through ``RequestUpdate.input_seq``, a COMMIT awaiting its answer,
a RESPOND of a free-running model awaiting its first step) and when it last sent a
``StepOutput``. The link's watchdog (``session_service.workers.link``) polls ``quiet_for``; a link
that owes nothing is never stalled, however long it is quiet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from duplex.clock import MONOTONIC
from duplex.v1 import worker_pb2

_APPEND = worker_pb2.SUBMISSION_KIND_APPEND
_COMMIT = worker_pb2.SUBMISSION_KIND_COMMIT
_RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND


class WorkerStalledError(ConnectionError):
    """The worker owed output and sent none for the stall timeout (hung, not gone)."""


@dataclass(slots=True)
class _Owed:
    """What one request's worker owes: news of work written under ``epoch``."""

    epoch: int
    seq: int
    """Highest APPEND seq written in ``epoch`` and not yet reported consumed (0: none)."""
    answer: bool
    """A COMMIT (or a free-running RESPOND) awaits the request's next news."""
    since: float
    """When the request began to owe (monotonic)."""


class Liveness:
    """What a link's worker owes it, and when the worker last said anything.

    Bookkeeping is a dict operation per submission written and per update read (no timers);
    ``quiet_for`` is what the watchdog polls. Work that the worker legitimately never answers is
    not owed: a RESPOND of a lockstep model (it replies only as input arrives, and that input is
    owed itself), CLEAR, work dropped by a newer epoch, an abort or a release. A rejection (an
    update with an error) settles what the request owed.
    """

    def __init__(self, *, respond_answers: bool, clock: Callable[[], float] = MONOTONIC.now) -> None:
        self._respond_answers = respond_answers
        self._clock = clock
        self._owed: dict[str, _Owed] = {}
        self.last_output = clock()

    def reset(self) -> None:
        """A fresh stream: nothing is owed, and the worker counts as just heard from."""
        self._owed.clear()
        self.last_output = self._clock()

    @property
    def owing(self) -> int:
        """Requests the worker owes news of."""
        return len(self._owed)

    def written(
        self,
        submit: Iterable[worker_pb2.Submission],
        abort: Iterable[worker_pb2.Abort] = (),
        release: Iterable[worker_pb2.Release] = (),
    ) -> None:
        """One command is being written (called before the write: a write that blocks on a
        worker that reads nothing any more must not hide what it owes)."""
        owed = self._owed
        now = 0.0
        for sub in submit:
            rid, epoch, kind = sub.request_id, sub.fence.epoch, sub.kind
            o = owed.get(rid)
            if o is not None and o.epoch != epoch:
                if o.epoch > epoch:
                    continue  # stale: the worker rejects it (an error update), nothing to run
                del owed[rid]  # a newer epoch drops the request's older work at the worker
                o = None
            if kind == _APPEND or kind == _COMMIT or (kind == _RESPOND and self._respond_answers):
                if o is None:
                    now = now or self._clock()
                    o = owed[rid] = _Owed(epoch, 0, False, now)
                if kind == _APPEND:
                    o.seq = max(o.seq, sub.seq)
                else:
                    o.answer = True
        for ab in abort:
            o = owed.get(ab.request_id)
            if o is not None and o.epoch < ab.fence.epoch:
                del owed[ab.request_id]
        for rel in release:
            owed.pop(rel.request_id, None)

    def heard(self, step: worker_pb2.StepOutput) -> None:
        """A StepOutput arrived: settle what it answers. Only engine output proves the worker
        alive: rejections (``step=0``, every update an error) come from its asyncio side, which
        answers even while its engine thread is stuck."""
        if step.step or any(not u.error.code for u in step.updates):
            self.last_output = self._clock()
        owed = self._owed
        if not owed:
            return
        if step.HasField("columns"):  # each request stepped, and its ack where it has one
            cols = step.columns
            for rid, epoch, seq in zip(cols.request_id, cols.epoch, cols.input_seq, strict=True):
                self._stepped(rid, epoch)
                if seq:
                    self._reported(rid, epoch, seq, failed=False)
        for entry in step.batch:
            self._stepped(entry.request_id, entry.fence.epoch)
        for u in step.updates:
            self._reported(u.request_id, u.fence.epoch, u.input_seq, failed=bool(u.error.code))

    def _stepped(self, request_id: str, epoch: int) -> None:
        """The request was stepped at ``epoch``: what it owed is answered, but for input not
        reported consumed yet."""
        o = self._owed.get(request_id)
        if o is not None and epoch == o.epoch:
            o.answer = False
            if not o.seq:
                del self._owed[request_id]

    def _reported(self, request_id: str, epoch: int, input_seq: int, *, failed: bool) -> None:
        """News of the request at ``epoch`` with its input consumed up to ``input_seq`` (0:
        none reported): settles what that covers."""
        o = self._owed.get(request_id)
        if o is None:
            return
        if failed or epoch > o.epoch:
            del self._owed[request_id]  # rejected, failed or moved past: nothing more comes of it
            return
        if epoch < o.epoch:
            return
        o.answer = False
        if input_seq >= o.seq:
            o.seq = 0
        if not o.seq:
            del self._owed[request_id]

    def quiet_for(self, now: float | None = None) -> float:
        """Seconds the worker has owed something without sending anything (0 when it owes
        nothing: an idle link is never stalled)."""
        if not self._owed:
            return 0.0
        now = self._clock() if now is None else now
        quiet = now - self.last_output
        if quiet <= 0:
            return 0.0
        oldest = min(o.since for o in self._owed.values())
        return max(0.0, min(quiet, now - oldest))
