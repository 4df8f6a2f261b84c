"""The plugin base class: session policy and engine policy of one model, in one object."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from duplex.audio import PCM16K_MONO, PcmFormat
from duplex.errors import ErrorCode
from duplex.fence import Fence
from duplex.v1 import worker_pb2
from session_service.plugin._data_plane import DataPlane
from session_service.plugin._pcm_buffer import FramePacketizer, PcmAppendBuffer
from session_service.plugin._stages import Stage, split_sentences
from session_service.plugin._types import (
    Capabilities,
    OutputAction,
    OutputDecision,
    SessionSettings,
)
from session_service.session.history import ChatHistory, HistoryPolicy


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One step of a replay (``DuplexModelPlugin.plan_replay``)."""

    frames: bytes | None
    """Whole worker frames to APPEND; None for an explicit COMMIT."""
    replay: bool = False
    """A worker consumed these frames before and reported their news (``Submission.replay``)."""
    turn_id: int = 0
    """The turn they were first handed on under (their fence's ``turn_id`` again)."""


@dataclass(slots=True)
class ModelSessionState:
    """Model-owned per-session state, owned by the session's runner (never shared)."""

    audio_buffer: PcmAppendBuffer
    """Client PCM to worker frames."""
    input_since_commit_samples: int = 0
    """Worker-format samples handed on since the last commit."""
    context_locked: bool = False
    """Set at the first response: instructions may no longer change."""


