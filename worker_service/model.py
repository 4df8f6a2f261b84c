"""The model API: what a model implements to be served by the engine, and nothing more.

A model owns its per-request state (host values and device tensors alike) and one batched step.
The engine owns everything around it: queues, fencing, batching, output routing. A new model
implements ``StepModel`` and registers a factory in ``worker_service.models``; the engine is not
touched.

Threading: every method except ``parse_options`` runs on the engine thread, which owns torch and
the device, so model code needs no locks. ``parse_options`` is pure and runs on the asyncio side
(submissions are validated before they are queued).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from google.protobuf import struct_pb2

from duplex.audio import PcmFormat
from duplex.errors import BadEventError, DuplexError, ErrorCode, WorkerErrorCode
from duplex.v1 import worker_pb2
from worker_service.metrics import MODEL_HELPER_CPU

FloatArray = npt.NDArray[np.float32]
S = TypeVar("S")
T = TypeVar("T")

#: Output types a step can declare.
AUDIO: Final = worker_pb2.OUTPUT_TYPE_AUDIO
TEXT: Final = worker_pb2.OUTPUT_TYPE_TEXT
SPEECH_STARTED: Final = worker_pb2.VadEvent.KIND_SPEECH_STARTED
SPEECH_STOPPED: Final = worker_pb2.VadEvent.KIND_SPEECH_STOPPED


def run_as_helper(work: Callable[[], T]) -> T:
    """Run ``work``, something a model computes on its own threads (off the engine thread), with
    its CPU time counted as the model's (``duplex_worker_model_cpu_seconds_total{part="helpers"}``;
    the engine counts the steps): what the worker spends beyond the model is then measurable in
    place, where the model runs as it is served."""
    start = time.thread_time()
    try:
        return work()
    finally:
        MODEL_HELPER_CPU.inc(time.thread_time() - start)


def bad_submission(message: str) -> BadEventError:
    """The typed error for a submission the worker refuses (answered with an error update)."""
    return BadEventError(WorkerErrorCode.BAD_SUBMISSION, message)


def no_committed_input() -> BadEventError:
    return BadEventError(ErrorCode.NO_COMMITTED_INPUT, "RESPOND without committed input")


class ModelError(DuplexError):
    """A recoverable failure of one request inside the model (answered with ``model_error``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.MODEL_ERROR, message)


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    """A piece of a tool call a model makes (``worker_pb2.ToolCallNews``)."""

    call_id: str
    name: str = ""
    """The tool (in the call's first piece)."""
    arguments: str = ""
    """The next piece of its arguments (JSON text)."""
    done: bool = False
    """The call's arguments are complete."""


@dataclass(slots=True)
class RequestNews:
    """What one request produced in one step besides audio (all optional)."""

    vad: list[tuple[worker_pb2.VadEvent.Kind.ValueType, int]] = field(default_factory=list)
    """``(VadEvent.Kind, sample_offset)`` pairs, in order."""
    text: str = ""
    """Text produced this step."""
    turn_ended: bool = False
    """Turn detection committed the input (``committed_samples`` says how much)."""
    committed_samples: int = 0
    """Samples committed with ``turn_ended``."""
    response_started: bool = False
    """The first reply frame is in this step."""
    response_finished: bool = False
    """The last reply frame is in this step."""
    error: str | None = None
    """A per-request model failure: the request gets a ``model_error`` update, the batch goes on."""
    error_code: str = ""
    """With ``error``: ``upstream_unavailable`` when a service the model calls failed it (the
    update then carries that code and ``error`` as its message); else ``model_error``."""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)
    """Pieces of tool calls the model made this step, in order (a chat stage)."""
    user_text: str = ""
    """A speech recognizer's words of the user heard this step (the next piece of the turn's)."""
    user_transcript: str | None = None
    """With ``turn_ended``: the committed turn's whole transcript (a model that recognizes
    speech; None from one that does not)."""


