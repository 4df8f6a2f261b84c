"""A chat stage: the middle of a pipeline is a language model served elsewhere (vLLM, SGLang, any
OpenAI-compatible chat server), reached over HTTP with the official ``openai`` client.

``duplex worker --model chat --llm-url URL --llm-model NAME``: the session hands it the turn's
chat request (a TEXT submission holding one JSON document: ``messages``, and ``tools`` /
``tool_choice`` when the client declared tools; the session builds it from the conversation it
keeps, ``session_service.session.history``) and a RESPOND. The request streams
``/v1/chat/completions`` on an event loop of this model's own, in a helper thread: the engine
thread never waits on the network. Each step hands on what arrived since the last: the reply's
text (``RequestNews.text``; the session hands it on to the TTS stage sentence by sentence), the
model's tool calls in pieces (``RequestNews.tool_calls``), and the end (``response_finished``).

Bounded: at most ``concurrency`` requests stream at once per worker (a request waits at most
``timeout_s`` for a slot); the server must answer, and then send each next piece, within
``timeout_s``. A server that is slow or down fails the turn with ``upstream_unavailable``
(retryable), one that refuses the request (a 4xx other than 408 and 429) with ``model_error``;
each counted in ``duplex_worker_llm_requests_total{result}``. A cancel (a barge-in: a newer
epoch) closes the request's stream at once. The API key comes from ``api_key_file`` or the
environment (``DUPLEX_LLM_API_KEY``), never from a command line that process lists show.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlparse

import openai
import torch

from duplex.audio import PCM16K_MONO
from duplex.errors import BadEventError, ErrorCode, WorkerErrorCode
from duplex.v1 import worker_pb2
from worker_service.config import DEFAULT_LLM_CONCURRENCY, DEFAULT_LLM_TIMEOUT_S, LLM_KEY_ENV
from worker_service.metrics import LLM_FIRST_TOKEN, LLM_IN_FLIGHT, LLM_REQUESTS
from worker_service.model import (
    RequestNews,
    StepBatch,
    StepModel,
    StepResult,
    ToolCallPiece,
    bad_submission,
    check_option_keys,
)

FRAME: Final = 512
"""Its tick: 32 ms (it has no audio; the frame clock paces what it hands on)."""
MAX_REQUEST_CHARS: Final = 262_144
"""The largest chat request a session may hand it (the session bounds its history far below)."""
#: Keys of the chat request document it passes on (``messages`` is required).
REQUEST_KEYS: Final = frozenset({"messages", "tools", "tool_choice", "temperature", "max_tokens"})


@dataclass(frozen=True, slots=True)
class _End:
    """The model's answer is complete."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """The request failed: ``code`` (``upstream_unavailable`` or ``model_error``) and why."""

    code: str
    message: str


_News = str | ToolCallPiece | _End | _Failed


@dataclass(slots=True, eq=False)
class _Call:
    """One chat completion in flight: the loop thread appends news, the engine thread takes it
    (``deque`` appends and pops are atomic; nothing else is shared)."""

    news: deque[_News] = field(default_factory=deque)
    future: Future[None] | None = None


@dataclass(slots=True, eq=False)
class ChatState:
    text: list[str] = field(default_factory=list)
    chars: int = 0
    final: bool = False
    responding: bool = False
    started: bool = False
    call: _Call | None = None


def read_api_key(key_file: str) -> str:
    """The API key: the first line of ``key_file``, or ``$DUPLEX_LLM_API_KEY``; "none" (a server
    without authentication) when neither is given."""
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"--llm-key-file {key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--llm-key-file {key_file} is empty")
        return key
    return os.environ.get(LLM_KEY_ENV, "").strip() or "none"


