"""Stages in the runner: a plugin served in stages (a layer of the runner, above silence feeding).

The session's own worker is the first stage's; ``session.stages.StagePipeline`` holds the later
ones' workers and each reply's hand-offs. This layer connects it to the session: the router hands
it a later stage's output (``on_stage_output``), a cancel reaches every stage, the close releases
them, a lost stage worker is the pipeline's to replace (the first stage's is the session's, as for
any model: its input is replayed), a committed turn's transcript goes to the reply waiting for it.
The runner places the stages through its mailbox (``_PlaceStages``) and starts a response here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duplex.errors import BadEventError, DuplexError, ErrorCode, InternalError
from duplex.v1 import common_pb2, worker_pb2
from session_service.metrics import DROPPED
from session_service.session.lifecycle import ENDED_FOR_GOOD, CloseReason, DropReason
from session_service.session.silence import SilenceFeeding
from session_service.session.stages import StagePipeline
from session_service.session.state import Restart
from session_service.session.worker_handle import WorkerHandle
from session_service.session.worker_output import StepFence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PlaceStages:
    """Place the later stages that have no worker (and redo their part of the reply there)."""


class Staging(SilenceFeeding):
    """A plugin's later stages (a layer of ``SessionRunner``)."""

    _stages: StagePipeline | None
    """The later stages (None: the plugin is one model)."""

    def holds(self, link: WorkerHandle) -> bool:
        """Whether the session is placed on ``link``'s worker (its own, or a stage's)."""
        return self.link is link or (self._stages is not None and self._stages.binding_of(link) is not None)

    def on_stage_output(
        self,
        link: WorkerHandle,
        fence: StepFence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
        input_seq: int = 0,
    ) -> None:
        """One step's news from a later stage's worker (called synchronously by the router)."""
        stages = self._stages
        binding = stages.binding_of(link) if stages is not None else None
        if stages is None or binding is None or self.closed:
            DROPPED[DropReason.STALE_WORKER].inc()
            return
        try:
            stages.on_output(binding, fence, payload, updates, input_seq)
        except DuplexError as err:
            self._error(err)
        except Exception:
            log.exception("session %s: stage %s output failed", self.session_id, binding.stage.name)
            self._error(InternalError(ErrorCode.INTERNAL, "internal error"))
        self._check_overflow()

    def _start_staged(
        self, started_at: float, params: dict[str, Any] | None, restart: Restart | None, event_id: str
    ) -> None:
        """A response of a plugin served in stages: it begins now; the stages get the turn's
        transcript (the reply's input) as soon as it is there."""
        assert self._stages is not None
        if params is not None:
            raise BadEventError(
                ErrorCode.UNSUPPORTED_BY_MODEL,
                "a model served in stages takes its options from session.update, not per response",
            )
        resp = self._begin_response(started_at, None, restart, event_id)
        self._stages.begin(resp)

    def on_worker_lost(self, link: WorkerHandle) -> None:
        if self._stages is None or not self._stages.lost(link):
            super().on_worker_lost(link)

    def transcribed(self, transcript: str) -> None:
        super().transcribed(transcript)
        if self._stages is not None:
            self._stages.transcript = transcript
            self._stages.transcribed()

    def draining(self) -> bool:
        return self._stages is not None and self._stages.draining()

    def cancel(self, reason: str, *, to: int = 0) -> None:
        super().cancel(reason, to=to)
        if self._stages is not None:
            self._stages.aborted(reason)

    def _close(self, reason: CloseReason) -> None:
        if self.closed:
            return
        super()._close(reason)
        if self._stages is not None:
            self._stages.release_all(closed=reason in ENDED_FOR_GOOD)