@dataclass(slots=True)
class StepBatch(Generic[S]):
    """The input of one batched step."""

    req_ids: list[str]
    """Engine request ids (the session ids) in batch order: what a legacy ``meta.req_id`` names."""
    states: list[S]
    """Per-request model state, aligned to ``req_ids``."""
    frames: FloatArray
    """``(B, frame_samples)`` float32 in [-1, 1]; zeros where ``has_input`` is False."""
    has_input: npt.NDArray[np.bool_]
    """``(B,)``: which requests consumed an input frame this step."""


@dataclass(slots=True)
class StepResult:
    """The output of one batched step."""

    outputs: object
    """A typed ``worker_pb2.MultimodalOutputs`` or a legacy ``multimodal_outputs`` dict (the engine
    converts it with ``adapt_multimodal_outputs``, failing closed); ``None`` for no payloads."""
    news: list[RequestNews | None]
    """Per batch position; ``None`` when a request has nothing to report."""
    output_type: worker_pb2.OutputType.ValueType = AUDIO
    """The step's ``OutputType``."""


class StepModel(ABC, Generic[S]):
    """A model the engine can batch. Subclasses set the four class-level facts below."""

    model_id: str
    """Advertised in Describe; a session plugin refuses a worker with another id."""
    audio_format: PcmFormat
    """The PCM format of all audio in both directions."""
    frame_samples: int
    """Samples per input frame (APPEND carries whole frames) and per reply frame."""
    device: torch.device
    """Where the model's tensors live."""
    lockstep: bool = False
    """A full-duplex model clocked by its input: it produces reply output only in steps where it
    consumes an input frame (one out per one in), so replies run at the pace the input arrives.
    The engine then never steps a replying request without input; the session service keeps a
    turn going without client audio by feeding silence at real-time deadlines."""
    model_native: bool = False
    """The model decides itself when to speak (Moshi): no COMMIT or RESPOND, its speech spans are
    its replies (``RequestNews.response_started`` / ``response_finished`` open and close one), and
    the session feeds it input continuously."""
    fixed_batch: bool = False
    """The model steps a fixed batch of slots whatever the number of sessions (masked slots cost
    compute too): its tick costs the same with one more session, up to its slots."""
    free_running: bool = False
    """Step as soon as there is work instead of on the engine's frame clock (one step per frame
    period for every runnable request; ``worker_service.engine``). For a model whose steps are
    not tied to real time, e.g. one that generates faster than it plays; neither model here
    asks for it."""

    @abstractmethod
    def parse_options(self, params: Mapping[str, object]) -> object:
        """Validate submission ``params`` into an options value (pure; runs off the engine thread).

        Raises ``bad_submission`` for unknown keys or bad values. The result replaces the
        request's options when its submission is reached (``set_options``)."""

    @abstractmethod
    def create_state(self, session_id: str) -> S:
        """Fresh state for a session (first submission of a session, or after a release)."""

    @abstractmethod
    def release_state(self, state: S) -> None:
        """Free what ``create_state`` took (device slots, buffers)."""

    @abstractmethod
    def set_options(self, state: S, options: object) -> None:
        """Replace a request's options with a value from ``parse_options``."""

    @abstractmethod
    def commit(self, state: S) -> int:
        """COMMIT: the uncommitted input becomes the utterance; returns its length in samples."""

    def committed_transcript(self, state: S) -> str | None:
        """After ``commit``: the committed utterance's transcript, from a model that recognizes
        speech (its COMMIT's answer carries it); None from one that does not."""
        del state
        return None

    @abstractmethod
    def clear(self, state: S) -> None:
        """CLEAR: drop uncommitted input."""

    @abstractmethod
    def respond(self, state: S) -> None:
        """RESPOND: start a reply to the committed utterance (raise ``no_committed_input``)."""

    def take_text(self, state: S, text: str, final: bool) -> None:
        """TEXT: a piece of the reply's text input (``final``: the last); a model of a stage that
        takes text (a responder, a speech synthesizer) implements it."""
        del state, text, final
        raise BadEventError(ErrorCode.UNSUPPORTED_BY_MODEL, f"{self.model_id} takes no text input")

    @abstractmethod
    def cancel_response(self, state: S) -> None:
        """Stop a running reply now (a newer epoch aborted it); no further reply output."""

    @abstractmethod
    def is_responding(self, state: S) -> bool:
        """Whether the request has reply frames left (a free-running model needs steps without
        input for them; a ``lockstep`` one waits for input)."""

    @abstractmethod
    def step(self, batch: StepBatch[S]) -> StepResult:
        """One batched step. Raising is fatal for the engine; per-request failures go in news."""


