"""A model in the loop's conversation in the runner (a layer of ``SessionRunner``, above ``Staging``).

A plugin with a ``history_policy`` (a chat stage) has its session keep the conversation the
model sees (``session.history.ChatHistory``). This layer feeds it from the session's events:

- a committed turn's transcript is the user's message (before the reply's input is built from it);
- each reply's playback ledger: what the model wrote and where each spoken sentence starts (the
  stage pipeline), the reply's audio as it goes out to the client (``_audio_out``), the client's
  ``playback_ack`` (the Realtime edge's ``conversation.item.truncate``), and how the reply ended
  (a cancel cuts it where the audio had got to, and cancels its unanswered tool calls);
- the client's ``function_call_output`` answers a call (refused: an unknown call, a second
  answer, an answer to a call cancelled with its reply);
- ``response_create`` with no committed turn asks the model to go on from the conversation as it
  stands (a tool's result, the instructions alone): the reply's input is built at once.

What survives a resume: the history's records travel in the resume token (``progress``), as many
of the newest as fit (``session_service.trust.resume_tokens``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import session_pb2
from session_service.metrics import EVENTS_IN
from session_service.session.history import ChatHistory
from session_service.session.lifecycle import CloseReason, TurnStatus
from session_service.session.settings import struct_to_dict
from session_service.session.staging import Staging
from session_service.session.state import COMPLETED, Status
from session_service.trust.resume_tokens import SessionProgress

if TYPE_CHECKING:
    from session_service.session.response import ActiveResponse

log = logging.getLogger(__name__)


class Conversing(Staging):
    """The conversation a chat stage sees (a layer of ``SessionRunner``; see the module docstring)."""

    history: ChatHistory | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        policy = self._plugin.history_policy(self.runtime_config)
        if policy is None:
            return
        progress: SessionProgress | None = kwargs.get("progress")
        try:
            self.history = ChatHistory.from_records(list(progress.history) if progress else [], policy)
        except ValueError:  # a token of an issuer that wrote them otherwise: start afresh
            log.warning("session %s: the resume token's history is unreadable", self.session_id)
            self.history = ChatHistory(policy)

    # ---- what the session tells the history --------------------------------------------------

    def transcribed(self, transcript: str) -> None:
        if self.history is not None:
            self.history.user(transcript)
        super().transcribed(transcript)

    def _response_done(
        self, resp: ActiveResponse, status: Status, reason: str, *, restarting: bool = False
    ) -> None:
        # The history first: the token ``response_done`` carries knows the reply as heard.
        if self.history is not None and not restarting:
            self.history.reply_ended(resp.response_id, completed=status == COMPLETED)
        super()._response_done(resp, status, reason, restarting=restarting)

    def _close(self, reason: CloseReason) -> None:
        if self.history is not None and self.response is not None:
            self.history.reply_ended(self.response.response_id, completed=False)
        super()._close(reason)

    def _audio_out(self, delta: session_pb2.AudioDelta) -> None:
        """A reply's audio went out to the client (taken by its stream)."""
        if self.history is not None:
            end = delta.offset_ms + self.settings.output_format.duration_ms(len(delta.pcm))
            self.history.sent(delta.response_id, end)

    def progress(self) -> SessionProgress:
        progress = super().progress()
        if self.history is None:
            return progress
        return dataclasses.replace(progress, history=tuple(self.history.records()))

    # ---- the client's events that speak of the conversation ------------------------------------

    async def _dispatch(self, ev: session_pb2.ClientEvent, received: float, size: int) -> None:
        kind = ev.WhichOneof("event")
        history = self.history
        if history is None or kind not in ("playback_ack", "function_call_output", "response_create"):
            await super()._dispatch(ev, received, size)
            return
        if kind == "response_create" and (self.turn_status is TurnStatus.COMMITTED or self._stages is None):
            await super()._dispatch(ev, received, size)  # a reply to the committed turn
            return
        EVENTS_IN[kind].inc()
        if kind == "playback_ack":
            ack = ev.playback_ack
            response_id = ack.response_id or (self.response.response_id if self.response else "")
            history.played(response_id, float(ack.played_ms))
        elif kind == "function_call_output":
            fco = ev.function_call_output
            history.answer(fco.call_id, fco.output)
        else:
            await self._go_on(ev.response_create, ev.event_id)

    async def _go_on(self, rc: session_pb2.ResponseCreate, event_id: str) -> None:
        """``response_create`` with no committed turn: the model goes on from the conversation as
        it stands (after a tool's result, or to speak first)."""
        await self._bound_link()
        if self.response is not None:
            raise BadEventError(ErrorCode.RESPONSE_IN_PROGRESS, "a response is already active")
        if struct_to_dict(rc.extra_body):
            raise BadEventError(
                ErrorCode.UNSUPPORTED_BY_MODEL,
                "a model served in stages takes its options from session.update, not per response",
            )
        assert self._stages is not None
        self._stages.continuation = True
        try:
            self._start_response(self._clock.now(), None, event_id=event_id)
        finally:
            self._stages.continuation = False
