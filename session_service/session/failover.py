"""Failover: the session's worker binding, and how a session survives its worker.

A session lost with its worker moves to another (``_recover``, ``_bound_link``): the turn's kept
input is replayed there first (``_replay_on``, from ``session.replay``), then the interrupted
response restarts for the same turn (``_restart_response``). A turn that cannot be replayed (or
placed in time) is given up (``_give_up_turn``), and the workers that hold its stale state
release it before the session is placed again (``_release_stale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence

from duplex.errors import DuplexError, ErrorCode, UnavailableError
from duplex.v1 import session_pb2, worker_pb2
from session_service.metrics import FAILOVERS, REPLAYED_FRAMES, RESTARTED_RESPONSES, RESTARTS_TIMED_OUT
from session_service.plugin import ReplayStep
from session_service.session.lifecycle import CloseReason, InputStatus, TurnStatus
from session_service.session.replay import Marker
from session_service.session.state import FAILED, Restart, SessionState, WorkerHandle
from session_service.session.worker_output import WorkerOutput

#: Frames per APPEND of a replay (a replay is many frames; one message per frame would be waste).
REPLAY_APPEND_FRAMES = 64
#: How long a session that lost its worker keeps trying to place itself on another before the
#: interrupted turn is given up (a few tries: links come back, the pool re-resolves).
RECOVER_DELAYS_S = (0.0, 0.2, 0.5, 1.0)


class Failover(SessionState):
    _output: WorkerOutput
    """Worker output applied to this session (made by the shell: a layer above the state)."""

    """The worker binding, replay, restart and recover (a layer of ``SessionRunner``)."""

    _submit_wait: tuple[asyncio.Future[None], float] | None
    """The submission the runner awaits the write of, and when it is overdue."""

    def _hand_on(self, link: WorkerHandle, subs: Sequence[worker_pb2.Submission]) -> asyncio.Future[None]:
        """Queue submissions on the link; the future resolves once they are written. A client
        that takes its acks once the input is written (not carried on output) waits for that
        write, so the link writes them at its next write point (``prompt``)."""
        return link.submit(subs, prompt=not self.emitter.acks_on_output)

    async def _submit(self, link: WorkerHandle, subs: Sequence[worker_pb2.Submission]) -> None:
        """Hand submissions to the link and wait until they are written; one not written in
        ``submit_timeout_s`` fails (``_watch_deadlines`` fails it: no timer per submission)."""
        written = self._hand_on(link, subs)
        self._submit_wait = (written, self._clock.now() + self._cfg.submit_timeout_s)
        try:
            await written
        except DuplexError:
            raise
        except (TimeoutError, ConnectionError) as exc:
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"worker did not take the input: {exc}"
            ) from exc
        finally:
            self._submit_wait = None

    def on_worker_lost(self, link: WorkerHandle) -> None:
        """The worker went away (or hung), and the session's model state with it.

        With turn failover the session keeps its turn: the interrupted response ends
        ``failed/worker_unavailable``, and the session moves to another worker at once, replays
        the turn's input there and restarts the response for the same turn (``_recover``). The
        speech status stays as it is: the speech goes on on the new worker. Without it, what
        depended on the worker fails."""
        if self.link is not link or self.closed:
            return
        self._bind(None)
        if self._plugin.model_native:
            self._context_lost(link)
            return
        if self._replayable:
            if all(left is not link for left in self._left):
                self._left.append(link)
            self.reset_acks()  # the input is the session's to replay now
            resp = self._end_response()
            if resp is not None:
                self._restart = Restart(resp.turn_id, resp.params, resp.mark, "worker_lost")
                self._response_done(resp, FAILED, ErrorCode.WORKER_UNAVAILABLE.value, restarting=True)
            if not self._check_overflow():
                self._schedule_recover()
            return
        FAILOVERS.labels(result="not_replayable").inc()
        # The worker's model state went with it: uncommitted input (so no hole to protect) and
        # any committed utterance. The next submission starts over on a healthy worker.
        self._give_up_turn([link])
        if self.response is not None:
            self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
        self._error(UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the session's worker went away"))

    def _context_lost(self, link: WorkerHandle) -> None:
        """A model-native model's worker went away, and with it the model's context: its state is
        the whole conversation, which no kept input rebuilds. What it was saying ends
        ``failed/worker_unavailable``, the client is told the context starts over
        (``context_reset``), and the session moves to another worker at once with a fresh model
        (nothing to replay); input goes on to it. Nothing of the old worker reaches the client
        after this (its output is not this session's any more: ``stale_worker``)."""
        FAILOVERS.labels(result="context_reset").inc()
        self._stale.extend(() if any(stale is link for stale in self._stale) else (link,))
        self.reset_acks()
        if self.response is not None:
            self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
        self._safely(
            lambda: self.emitter.emit("context_reset", session_pb2.ContextReset(reason="worker_lost"))
        )
        if not self.closed:
            self._schedule_recover()

    async def _recover(self) -> None:
        """After a worker loss (or a takeover mid-reply): move to a healthy worker, replaying the
        turn's input there, and restart the interrupted response. A few tries (links come back,
        the pool re-resolves); then the turn is given up with ``worker_unavailable``."""
        for delay in RECOVER_DELAYS_S:
            if self.closed or (self._restart is None and self.link is not None and self.link.healthy):
                return  # a client event got there first
            if delay:
                await self._clock.sleep(delay)
            try:
                await self._bound_link()
                return
            except UnavailableError as err:
                last = err
        FAILOVERS.labels(result="unavailable").inc()
        # The turn is given up, all of it, as when the model cannot be replayed: the input kept
        # for it goes, not only what the interrupted response answered but what came after (fed
        # silence, what the user said while the worker hung), and the workers it was lost from
        # release what they hold of it. Either, kept, would start the next turn: speech the
        # model never reported on, heard on the next worker (replayed, or still in the old one's
        # state), committed and answered there, and that answer barged in on by what the user
        # says next.
        self._restart = None
        left, self._left = self._left, []
        self._give_up_turn(left)
        self._error(
            UnavailableError(ErrorCode.WORKER_UNAVAILABLE, f"the session's worker went away: {last.message}")
        )

    def _give_up_turn(self, lost: Sequence[WorkerHandle]) -> None:
        """The turn in progress is lost with the model state of the session's worker (``lost``:
        the workers it was lost from), all of it, so that the next input starts a new turn as on
        a fresh session: the input kept for the turn goes (uncommitted, and committed input no
        response answered), held acks go out (that input will never be consumed), an open
        speech span is closed, and the lost workers are to release what they hold of the
        session before it is placed again (``_release_stale``). A running response is the
        caller's to end."""
        self._stale.extend(link for link in lost if all(link is not stale for stale in self._stale))
        self.replay.clear()
        self.input_status = InputStatus.OPEN
        self.turn_status = TurnStatus.LISTENING
        self.state.input_since_commit_samples = 0
        self.reset_acks()
        self._output.end_speech()

    async def _release_stale(self) -> None:
        """Before the session is placed again: the workers that hold the model state of a turn
        given up release it (VAD state, input the user said meanwhile). The session may land on
        one of them, where a takeover keeps what the session holds there: that stale state
        would begin the next turn (speech heard in it committed and answered, then barged in
        on). The release goes first thing on a link that is down (kept for its next stream),
        and is written before anything else is asked of the worker on one that is up; a worker
        that no longer holds the session ignores it (reconciled when the link came back)."""
        stale, self._stale = self._stale, []
        fence = self._fence().to_proto()
        for link in stale:
            link.release(worker_pb2.Release(request_id=self.session_id, fence=fence, closed=False))
            if link.healthy:
                with contextlib.suppress(UnavailableError):  # lost again: kept for its next stream
                    await self._submit(link, ())

    async def _bound_link(self) -> WorkerHandle:
        """The session's worker, placing the session again when it has none (or a dead one):
        the turn's input is replayed there first, and an interrupted response restarts."""
        link = self.link
        if link is not None and link.healthy:
            if self._restart is not None:
                self._restart_response(link)
            return link
        if self._stale:
            await self._release_stale()
        try:
            # With takeover: this runner holds the session, so whoever still holds it on the new
            # worker (an owner that lost it, a hung replica) is fenced out rather than refusing
            # us; under mutual TLS a higher epoch alone would not move it.
            link, granted = await self._placer(self.session_id, self.epoch, True)
        except DuplexError as err:
            if err.code == ErrorCode.SESSION_CLOSED:
                # Taken over and closed for good by another replica while this one was cut off
                # from the worker: closed here too (a resume here must not find it open).
                self._close(CloseReason.RESUMED_ELSEWHERE)
            raise UnavailableError(
                ErrorCode.WORKER_UNAVAILABLE, f"no worker for the session: {err.message}"
            ) from err
        self._bind(link)
        self._options_pending()
        # Bound first: emitting held acks may overflow the outbound queue and close the session,
        # which must then release the new placement too.
        self.reset_acks()  # nothing is in flight on the new placement
        if granted > self.epoch:
            self._moved_to_epoch(granted)
        if self._replayable:
            try:
                await self._replay_on(link)
            except BaseException:
                # Not on the new worker after all (a restart there would answer nothing): the
                # next try places the session again and replays from the start.
                if self.link is link:
                    self._unbind_after_failed_replay(link)
                raise
        self._left.clear()  # placed: what the workers it left hold is reconciled when they return
        if self._restart is not None:
            self._restart_response(link)
        return link

    def _unbind_after_failed_replay(self, link: WorkerHandle) -> None:
        link.release(
            worker_pb2.Release(request_id=self.session_id, fence=self._fence().to_proto(), closed=False)
        )
        self._bind(None)
        self.reset_acks()

    async def _replay_on(self, link: WorkerHandle) -> None:
        """Hand the kept input of the turn to the session's new worker, before anything else."""
        plan = self.replay.plan(REPLAY_APPEND_FRAMES * self._frame_bytes)
        if not plan:
            FAILOVERS.labels(result="replayed").inc()
            return
        steps = [
            ReplayStep(frames=None, turn_id=item.turn_id)
            if isinstance(item, Marker)
            else ReplayStep(item.frames, item.replay, item.turn_id)
            for item in plan
        ]
        first = self._worker_seq + 1
        fence = self._fence()
        subs = self._plugin.plan_replay(
            request_id=self.session_id, fence=fence, first_seq=first, steps=steps, params=self._take_options()
        )
        try:
            await self._submit(link, subs)
        except BaseException:
            self._options_pending()
            raise
        seq = first
        frames = 0
        for item in plan:
            if isinstance(item, Marker):
                continue
            item.handed_on(epoch=fence.epoch, seq=seq)
            n = item.size // self._frame_bytes
            self._handed_on(link, seq, n)
            frames += n
            seq += 1
        self._worker_seq = seq - 1
        REPLAYED_FRAMES.inc(frames)
        FAILOVERS.labels(result="replayed").inc()

    def _restart_response(self, link: WorkerHandle) -> None:
        restart, self._restart = self._restart, None
        if restart is None or self.response is not None or self.closed:
            return
        del link
        RESTARTED_RESPONSES.labels(cause=restart.cause).inc()
        self._start_response(self._clock.now(), restart.params, restart=restart)

    def _restart_deadline(self) -> float:
        """When a restarted response that sent no audio yet runs out of ``restart_timeout_s``
        (infinity: none is waiting)."""
        resp = self.response
        if resp is None or not resp.restart or resp.first_audio:
            return math.inf
        return resp.started_at + self._cfg.restart_timeout_s

    def _restart_overdue(self) -> None:
        """The turn's reply was lost with its worker and the new one did not bring it back in
        time: the caller is told (``response_done{FAILED, worker_unavailable}``, not
        ``restarting``), never left waiting. Anything of it the worker still sends is of a turn
        no response streams (dropped, counted)."""
        RESTARTS_TIMED_OUT.inc()
        self.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)

    def _schedule_recover(self) -> None:
        """Have the shell run ``_recover`` in order, between client events."""
        raise NotImplementedError
