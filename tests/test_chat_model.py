"""The chat stage's worker model (``worker_service.models.chat``) against the scripted chat server
(a real HTTP server process on loopback): what it sends, what each step gives back (text, tool
calls in pieces, the end), and how a server that hangs, fails or is down fails the turn."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from duplex.errors import BadEventError, WorkerErrorCode
from tests.chat_helpers import ChatServer, chat_server
from worker_service.cli import build_parser, config_from_args
from worker_service.metrics import LLM_REQUESTS
from worker_service.model import RequestNews, StepBatch, ToolCallPiece
from worker_service.models.chat import ChatModel, ChatState

__all__ = ["chat_server"]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


def step(model: ChatModel, state: ChatState) -> RequestNews | None:
    result = model.step(StepBatch(["s"], [state], np.zeros((1, 512), np.float32), np.array([False])))
    return result.news[0]


def run(model: ChatModel, state: ChatState, timeout_s: float = 10.0) -> list[RequestNews]:
    """Step until the reply ends (finished or failed)."""
    out: list[RequestNews] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        news = step(model, state)
        if news is not None:
            out.append(news)
            if news.response_finished or news.error is not None:
                return out
        time.sleep(0.01)
    raise AssertionError(f"no end within {timeout_s}s: {out}")


def ask(model: ChatModel, state: ChatState, **request: object) -> None:
    model.respond(state)
    model.take_text(state, json.dumps({"messages": MESSAGES, **request}), True)


def result_count(result: str) -> float:
    return LLM_REQUESTS.labels(result=result)._value.get()


@pytest.fixture
def server(chat_server: ChatServer) -> Iterator[ChatServer]:
    chat_server.reset()
    yield chat_server


def model_for(server: ChatServer, **options: object) -> ChatModel:
    return ChatModel(torch.device("cpu"), url=server.url, model="scripted-llm", **options)  # type: ignore[arg-type]


def test_it_streams_the_reply_text_in_pieces_and_ends(server: ChatServer, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-test-123\n")
    model = model_for(server, api_key_file=str(key))
    state = model.create_state("s")
    server.script({"text": "Hello. How are you today?", "pieces": 5, "delay_s": 0.02})
    before = result_count("completed")
    ask(model, state)
    news = run(model, state)
    assert news[0].response_started and news[-1].response_finished
    assert "".join(n.text for n in news) == "Hello. How are you today?"
    assert len([n for n in news if n.text]) >= 2  # handed on as it came, not at the end
    (request,) = server.requests()
    assert request["messages"] == MESSAGES and request["model"] == "scripted-llm" and request["stream"]
    assert request["authorization"] == "Bearer sk-test-123"  # from the file, never a flag
    assert result_count("completed") == before + 1
    assert not model.is_responding(state)


def test_a_tool_call_comes_in_pieces_named_first_and_done_last(server: ChatServer) -> None:
    model = model_for(server)
    state = model.create_state("s")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    server.script(
        {"text": "Let me look.", "tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    )
    ask(model, state, tools=tools, tool_choice="auto")
    news = run(model, state)
    pieces: list[ToolCallPiece] = [p for n in news for p in n.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].call_id == "call_scripted_1"
    assert all(p.call_id == "call_scripted_1" for p in pieces)
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris"}'
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(n.text for n in news) == "Let me look."
    (request,) = server.requests()
    assert request["tools"] == tools and request["tool_choice"] == "auto"


def test_a_server_that_hangs_fails_the_turn_upstream_unavailable_counted(server: ChatServer) -> None:
    model = model_for(server, timeout_s=0.5)
    state = model.create_state("s")
    server.script({"hang": True})
    before = result_count("timeout")
    ask(model, state)
    started = time.monotonic()
    news = run(model, state)
    assert news[-1].error_code == WorkerErrorCode.UPSTREAM_UNAVAILABLE
    assert "did not answer within 0.5 s" in (news[-1].error or "")
    assert 0.4 < time.monotonic() - started < 5
    assert result_count("timeout") == before + 1


def test_errors_of_the_server_say_whether_trying_again_may_help(server: ChatServer) -> None:
    model = model_for(server)
    state = model.create_state("s")
    server.script({"status": 503}, {"status": 400})
    ask(model, state)
    assert run(model, state)[-1].error_code == WorkerErrorCode.UPSTREAM_UNAVAILABLE
    model.cancel_response(state)
    ask(model, state)
    failed = run(model, state)[-1]
    assert failed.error_code != WorkerErrorCode.UPSTREAM_UNAVAILABLE and "HTTP 400" in (failed.error or "")


def test_a_server_that_is_down_fails_the_turn_upstream_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    model = ChatModel(torch.device("cpu"), url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=2)
    state = model.create_state("s")
    before = result_count("unavailable")
    ask(model, state)
    news = run(model, state)
    assert news[-1].error_code == WorkerErrorCode.UPSTREAM_UNAVAILABLE and "could not be reached" in (
        news[-1].error or ""
    )
    assert result_count("unavailable") == before + 1


def test_a_cancel_closes_the_stream_and_nothing_of_it_comes_after(server: ChatServer) -> None:
    model = model_for(server)
    state = model.create_state("s")
    server.script({"text": "one two three four five six seven eight", "pieces": 8, "delay_s": 0.1})
    before = result_count("cancelled")
    ask(model, state)
    first = None
    while first is None or not first.text:
        first = step(model, state)
        time.sleep(0.01)
    model.cancel_response(state)  # a barge-in: the engine cancels the reply
    deadline = time.monotonic() + 5
    while result_count("cancelled") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert result_count("cancelled") == before + 1
    assert step(model, state) is None and not model.is_responding(state)


def test_the_worker_streams_at_most_its_concurrency_and_a_request_waits_at_most_the_timeout(
    server: ChatServer,
) -> None:
    model = model_for(server, concurrency=1, timeout_s=0.5)
    first, second = model.create_state("a"), model.create_state("b")
    # The first streams for 2.4 s, a piece each 0.3 s (within the timeout): it holds the one slot.
    server.script({"text": "one two three four five six seven eight", "pieces": 8, "delay_s": 0.3})
    ask(model, first)
    time.sleep(0.3)
    ask(model, second)
    news = run(model, second)
    assert news[-1].error_code == WorkerErrorCode.UPSTREAM_UNAVAILABLE and "slots" in (news[-1].error or "")
    assert len(server.requests()) == 1  # the second never reached the server


def test_a_request_that_is_not_a_chat_request_is_refused() -> None:
    model = ChatModel(torch.device("cpu"), url="http://127.0.0.1:9/v1", model="m")
    state = model.create_state("s")
    model.respond(state)
    with pytest.raises(BadEventError, match="not JSON"):
        model.take_text(state, "hello", True)
    for bad in ({"messages": []}, {"messages": MESSAGES, "stream": False}, ["x"]):
        state = model.create_state("s")
        model.respond(state)
        with pytest.raises(BadEventError):
            model.take_text(state, json.dumps(bad), True)


def test_the_command_line_takes_the_llm_flags_and_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = [
        "--model",
        "chat",
        "--llm-url",
        "http://127.0.0.1:8000/v1",
        "--llm-model",
        "qwen",
        "--llm-concurrency",
        "4",
    ]
    config = config_from_args(build_parser().parse_args(args))
    assert config.model_options == {
        "url": "http://127.0.0.1:8000/v1",
        "model": "qwen",
        "api_key_file": "",
        "timeout_s": 30.0,
        "concurrency": 4,
    }
    with pytest.raises(ValueError, match="needs --llm-url"):
        config_from_args(build_parser().parse_args(["--model", "chat"]))
    with pytest.raises(ValueError, match="options of --model chat"):
        config_from_args(build_parser().parse_args(["--model", "parrot", "--llm-url", "http://x/v1"]))
    monkeypatch.setenv("DUPLEX_LLM_API_KEY", "sk-env")
    model = ChatModel(torch.device("cpu"), url="http://127.0.0.1:9/v1", model="m")
    assert model._key == "sk-env"
    with pytest.raises(ValueError, match="http"):
        ChatModel(torch.device("cpu"), url="127.0.0.1:8000", model="m")