class InputBuffer:
    """A session's uncommitted input, as frames, with absolute sample offsets.

    Bounded: when it holds more than ``cap`` samples the oldest frames are dropped, so a
    session that never commits cannot grow without bound.
    """

    __slots__ = ("_frames", "end", "start")

    def __init__(self, offset: int = 0) -> None:
        self._frames: deque[FloatArray] = deque()
        self.start = offset
        """Input offset of the first buffered sample."""
        self.end = offset
        """Input offset just past the last buffered sample."""

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, frame: FloatArray, cap: int) -> None:
        self._frames.append(frame)
        self.end += len(frame)
        while self.end - self.start > cap and len(self._frames) > 1:
            self.start += len(self._frames.popleft())

    def take(self, start: int, end: int, max_samples: int) -> FloatArray:
        """The samples in ``[start, end)`` (clipped to the buffer, at most the last ``max_samples``),
        then empty the buffer."""
        data = np.concatenate(list(self._frames)) if self._frames else np.zeros(0, np.float32)
        lo = max(start, self.start) - self.start
        hi = min(end, self.end) - self.start
        out = data[lo:hi] if hi > lo else np.zeros(0, np.float32)
        self.clear()
        return np.ascontiguousarray(out[-max_samples:], dtype=np.float32)

    def clear(self) -> None:
        self._frames.clear()
        self.start = self.end


def options_from_struct(params: struct_pb2.Struct) -> dict[str, object]:
    """A submission's ``params`` as plain values, refusing what no option can be: a Struct
    number may carry NaN or an infinity (which ``json_format.MessageToDict`` cannot even
    convert), so every number is checked finite here, nested ones included (``bad_submission``).
    The depth is bounded by protobuf's own parse recursion limit."""
    return {key: _plain(value, key) for key, value in params.fields.items()}


def _plain(value: struct_pb2.Value, key: str) -> object:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise bad_submission(f"option {key[:64]!r} must be a finite number")
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {k: _plain(v, key) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_plain(v, key) for v in value.list_value.values]
    return None  # null_value, or a Value with nothing set


def float_option(params: Mapping[str, object], key: str, default: float, lo: float, hi: float) -> float:
    """Read a finite numeric option in ``[lo, hi]`` (Struct numbers arrive as float); NaN, an
    infinity, a bool or anything not a number is ``bad_submission``."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_submission(f"option {key!r} must be a number")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise bad_submission(f"option {key!r} must be in [{lo}, {hi}]") from None
    if not math.isfinite(number):
        raise bad_submission(f"option {key!r} must be a finite number")
    if not lo <= number <= hi:
        raise bad_submission(f"option {key!r} must be in [{lo}, {hi}]")
    return number


def bool_option(params: Mapping[str, object], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise bad_submission(f"option {key!r} must be a bool")
    return value


def check_option_keys(params: Mapping[str, object], known: frozenset[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        # Echoed to the caller: a few of them, each cut short, not whatever it sent.
        shown = [k[:64] for k in unknown[:8]]
        more = f" and {len(unknown) - len(shown)} more" if len(unknown) > len(shown) else ""
        raise bad_submission(f"unknown option(s) {shown}{more}; known: {sorted(known)}")
