"""A language model in the loop: speech recognition -> a chat model -> speech synthesis.

The cascade (``session_service.plugins.cascade``) with a real language model in its middle:

- ``asr`` (``--model asr``): the user's words, as in the cascade;
- ``chat`` (``--model chat --llm-url URL --llm-model NAME``): a language model served elsewhere
  (vLLM, SGLang, any OpenAI-compatible chat server). Each reply, it is sent the conversation as
  the session keeps it (``session_service.session.history``: the instructions as the system
  message, the user's transcripts, the replies as the user heard them, the tool calls and their
  results) and the client's tools; its text goes on to the TTS stage sentence by sentence, its
  tool calls to the client (``function_call_delta``, ``function_call``);
- ``tts`` (``--model tts``): the reply spoken, each sentence's text with its first frame.

Options (``extra_body``, at open or in ``session.update``): the cascade's (``silence_ms``,
``voice``, ``wpm``, ``overlap_turns``), and ``tools`` (function tools, in the Realtime API's shape
``{"type": "function", "name", "description", "parameters"}`` or the chat API's
``{"type": "function", "function": {...}}``; at most ``MAX_TOOLS`` of them, ``MAX_TOOLS_CHARS``
of JSON: they travel in the resume token with the instructions) and ``tool_choice`` (``auto``,
``none``, ``required``, or a function by name). The instructions may change at any time: the
model reads them afresh every reply.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Final

from duplex.errors import echo
from session_service.plugin import (
    Capabilities,
    Flow,
    RuntimeConfigError,
    SessionSettings,
    Stage,
)
from session_service.plugins.cascade import CascadePlugin
from session_service.session.history import ChatHistory, HistoryPolicy, Role

STAGES = (
    Stage("asr", "asr", takes=Flow.AUDIO, gives=Flow.TEXT, responds=False),
    Stage("chat", "chat", takes=Flow.TEXT, gives=Flow.TEXT),
    Stage("tts", "tts", takes=Flow.TEXT, gives=Flow.AUDIO),
)
MAX_TOOLS: Final = 32
MAX_TOOLS_CHARS: Final = 4096
"""Compact JSON of all the tools (they travel in the resume token, beside the instructions)."""
MAX_TOOL_NAME_CHARS: Final = 64
TOOL_CHOICES: Final = ("auto", "none", "required")
#: A TEXT submission's bound (``worker_service.commands.MAX_TEXT_CHARS``): the request goes in pieces.
PIECE_CHARS: Final = 4096
HISTORY: Final = HistoryPolicy(max_turns=32, max_chars=24_000)
_CASCADE_KEYS: Final = frozenset({"silence_ms", "voice", "wpm", "overlap_turns"})


class ChatPlugin(CascadePlugin):
    """Session and engine policy of ASR -> chat -> TTS (see the module docstring)."""

    plugin_id = "chat"
    model_id = "asr"
    stages = STAGES
    instructions_anytime = True

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        return dataclasses.replace(super().capabilities(max_sessions=max_sessions), function_calling=True)

    # ---- options ------------------------------------------------------------------------------

    def validate_client_extra_body(self, extra_body: Mapping[str, object]) -> None:
        cascade = {k: v for k, v in extra_body.items() if k in _CASCADE_KEYS or k == "model"}
        for key, value in extra_body.items():
            if key == "tools":
                _check_tools(value)
            elif key == "tool_choice":
                _check_tool_choice(value)
            elif key not in cascade:
                raise RuntimeConfigError(
                    f"unknown extra_body key {echo(key)} "
                    "(chat takes silence_ms, voice, wpm, overlap_turns, tools, tool_choice)"
                )
        super().validate_client_extra_body(cascade)

    def runtime_config_for_update(
        self, settings: SessionSettings, current: Mapping[str, object], extra_body: Mapping[str, object]
    ) -> dict[str, object]:
        self.validate_client_extra_body(extra_body)
        cascade = {k: v for k, v in extra_body.items() if k in _CASCADE_KEYS}
        config = super().runtime_config_for_update(settings, current, cascade)
        for key in ("tools", "tool_choice"):
            if key in extra_body:
                config[key] = extra_body[key]
        return config

    # ---- the conversation ---------------------------------------------------------------------

    def history_policy(self, runtime_config: Mapping[str, object]) -> HistoryPolicy | None:
        del runtime_config
        return HISTORY

    def stage_input(
        self,
        stage: Stage,
        *,
        transcript: str | None,
        history: ChatHistory | None,
        settings: SessionSettings,
        runtime_config: Mapping[str, object],
    ) -> list[str] | None:
        """The chat request: the instructions, the conversation as heard, the tools; None when
        a turn brought no words and nothing else is owed an answer."""
        assert history is not None
        if transcript is not None and not history.awaiting_reply:
            return None
        messages = chat_messages(settings.instructions, history)
        if not messages:
            return None
        request: dict[str, Any] = {"messages": messages}
        tools = runtime_config.get("tools")
        if isinstance(tools, list) and tools:
            request["tools"] = [_chat_tool(t) for t in tools]
            choice = runtime_config.get("tool_choice")
            if choice is not None:
                request["tool_choice"] = _chat_tool_choice(choice)
        text = json.dumps(request, ensure_ascii=False, separators=(",", ":"))
        return [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]


def chat_messages(instructions: str, history: ChatHistory) -> list[dict[str, Any]]:
    """The conversation in the chat API's messages: each reply as heard, its tool calls, and
    right after it each call's result (the client's, or a note that it was cancelled or has
    none yet: the API wants one per call)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for m in history.messages:
        if m.role is Role.USER:
            out.append({"role": "user", "content": m.text})
            continue
        content = m.content
        if not content and not m.calls:
            continue  # a reply the user heard nothing of, with no calls: never said
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if m.calls:
            msg["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.calls
            ]
        out.append(msg)
        out.extend({"role": "tool", "tool_call_id": c.call_id, "content": c.result} for c in m.calls)
    return out


def _check_tools(value: object) -> None:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RuntimeConfigError(f"tools must be a list of at most {MAX_TOOLS} function tools")
    if len(json.dumps(value, separators=(",", ":"))) > MAX_TOOLS_CHARS:
        raise RuntimeConfigError(
            f"tools take at most {MAX_TOOLS_CHARS} characters of JSON (they travel in the resume token)"
        )
    names = set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RuntimeConfigError(f'tools[{i}] must be an object with "type": "function"')
        fn = tool.get("function", tool)
        if not isinstance(fn, dict):
            raise RuntimeConfigError(f"tools[{i}].function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            raise RuntimeConfigError(f"tools[{i}] needs a name of 1..{MAX_TOOL_NAME_CHARS} characters")
        if name in names:
            raise RuntimeConfigError(f"tools[{i}]: the name {echo(name)} is taken by another tool")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise RuntimeConfigError(f"tools[{i}].description must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RuntimeConfigError(f"tools[{i}].parameters must be a JSON schema object")


def _check_tool_choice(value: object) -> None:
    if isinstance(value, str) and value in TOOL_CHOICES:
        return
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function", value)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            return
    raise RuntimeConfigError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": NAME}'
    )


def _chat_tool(tool: object) -> dict[str, Any]:
    """A tool in the chat API's shape (``{"type": "function", "function": {...}}``)."""
    assert isinstance(tool, dict)
    if isinstance(tool.get("function"), dict):
        return {"type": "function", "function": tool["function"]}
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: object) -> object:
    if isinstance(choice, dict):
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        return {"type": "function", "function": {"name": name}}
    return choice