class ChatModel(StepModel[ChatState]):
    """Chat requests in, the model's text and tool calls out; see the module docstring."""

    model_id = "chat"
    audio_format = PCM16K_MONO
    frame_samples = FRAME

    def __init__(
        self,
        device: torch.device,
        *,
        url: str,
        model: str,
        api_key_file: str = "",
        timeout_s: float = DEFAULT_LLM_TIMEOUT_S,
        concurrency: int = DEFAULT_LLM_CONCURRENCY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"--llm-url must be the http(s) URL of the server's API, e.g. http://host:8000/v1 "
                f"(got {url!r})"
            )
        if not model:
            raise ValueError("--llm-model must name the model the server serves")
        if not 0 < timeout_s <= 3600:
            raise ValueError("--llm-timeout-s must be in (0, 3600]")
        if not 1 <= concurrency <= 4096:
            raise ValueError("--llm-concurrency must be in [1, 4096]")
        self.device = device
        self._url = url
        self._model = model
        self._key = read_api_key(api_key_file)
        self._timeout_s = float(timeout_s)
        self._clock = clock
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._client: openai.AsyncOpenAI | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="chat-llm", daemon=True)
        self._thread.start()

    # ---- the engine's side ----------------------------------------------------------------------

    def parse_options(self, params: Mapping[str, object]) -> object:
        check_option_keys(params, frozenset())
        return None

    def create_state(self, session_id: str) -> ChatState:
        return ChatState()

    def release_state(self, state: ChatState) -> None:
        self.cancel_response(state)

    def set_options(self, state: ChatState, options: object) -> None:
        del state, options

    def commit(self, state: ChatState) -> int:
        raise BadEventError(ErrorCode.UNSUPPORTED_BY_MODEL, "chat: COMMIT: it takes text")

    def clear(self, state: ChatState) -> None:
        """The request given so far, and any answer to it, go (the next reply's request follows)."""
        self.cancel_response(state)

    def take_text(self, state: ChatState, text: str, final: bool) -> None:
        if state.final:
            raise bad_submission("chat: text after the final piece of the request")
        if state.chars + len(text) > MAX_REQUEST_CHARS:
            raise bad_submission(f"chat: a request is at most {MAX_REQUEST_CHARS} characters")
        state.text.append(text)
        state.chars += len(text)
        state.final = final
        self._start(state)

    def respond(self, state: ChatState) -> None:
        state.responding = True
        self._start(state)

    def cancel_response(self, state: ChatState) -> None:
        call, state.call = state.call, None
        if call is not None and call.future is not None:
            call.future.cancel()  # the task is cancelled on its loop: the stream closes
        state.text.clear()
        state.chars = 0
        state.final = state.responding = state.started = False

    def is_responding(self, state: ChatState) -> bool:
        return state.responding

    def step(self, batch: StepBatch[ChatState]) -> StepResult:
        news: list[RequestNews | None] = [None] * len(batch.states)
        for i, st in enumerate(batch.states):
            if st.call is not None and st.call.news:
                news[i] = self._collect(st, st.call)
        return StepResult(
            outputs=worker_pb2.MultimodalOutputs(output_type=worker_pb2.OUTPUT_TYPE_TEXT),
            news=news,
            output_type=worker_pb2.OUTPUT_TYPE_TEXT,
        )

    def _start(self, state: ChatState) -> None:
        """Send the request once it is all there and a reply is asked for."""
        if not (state.responding and state.final) or state.call is not None:
            return
        request = _parse_request("".join(state.text))
        call = state.call = _Call()
        call.future = asyncio.run_coroutine_threadsafe(self._complete(call, request), self._loop)

    def _collect(self, st: ChatState, call: _Call) -> RequestNews:
        """What arrived since the last step, as one step's news."""
        n = RequestNews()
        text: list[str] = []
        while call.news:
            item = call.news.popleft()
            if isinstance(item, str):
                text.append(item)
            elif isinstance(item, ToolCallPiece):
                n.tool_calls.append(item)
            elif isinstance(item, _Failed):
                # The update carries this alone; the engine cancels the reply (and with it the call).
                return RequestNews(error=item.message, error_code=item.code)
            else:
                n.response_finished = True
                break
        n.text = "".join(text)
        if not st.started:
            st.started = n.response_started = True
        if n.response_finished:
            self.cancel_response(st)
        return n

    # ---- the loop thread's side -----------------------------------------------------------------

    def _openai(self) -> openai.AsyncOpenAI:
        if self._client is None:  # made on the loop thread, where it is used
            timeout = openai.Timeout(self._timeout_s, connect=min(self._timeout_s, 10.0))
            self._client = openai.AsyncOpenAI(
                base_url=self._url, api_key=self._key, max_retries=0, timeout=timeout
            )
        return self._client

    async def _complete(self, call: _Call, request: dict[str, Any]) -> None:
        """Stream one chat completion into ``call.news``; every end is counted."""
        began = self._clock()
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            self._fail(
                call,
                "timeout",
                f"all {self._concurrency} of the worker's language model slots stayed busy "
                f"for {self._timeout_s:g} s",
            )
            return
        LLM_IN_FLIGHT.inc()
        try:
            await self._stream(call, request, began)
            LLM_REQUESTS.labels(result="completed").inc()
        except asyncio.CancelledError:
            LLM_REQUESTS.labels(result="cancelled").inc()
            raise
        except openai.APITimeoutError:
            self._fail(
                call, "timeout", f"the language model server did not answer within {self._timeout_s:g} s"
            )
        except openai.APIConnectionError:
            self._fail(call, "unavailable", "the language model server could not be reached")
        except openai.APIStatusError as exc:
            status = exc.status_code
            if status in (408, 429) or status >= 500:
                self._fail(call, "unavailable", f"the language model server answered HTTP {status}")
            else:
                self._fail(
                    call,
                    "refused",
                    f"the language model server refused the request: HTTP {status}: {_short(exc.message)}",
                )
        except Exception as exc:  # an answer that could not be read: this reply fails, others go on
            self._fail(call, "failed", f"the language model's answer could not be read: {type(exc).__name__}")
        finally:
            LLM_IN_FLIGHT.dec()
            self._slots.release()

    async def _stream(self, call: _Call, request: dict[str, Any], began: float) -> None:
        stream = await self._openai().chat.completions.create(model=self._model, stream=True, **request)
        first = True
        calls: dict[int, str] = {}  # the stream's index of each tool call -> its id
        open_call: str | None = None
        async with stream:
            async for chunk in stream:
                for choice in chunk.choices[:1]:
                    delta = choice.delta
                    if first and (delta.content or delta.tool_calls):
                        first = False
                        LLM_FIRST_TOKEN.observe(self._clock() - began)
                    if delta.content:
                        call.news.append(delta.content)
                    for tc in delta.tool_calls or ():
                        call_id = calls.get(tc.index)
                        name = ""
                        if call_id is None:
                            if open_call is not None:  # the next call began: the last is whole
                                call.news.append(ToolCallPiece(open_call, done=True))
                            call_id = calls[tc.index] = tc.id or f"call_{uuid.uuid4().hex[:20]}"
                            open_call = call_id
                            name = (tc.function.name if tc.function else None) or ""
                        args = (tc.function.arguments if tc.function else None) or ""
                        if name or args:
                            call.news.append(ToolCallPiece(call_id, name=name, arguments=args))
        if open_call is not None:
            call.news.append(ToolCallPiece(open_call, done=True))
        call.news.append(_End())

    @staticmethod
    def _fail(call: _Call, result: str, message: str) -> None:
        LLM_REQUESTS.labels(result=result).inc()
        code = (
            WorkerErrorCode.UPSTREAM_UNAVAILABLE.value
            if result in ("timeout", "unavailable")
            else ErrorCode.MODEL_ERROR.value
        )
        call.news.append(_Failed(code, message))


def _parse_request(text: str) -> dict[str, Any]:
    """The session's chat request: one JSON object with ``messages`` (and the options
    ``REQUEST_KEYS`` names); anything else is ``bad_submission``."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise bad_submission("chat: the request is not JSON") from None
    if not isinstance(doc, dict):
        raise bad_submission("chat: the request is a JSON object")
    unknown = sorted(set(doc) - REQUEST_KEYS)
    if unknown:
        raise bad_submission(f"chat: unknown request key(s) {[k[:32] for k in unknown[:4]]}")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_submission("chat: the request's messages are a non-empty list of objects")
    return doc


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