class DuplexModelPlugin(ABC):
    """Everything the session service needs to know about one full-duplex model."""

    plugin_id: str = ""
    """The id clients name in ``open.model``."""
    model_id: str = ""
    """The worker ``model_id`` this plugin drives (defaults to ``plugin_id``)."""
    private_runtime_config_keys: frozenset[str] = frozenset()
    """extra_body keys reserved for the server (rejected with ``private_runtime_key``)."""
    data_plane: DataPlane
    """Projection of step outputs into client events."""
    worker_format: PcmFormat = PCM16K_MONO
    """Format of PCM on the worker stream."""
    frame_samples: int = 0
    """Samples per worker frame; appends carry whole frames."""
    sampling_defaults: tuple[object, ...] = ()
    """One sampling parameter object per stage; configured values must keep each type."""
    max_append_bytes: int = 256 * 1024
    """Largest client append chunk."""
    silence_continuation: bool = False
    """The model is lockstep (clocked by input frames, e.g. parrot): while a response is active
    and the client sends no audio, the runner feeds silence at real-time deadlines so the turn
    goes on. Free-running models leave it off."""
    replayable: bool = False
    """The model's per-session state on a worker is rebuilt by replaying the session's recent
    input there: the APPENDs and COMMITs since the last answered commit (``plan_replay``), with
    news the first worker reported not repeated. Then a turn survives its worker: the session
    moves to another one, replays, and restarts an interrupted response for the same turn. A
    model whose state depends on more than that input (say, a long generated context it cannot
    re-derive) leaves it off: a lost worker then fails the turn."""
    model_native: bool = False
    """The model decides itself when to speak (model-native duplex: Moshi, PersonaPlex): input
    flows to it continuously (the client's audio, and silence at real-time deadlines when the
    client sends none), each of its speech spans is a response (the worker's
    ``response_started`` / ``response_finished`` news open and close one), and the client events
    that presume turns (commit, clear, response.create, barge_in) are refused with
    ``unsupported_by_model``. Such a model's state is the whole conversation: it is not
    ``replayable``, and a lost worker resets its context (``context_reset``)."""
    stages: tuple[Stage, ...] = ()
    """The model served in stages, in order (``session_service.plugin._stages``); empty: one
    worker model (``model_id``). The first is ``model_id``'s, fed the session's input; each
    later one is placed on its own pool of workers. ``sampling_defaults`` has one per stage."""
    instructions_anytime: bool = False
    """The model reads the instructions afresh for each reply (a chat stage is sent the whole
    conversation every turn): they may change at any time, not only before the first response."""
    replay_window_s: float = 15.0
    """How much input the model's state depends on (the parrot keeps at most 15 s of utterance):
    the session keeps at most this much of the committed input a response answers and as much
    of the input since (each also at most the session's buffer limit)."""

    # ---- session policy ----

    @abstractmethod
    def capabilities(self, *, max_sessions: int) -> Capabilities: ...

    @abstractmethod
    def default_settings(self) -> SessionSettings:
        """Settings of a session resumed on a replica that never saw its open."""

    @abstractmethod
    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        """Raise ``RuntimeConfigError`` (private keys: code ``private_runtime_key``).

        ``extra_body`` is plain JSON already bounded by the session service: at most 16 KiB
        encoded and 16 levels deep, numbers finite floats (``session_service.session.settings``). Quote
        client values in a message only through ``duplex.errors.echo`` (bounded, escaped). What
        this accepts travels in the session's resume token (8192 characters for everything,
        instructions up to 4 KiB of it): accept small options, or opens fail ``invalid_config``."""

    @abstractmethod
    async def prepare_runtime_config(
        self, settings: SessionSettings, extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        """The runtime config of a new session (may do I/O, e.g. load a voice)."""

    @abstractmethod
    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        """The runtime config after a session update (already validated extra_body)."""

    def runtime_config_for_function_output(
        self, settings: SessionSettings, current: Mapping[str, object], call_id: str, output: str
    ) -> dict[str, object] | None:
        """A runtime config patch for a function-call result; models without tools keep None."""
        del settings, current, call_id, output
        return None

    def runtime_config_after_model_output(
        self, current: Mapping[str, object], update: worker_pb2.RequestUpdate
    ) -> dict[str, object] | None:
        """A runtime config patch after a model output was observed (default: none)."""
        del current, update
        return None

    def create_session_state(self, settings: SessionSettings) -> ModelSessionState:
        return ModelSessionState(
            audio_buffer=FramePacketizer(settings.input_format, self.worker_format, self.frame_samples)
        )

    # ---- engine policy ----

    @abstractmethod
    def configure_sampling_params(
        self, *, runtime_config: Mapping[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        """One sampling parameter per stage, each of its default's type."""

    @abstractmethod
    def worker_params(
        self, *, settings: SessionSettings, runtime_config: Mapping[str, object], sampling: tuple[object, ...]
    ) -> dict[str, Any]:
        """The worker's model options (``Submission.params``) for this session."""

    def plan_append(
        self, *, request_id: str, fence: Fence, seq: int, frames: bytes, params: Mapping[str, Any] | None
    ) -> list[worker_pb2.Submission]:
        """Submissions that hand ``frames`` (whole worker frames) to the worker."""
        if not frames:
            return []
        sub = worker_pb2.Submission(
            request_id=request_id, kind=worker_pb2.SUBMISSION_KIND_APPEND, seq=seq, pcm=frames
        )
        fence.write_to(sub.fence)
        _set_params(sub, params)
        return [sub]

    def plan_control(
        self,
        *,
        request_id: str,
        fence: Fence,
        kind: worker_pb2.SubmissionKind.ValueType,
        params: Mapping[str, Any] | None,
    ) -> worker_pb2.Submission:
        """A COMMIT, RESPOND or CLEAR submission."""
        sub = worker_pb2.Submission(request_id=request_id, kind=kind)
        fence.write_to(sub.fence)
        _set_params(sub, params)
        return sub

    def plan_replay(
        self,
        *,
        request_id: str,
        fence: Fence,
        first_seq: int,
        steps: Sequence[ReplayStep],
        params: Mapping[str, Any] | None,
    ) -> list[worker_pb2.Submission]:
        """Submissions that rebuild the session's model state on a new worker from its kept
        input: a CLEAR first (should the worker still hold uncommitted input of the session, it
        is not doubled), then ``steps`` in order, each an APPEND of whole frames (``replay``: a
        worker already reported its news) or an explicit COMMIT (``frames`` None), under the
        fence's epoch and the step's own turn. APPEND seqs run from ``first_seq``, one per
        APPEND step, in order (the runner numbers the input by them); ``params`` (the
        session's options) go with the first submission."""
        subs = [
            self.plan_control(
                request_id=request_id, fence=fence, kind=worker_pb2.SUBMISSION_KIND_CLEAR, params=params
            )
        ]
        seq = first_seq
        for step in steps:
            step_fence = Fence(fence.session_id, fence.epoch, step.turn_id)
            if step.frames is None:
                subs.append(
                    self.plan_control(
                        request_id=request_id,
                        fence=step_fence,
                        kind=worker_pb2.SUBMISSION_KIND_COMMIT,
                        params=None,
                    )
                )
                continue
            sub = worker_pb2.Submission(
                request_id=request_id,
                kind=worker_pb2.SUBMISSION_KIND_APPEND,
                seq=seq,
                pcm=step.frames,
                replay=step.replay,
            )
            step_fence.write_to(sub.fence)
            subs.append(sub)
            seq += 1
        return subs

    # ---- stages (a plugin with ``stages``) ----

    def stage_params(
        self,
        stage: Stage,
        *,
        settings: SessionSettings,
        runtime_config: Mapping[str, object],
        sampling: object,
    ) -> dict[str, Any]:
        """The worker's model options of a later stage for this session (``sampling``: that
        stage's entry of the sampling tuple); the first stage's are ``worker_params``."""
        del stage, settings, runtime_config, sampling
        return {}

    def forward_text(self, stage: Stage, text: str, *, final: bool) -> tuple[list[str], str]:
        """What of ``stage``'s text, given so far and not yet handed on, the next stage gets now
        (pieces, each its own TEXT submission) and what waits for more; ``final``: the stage
        finished, hand on everything. Default: whole sentences (a TTS stage speaks each as soon as
        it is there; the first reply audio waits for one sentence, not for the whole reply)."""
        del stage
        return split_sentences(text, final)

    def history_policy(self, runtime_config: Mapping[str, object]) -> HistoryPolicy | None:
        """Whether the session keeps the conversation for the model, and how much of it
        (``session_service.session.history``): a model that reads the whole conversation every
        turn (a chat stage) returns a policy; None (the default): no history is kept."""
        del runtime_config
        return None

    def stage_input(
        self,
        stage: Stage,
        *,
        transcript: str | None,
        history: ChatHistory | None,
        settings: SessionSettings,
        runtime_config: Mapping[str, object],
    ) -> list[str] | None:
        """What the second stage is given for a reply, in TEXT pieces (each at most 4096
        characters, the worker's bound): the committed turn's ``transcript`` by default. With a
        ``history_policy``, ``history`` holds the conversation with the turn's words already in
        it (``transcript`` is None for a reply to a tool's result: ``response_create`` after
        ``function_call_output``). None: there is nothing to answer (no words were heard), and
        the reply ends at once with nothing said."""
        del stage, history, settings, runtime_config
        return [transcript or ""]

    def draining_stages(self, runtime_config: Mapping[str, object]) -> frozenset[str]:
        """Stages whose reply may go on while the user's next turn starts (the contract's
        concurrent turns): once every other stage finished its part of the reply, speech does not
        barge in on it; the next turn is heard, committed and answered after it, and nothing of
        it is cancelled. Default: none (speech during any stage's part barges in)."""
        del runtime_config
        return frozenset()

    def decide_output(self, update: worker_pb2.RequestUpdate) -> OutputDecision | None:
        """What an update means for the active response (None: nothing)."""
        if update.HasField("error"):
            return OutputDecision(OutputAction.FAIL, update.error.code or ErrorCode.MODEL_ERROR.value)
        if update.response_finished:
            return OutputDecision(OutputAction.COMPLETE)
        return None

    def commit_model_context(self, *, session_id: str, assistant_text: str) -> None:
        """Persist model-context history at a turn boundary (default: nothing to keep)."""
        del session_id, assistant_text


def _set_params(sub: worker_pb2.Submission, params: Mapping[str, Any] | None) -> None:
    if params is not None:
        sub.params.SetInParent()  # present even when empty: "the options are now these"
        sub.params.update(dict(params))
