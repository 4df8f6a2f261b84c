"""Routing of worker step outputs to session runners (after the fail-closed sparse check).

Every ``StepOutput`` first goes through ``route_step``: an invalid AUDIO declaration routes no
payload of the step at all. Updates (VAD, commits, completions, errors) still reach their
sessions, since each names its own request. Output for a request this replica does not hold,
or from a worker the session is no longer placed on, is dropped and counted. Output of a later
stage of a plugin served in stages goes to the runner's stage layer (``on_stage_output``).

Reconciliation: a new Run stream starts with the worker's list of the sessions it holds for
this replica (``StepOutput.held_sessions``). Each one this replica does not hold on that link
(not in the registry, closed, or its runner bound to another worker or to none, as after the
link was lost) is released at the worker, echoing the listed fence, so its model state does not
outlive the link. The rule is exact, not timed: a session held here and bound to the link is
kept, and so is one with an Attach in flight on the link (placement binds it, or the link
releases it again). A release at the listed epoch cannot release a later attachment: every
re-placement is a takeover, which the worker grants at a higher epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

from duplex.v1 import common_pb2, worker_pb2
from session_service.metrics import DROPPED, RECONCILED
from session_service.session.lifecycle import DropReason
from session_service.session.runner import SessionRunner, WorkerHandle
from session_service.session.worker_output import ColumnFence, StepFence
from session_service.workers.sparse_check import route_step

log = logging.getLogger(__name__)


class ReconcilingLink(WorkerHandle, Protocol):
    """What reconciliation needs of a link besides ``WorkerHandle`` (``WorkerLink`` is one)."""

    def attaching(self, session_id: str) -> bool:
        """Whether an Attach of the session is in flight on the link."""
        ...


class SessionRegistry:
    """The runners this replica holds, by session id (= worker request id)."""

    def __init__(self) -> None:
        self._runners: dict[str, SessionRunner] = {}

    def __len__(self) -> int:
        return len(self._runners)

    def __iter__(self) -> Iterator[SessionRunner]:
        return iter(list(self._runners.values()))

    def get(self, session_id: str) -> SessionRunner | None:
        return self._runners.get(session_id)

    def add(self, runner: SessionRunner) -> None:
        self._runners[runner.session_id] = runner

    def remove(self, runner: SessionRunner) -> None:
        if self._runners.get(runner.session_id) is runner:
            del self._runners[runner.session_id]


class Router:
    """StepOutput -> runners, by request id, with fenced and unknown output dropped and counted."""

    def __init__(self, registry: SessionRegistry) -> None:
        self._registry = registry

    def on_step(self, link: ReconcilingLink, step: worker_pb2.StepOutput) -> None:
        if step.held_sessions:
            self.reconcile(link, step.held_sessions)
        fences: dict[str, StepFence]
        acks: dict[str, int] = {}
        if step.HasField("columns"):
            # The columnar form: one decode per column for the whole step, no message per request.
            cols = step.columns
            batch_ids = tuple(cols.request_id)
            fences = dict(
                zip(batch_ids, map(ColumnFence, cols.session_id, cols.epoch, cols.turn_id), strict=True)
            )
            acks = {rid: seq for rid, seq in zip(batch_ids, cols.input_seq, strict=True) if seq}
        else:
            batch_ids = tuple(e.request_id for e in step.batch)
            fences = {e.request_id: e.fence for e in step.batch}
        routed = route_step(step, batch_ids)
        if routed.failed_closed is not None:
            DROPPED[DropReason.FAIL_CLOSED].inc(len(step.outputs.audio))
        updates: dict[str, list[worker_pb2.RequestUpdate]] = {}
        for u in step.updates:
            updates.setdefault(u.request_id, []).append(u)
        # Batch order first (audio order), then requests with only news or acks.
        targets = dict.fromkeys(rid for rid in routed.downstream_req_ids if rid in routed.payloads)
        targets.update(dict.fromkeys(updates))
        targets.update(dict.fromkeys(acks))
        for rid in targets:
            runner = self._registry.get(rid)
            if runner is None:
                DROPPED[DropReason.UNKNOWN_REQUEST].inc()
                continue
            try:
                if runner.link is link:
                    runner.on_output(
                        fences.get(rid), routed.payloads.get(rid), updates.get(rid, ()), acks.get(rid, 0)
                    )
                else:  # a later stage's worker of the session, or one it left (stale_worker)
                    runner.on_stage_output(
                        link,
                        fences.get(rid),
                        routed.payloads.get(rid),
                        updates.get(rid, ()),
                        acks.get(rid, 0),
                    )
            except Exception:  # one session's failure must not starve the others
                log.exception("routing to session %s failed", rid)

    def reconcile(self, link: ReconcilingLink, held: Iterable[common_pb2.Fence]) -> list[str]:
        """Release, at the worker behind ``link``, every listed session this replica does not
        hold on that link; returns their ids."""
        released: list[str] = []
        for fence in held:
            sid = fence.session_id
            runner = self._registry.get(sid)
            if runner is not None and not runner.closed and runner.holds(link):
                continue
            if link.attaching(sid):
                continue
            link.release(worker_pb2.Release(request_id=sid, fence=fence))
            released.append(sid)
        if released:
            RECONCILED.inc(len(released))
            log.info(
                "worker %s: released %d sessions it held for this replica that are no longer held on it here",
                link.address,
                len(released),
            )
        return released

    def on_link_lost(self, link: WorkerHandle) -> None:
        for runner in self._registry:
            runner.on_worker_lost(link)
