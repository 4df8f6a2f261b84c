"""Silence continuation: real-time silence for a model clocked by its input (a layer of the runner).

A lockstep model (one output frame per input frame: the parrot, Moshi) stalls without input, so
while the client has fallen behind real time the session feeds it silence at real-time deadlines
(``response.SilenceFeeder`` asks; the runner decides in order with the client's events, here):
during a response for a turn-based model, for the session's whole life for a model-native one
(it hears every frame, speaking or not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duplex.errors import UnavailableError
from session_service.metrics import MAILBOX_FULL, SILENCE_FRAMES
from session_service.session.client_events import ClientEvents
from session_service.session.mailbox import Mailbox
from session_service.session.response import ActiveResponse, SilenceFeeder


@dataclass(slots=True)
class SilenceRequest:
    """The silence feeder asks for a frame for ``response`` (None: a model-native session's
    feeder, which runs as long as the session)."""

    response: ActiveResponse | None


class SilenceFeeding(ClientEvents):
    """Feeding silence (a layer of ``SessionRunner``, above the client's events)."""

    _mailbox: Mailbox[Any]
    _native_feeder: SilenceFeeder | None
    """A model-native session's feeder (started with the session, stopped at its close)."""

    def _feeder(self, resp: ActiveResponse | None, *, max_frames: int) -> SilenceFeeder:
        """A feeder for ``resp`` (None: the session's own), asking through the mailbox."""
        return SilenceFeeder(
            period_s=self._frame_period,
            max_frames=max_frames,
            clock=self._clock,
            due_in=lambda: self._timeline.silence_due_in(self._clock.now(), self._frame_period),
            request=lambda: self._request_silence(resp),
        )

    def _request_silence(self, resp: ActiveResponse | None) -> bool:
        if not self._mailbox.put_nowait(SilenceRequest(resp)):
            MAILBOX_FULL.inc()
            return False
        return True

    async def _on_silence(self, resp: ActiveResponse | None) -> None:
        """Hand one frame of silence on, unless real input is waiting, the client caught up
        meanwhile, or the epoch, turn or response changed."""
        if resp is not None and (
            self.response is not resp or resp.epoch != self.epoch or resp.turn_id != self.turn_id
        ):
            return
        if not self._mailbox.empty() or not self._timeline.silence_due(self._clock.now(), self._frame_period):
            return
        link = self.link
        if link is None or not link.healthy:
            return
        wseq = self._worker_seq + 1
        fence = self._fence()
        subs = self._plugin.plan_append(
            request_id=self.session_id, fence=fence, seq=wseq, frames=self._silence_frame, params=None
        )
        try:
            await self._submit(link, subs)
        except UnavailableError:
            if self.link is not link:
                return  # lost with its worker: the session was told of the loss already
            raise
        if self.epoch == fence.epoch:
            self._worker_seq = wseq
            self.replay.appended(self._silence_frame, epoch=fence.epoch, seq=wseq, turn_id=fence.turn_id)
            self._handed_on(link, wseq, 1)
        self._timeline.silence(self._clock.now(), self._frame_period)
        feeder = resp.feeder if resp is not None else self._native_feeder
        if feeder is not None:
            feeder.fed()
        SILENCE_FRAMES.inc()
