"""A session's later stages (a plugin served in stages): their workers, and each reply's hand-offs.

The session's own worker link is the first stage's (speech recognition: its part of a turn is
the transcript at the turn's end). Each later stage has a worker of its own model, placed from
its own pool (``--stage-workers``) under the session's id and epoch; the runner is the
orchestrator, and this is its part of it (``StagePipeline``), with no awaiting but placement:

- a response begins: once the turn's transcript is there, the second stage gets it (CLEAR, then
  RESPOND and TEXT under the response's fence: the CLEAR drops what a reply that did not complete
  left there);
- a stage's text comes back here (``on_output``): it is checked against the response's fence,
  projected to the client if the stage says so, and handed on as the plugin plans it
  (``forward_text``: sentence by sentence by default), the first piece with the next stage's
  CLEAR and RESPOND; the stage's end hands on the rest, the last piece ``text_final``;
- the last stage's output (the reply's audio and its text) is the response's, applied as any
  worker output is (``WorkerOutput``): its completion completes the response;
- a cancel reaches every stage's worker (``aborted``) under the new epoch, as it reaches the
  first; the session's close releases them;
- a stage's worker lost (or hung) mid-reply is replaced from its pool and its part redone
  (``lost``, ``place``): a text stage runs again on the same input, what it had given already is
  checked and not handed on twice (a re-run that words it otherwise fails the reply: it cannot
  be told apart from what the client already heard); the last stage is given again all the text
  it had and leaves out the samples the client already got (``skip_samples``: speech synthesis
  of the same text gives the same samples). No worker in time: the reply fails
  ``worker_unavailable``, said so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duplex.errors import BadEventError, DuplexError, ErrorCode, UnavailableError, WorkerErrorCode
from duplex.fence import Fence
from duplex.v1 import common_pb2, worker_pb2
from session_service.metrics import DROPPED, STAGE_FAILOVERS, STAGE_LATENCY
from session_service.plugin import DuplexModelPlugin, Stage
from session_service.session.lifecycle import DropReason
from session_service.session.state import FAILED
from session_service.session.tool_calls import ReplyCalls, ToolCallError
from session_service.session.worker_handle import Placer, WorkerHandle
from session_service.session.worker_output import RETRYABLE, StepFence, client_code

if TYPE_CHECKING:
    from session_service.session.response import ActiveResponse
    from session_service.session.runner import SessionRunner

log = logging.getLogger(__name__)

CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
TEXT = worker_pb2.SUBMISSION_KIND_TEXT


@dataclass(slots=True, eq=False)
class StageBinding:
    """One later stage of a session: its worker, and its part of the current reply."""

    stage: Stage
    index: int
    """Its place in ``plugin.stages`` (its sampling parameter's too)."""
    placer: Placer
    link: WorkerHandle | None = None
    given: list[str] = field(default_factory=list)
    """The pieces of text handed to it in this reply, in order."""
    given_final: bool = False
    """The last piece has been handed to it."""
    sent: int = -1
    """How many of ``given`` its current worker has (-1: the reply has not begun there)."""
    out: str = ""
    """The text it gave in this reply (a text stage)."""
    handed: int = 0
    """How much of ``out`` went on to the next stage."""
    checked: int = 0
    """After a re-run: how much of ``out`` the re-run gave again (checked, not handed on twice)."""
    final_sent: bool = False
    """Its current worker has the last piece."""
    finished: bool = False
    began: float | None = None
    """When it got its first input of the reply; None once its first output was handed on
    (``STAGE_LATENCY``)."""

    def reset(self) -> None:
        self.given, self.given_final, self.sent, self.final_sent = [], False, -1, False
        self.began = None
        self.out, self.handed, self.checked, self.finished = "", 0, 0, False

    @property
    def busy(self) -> bool:
        """It has a part in the current reply that it has not finished."""
        return self.sent >= 0 and not self.finished


class StagePipeline:
    """The later stages of one session (see the module docstring)."""

    def __init__(
        self,
        session: SessionRunner,
        plugin: DuplexModelPlugin,
        placers: Mapping[str, Placer],
        schedule_placement: Callable[[], None],
    ) -> None:
        self._s = session
        self._plugin = plugin
        self._schedule = schedule_placement
        self._placing = False
        self.bindings = [
            StageBinding(stage, index, placers[stage.name])
            for index, stage in enumerate(plugin.stages)
            if index > 0
        ]
        self.transcript: str | None = None
        """The last committed turn's transcript, until a response takes it."""
        self._resp: ActiveResponse | None = None
        """The response the stages' parts are of (it may have ended since)."""
        self._waiting = False
        """The response waits for its turn's transcript."""
        self.continuation = False
        """The next response answers a tool's result, not a turn (``response_create`` after
        ``function_call_output``): its input is built at once."""
        self._calls = ReplyCalls("")
        """The reply's tool calls (the text stage's)."""

    # ---- where the stages' workers are ----------------------------------------------------------

    def binding_of(self, link: WorkerHandle) -> StageBinding | None:
        for b in self.bindings:
            if b.link is link:
                return b
        return None

    def links(self) -> list[WorkerHandle]:
        return [b.link for b in self.bindings if b.link is not None]

    @property
    def placed(self) -> bool:
        return all(b.link is not None and b.link.healthy for b in self.bindings)

    async def place(self, delays: Sequence[float]) -> None:
        """Place each stage that has no (healthy) worker on one from its pool, a few tries, and
        redo its part of the reply there. No worker in time: a reply that needs it fails."""
        s = self._s
        last: DuplexError | None = None
        try:
            for delay in delays:
                missing = [b for b in self.bindings if b.link is None or not b.link.healthy]
                if not missing or s.closed:
                    return
                if delay:
                    await s._clock.sleep(delay)
                for b in missing:
                    try:
                        link, granted = await b.placer(s.session_id, s.epoch, True)
                    except DuplexError as err:
                        last = err
                        continue
                    if s.closed:
                        link.release(self._release(closed=False))
                        return
                    self._bind(b, link, granted)
            if not self.placed and last is not None:
                self._gave_up(last)
        finally:
            self._placing = False

    def _bind(self, b: StageBinding, link: WorkerHandle, granted: int) -> None:
        s = self._s
        b.link = link
        if granted > s.epoch:
            # The worker had the session at a later epoch (it held it before): every stage moves
            # there, and a reply running under the old epoch cannot go on.
            s.cancel("worker_moved", to=granted)
            return
        if self._live() and b.sent >= 0 and self._calls.count and b.index < len(self._plugin.stages) - 1:
            # Its tool calls went out to the client: a re-run would call (or word it) otherwise.
            STAGE_FAILOVERS.labels(stage=b.stage.name, result="unavailable").inc()
            s.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
            s._error(
                UnavailableError(
                    ErrorCode.WORKER_UNAVAILABLE, "the reply's tool calls were lost with its worker"
                )
            )
            return
        if self._live() and b.sent >= 0:
            STAGE_FAILOVERS.labels(stage=b.stage.name, result="redone").inc()
            b.sent, b.final_sent, b.checked = -1, False, 0
            self._drive(b, redo=True)
        elif self._live() and b.given:
            self._drive(b)

    def _gave_up(self, err: DuplexError) -> None:
        s = self._s
        missing = [b for b in self.bindings if b.link is None or not b.link.healthy]
        for b in missing:
            STAGE_FAILOVERS.labels(stage=b.stage.name, result="unavailable").inc()
        if self._live() and any(b.sent >= 0 or b.given for b in missing):
            s.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
        names = ", ".join(b.stage.name for b in missing)
        s._error(
            UnavailableError(ErrorCode.WORKER_UNAVAILABLE, f"no worker for stage {names}: {err.message}")
        )

    def need_placement(self) -> None:
        if not self._placing and not self._s.closed:
            self._placing = True
            self._schedule()

    def lost(self, link: WorkerHandle) -> bool:
        """A stage's worker went away (or hung): whether it was one of this session's. Its part
        of the reply is redone on another one (``place``); its session there is released."""
        b = self.binding_of(link)
        if b is None:
            return False
        b.link = None
        link.release(self._release(closed=False))  # kept for its next stream if it comes back
        STAGE_FAILOVERS.labels(stage=b.stage.name, result="lost").inc()
        if self._live() and (b.busy or b.given):
            self.need_placement()
        return True

    # ---- a reply through the stages -------------------------------------------------------------

    def _live(self) -> bool:
        resp = self._resp
        return resp is not None and self._s.response is resp and not self._s.closed

    def begin(self, resp: ActiveResponse) -> None:
        """A response began: the stages' parts start over for it; the second stage gets the turn's
        transcript as soon as it is there."""
        self._resp = resp
        self._calls = ReplyCalls(resp.response_id)
        for b in self.bindings:
            b.reset()
        if self.continuation:  # a reply to a tool's result: no turn to wait for
            self.continuation = self._waiting = False
            self._hand_input(None)
            return
        self._waiting = True
        if self.transcript is not None:
            self.transcribed()

    def transcribed(self) -> None:
        """The committed turn's transcript is there (``transcript``)."""
        if not self._waiting or not self._live():
            return
        self._waiting = False
        text, self.transcript = self.transcript or "", None
        self._hand_input(text)

    def _hand_input(self, transcript: str | None) -> None:
        """The second stage gets the reply's input as the plugin builds it (``stage_input``: the
        transcript, or the conversation); nothing to answer ends the reply with nothing said."""
        s, resp = self._s, self._resp
        assert resp is not None
        first = self.bindings[0]
        pieces = self._plugin.stage_input(
            first.stage,
            transcript=transcript,
            history=s.history,
            settings=s.settings,
            runtime_config=s.runtime_config,
        )
        if pieces is None:
            self._text(first, "", finished=True)  # the later stages end the reply, silent
            return
        if s.history is not None:
            s.history.begin_reply(resp.response_id)
        first.given, first.given_final = pieces, True
        self._drive(first)

    def _drive(self, b: StageBinding, *, redo: bool = False) -> None:
        """Hand ``b`` what it was given and its worker does not have yet (the reply's CLEAR and
        RESPOND first, once per worker)."""
        resp = self._resp
        link = b.link
        if resp is None or not self._live():
            return
        if link is None or not link.healthy:
            self.need_placement()
            return
        s = self._s
        fence = Fence(s.session_id, resp.epoch, resp.turn_id)
        subs: list[worker_pb2.Submission] = []
        if b.sent < 0:
            if not redo:
                b.began = s._clock.now()
            params = self._plugin.stage_params(
                b.stage, settings=s.settings, runtime_config=s.runtime_config, sampling=s._sampling[b.index]
            )
            if redo and b.index == len(self._plugin.stages) - 1:
                params = {**params, "skip_samples": resp.audio_samples}
            subs.append(
                self._plugin.plan_control(request_id=s.session_id, fence=fence, kind=CLEAR, params=params)
            )
            subs.append(
                self._plugin.plan_control(request_id=s.session_id, fence=fence, kind=RESPOND, params=None)
            )
            b.sent = 0
        pieces = b.given[b.sent :]
        if b.given_final and not pieces and not b.final_sent:
            pieces = [""]  # the end, with no more text (a reply that says nothing ends too)
        for i, piece in enumerate(pieces):
            sub = worker_pb2.Submission(
                request_id=s.session_id,
                kind=TEXT,
                text=piece,
                text_final=b.given_final and i == len(pieces) - 1,
            )
            fence.write_to(sub.fence)
            subs.append(sub)
        b.sent, b.final_sent = len(b.given), b.given_final
        if not subs:
            return
        try:
            link.submit(subs)
        except DuplexError:
            b.sent = -1  # the link went down: it is placed again and given it all
            self.need_placement()

    def on_output(
        self,
        b: StageBinding,
        fence: StepFence | None,
        payload: common_pb2.AudioPayload | None,
        updates: Sequence[worker_pb2.RequestUpdate],
        input_seq: int,
    ) -> None:
        """One step's news from a later stage's worker."""
        s = self._s
        if b.index == len(self._plugin.stages) - 1:
            if s.history is not None and s.response is not None:
                self._spoken(s.response, updates)
            s._output.handle(fence, payload, updates, input_seq)  # the reply's audio: the response's
            if b.began is not None and self._live() and s.response is not None and s.response.first_audio:
                self._handed_on(b)
            return
        if payload is not None:
            DROPPED[DropReason.RESPONSE_CANCELLED].inc()  # a text stage has no audio of its own
        for u in updates:
            if u.HasField("error"):
                self._error(b, u)
            elif self._current(u.fence):
                if u.tool_calls and not self._tool_calls(b, u.tool_calls):
                    return
                self._text(b, u.text, finished=u.response_finished)
            elif u.text or u.response_finished:
                DROPPED[DropReason.STALE_EPOCH if u.fence.epoch < s.epoch else DropReason.STALE_TURN].inc()

    def _current(self, fence: common_pb2.Fence) -> bool:
        resp = self._resp
        return (
            self._live() and resp is not None and fence.epoch == resp.epoch and fence.turn_id == resp.turn_id
        )

    def _text(self, b: StageBinding, text: str, *, finished: bool) -> None:
        """A text stage's text: checked against what it gave before a re-run, projected if the
        stage is the client's to read, handed on as the plugin plans."""
        s = self._s
        resp = self._resp
        assert resp is not None
        if b.checked < len(b.out) and text:
            again = text[: len(b.out) - b.checked]
            if b.out[b.checked : b.checked + len(again)] != again:
                s.finish_response(FAILED, ErrorCode.WORKER_UNAVAILABLE.value)
                s._error(
                    UnavailableError(
                        ErrorCode.WORKER_UNAVAILABLE,
                        f"stage {b.stage.name!r} was redone on another worker and worded the reply otherwise",
                    )
                )
                return
            b.checked += len(again)
            text = text[len(again) :]
        if text:
            b.out += text
            b.checked = len(b.out)
            if s.history is not None and b.index == len(self._plugin.stages) - 2:
                s.history.generated(resp.response_id, text)  # the reply as the model wrote it
            if b.stage.project_text:
                for ev in self._plugin.data_plane.project_text(resp.proj, text):
                    s._output._queue(ev, resp)
        if finished:
            b.finished = True
        pieces, rest = self._plugin.forward_text(b.stage, b.out[b.handed :], final=b.finished)
        b.handed = len(b.out) - len(rest)
        nxt = self.bindings[b.index]  # bindings start at stage 1: the next stage's is at b.index
        if pieces and b.began is not None:
            self._handed_on(b)
        if pieces or (b.finished and not nxt.given_final):
            nxt.given.extend(pieces)
            nxt.given_final = b.finished
            self._drive(nxt)

    def _tool_calls(self, b: StageBinding, pieces: Sequence[worker_pb2.ToolCallNews]) -> bool:
        """The text stage's tool calls: to the client as they are written, whole ones into the
        history; whether the reply goes on (calls past the bounds fail it)."""
        s, resp = self._s, self._resp
        assert resp is not None
        try:
            events, whole = self._calls.take(pieces)
        except ToolCallError as err:
            s.finish_response(FAILED, err.code)
            s._error(BadEventError(err.code, f"stage {b.stage.name!r}: {err.message}"))
            return False
        for ev in events:
            s._output._queue(ev, resp)
        if s.history is not None:
            for call in whole:
                s.history.tool_call(resp.response_id, call.call_id, call.name, call.arguments)
        return True

    def _spoken(self, resp: ActiveResponse, updates: Sequence[worker_pb2.RequestUpdate]) -> None:
        """The last stage's text comes with each sentence's first frame: where it starts in the
        reply's audio goes into the playback ledger (before this step's audio moves it on)."""
        assert self._s.history is not None
        for u in updates:
            if u.text and u.fence.epoch == resp.epoch and u.fence.turn_id == resp.turn_id:
                self._s.history.spoken(resp.response_id, resp.proj.audio_ms, u.text)

    def _handed_on(self, b: StageBinding) -> None:
        """``b``'s first output of the reply went on: its share of the first audio."""
        assert b.began is not None
        STAGE_LATENCY.labels(stage=b.stage.name).observe(self._s._clock.now() - b.began)
        b.began = None

    def _error(self, b: StageBinding, u: worker_pb2.RequestUpdate) -> None:
        s = self._s
        code = u.error.code
        if u.fence.epoch < s.epoch:
            DROPPED[DropReason.STALE_EPOCH].inc()
            return
        if code in (WorkerErrorCode.NOT_OWNER, WorkerErrorCode.STALE_EPOCH):
            DROPPED[DropReason.STALE_EPOCH].inc()
            s.fenced()  # another replica took the session over (a resume elsewhere)
            return
        if self._current(u.fence):
            s.finish_response(FAILED, client_code(code) if code else ErrorCode.MODEL_ERROR.value)
        s._error(
            BadEventError(
                client_code(code),
                f"stage {b.stage.name!r}: {u.error.message or code}",
                retryable=client_code(code) in RETRYABLE,
            )
        )

    def draining(self) -> bool:
        """The reply is down to stages the plugin lets drain (``draining_stages``): speech does
        not barge in on it."""
        if not self._live() or self._waiting:
            return False
        draining = self._plugin.draining_stages(self._s.runtime_config)
        return bool(draining) and all(b.finished or b.stage.name in draining for b in self.bindings)

    # ---- the epoch and the end -----------------------------------------------------------------

    def aborted(self, reason: str) -> None:
        """The session's epoch advanced (a cancel): every stage's worker drops the reply's work."""
        s = self._s
        fence = s._fence().to_proto()
        for link in self.links():
            link.abort(worker_pb2.Abort(request_id=s.session_id, fence=fence, reason=reason))

    def _release(self, *, closed: bool) -> worker_pb2.Release:
        return worker_pb2.Release(
            request_id=self._s.session_id, fence=self._s._fence().to_proto(), closed=closed
        )

    def release_all(self, *, closed: bool) -> None:
        """The session closed: each stage's worker lets it go."""
        for b in self.bindings:
            if b.link is not None:
                b.link.release(self._release(closed=closed))
                b.link = None
