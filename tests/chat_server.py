"""A small scripted OpenAI-compatible chat server, the language model of the chat stage's tests.

``python -m tests.chat_server`` serves ``POST /v1/chat/completions`` (streamed as the OpenAI API
streams: ``data: {chunk}`` server-sent events, then ``data: [DONE]``) on loopback, port 0 by
default, and announces itself in one JSON line on stdout (``{"event": "listening", "url":
"http://127.0.0.1:PORT/v1"}``). It records every request (its messages, tools, tool choice and
``Authorization`` header) and answers each with the next scripted reply:

- ``{"text": "...", "pieces": N, "delay_s": S}``: the text in N pieces, S apart;
- ``{"tool_call": {"name": ..., "arguments": "..."}, "text": "..."}``: (some text, then) a tool
  call, its arguments in three pieces;
- ``{"hang": true}``: headers never come (until the client gives up);
- ``{"status": 503}``: an HTTP error.

With nothing scripted it answers ``"You said: <the last user message>."``, or, after a tool
result, ``"The tool says: <its output>."``. The tests script it and read what it got over HTTP:
``POST /script`` (a JSON list of replies, appended), ``GET /requests`` (what it recorded),
``POST /reset``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from aiohttp import web

REQUESTS = web.AppKey("requests", list)
SCRIPT = web.AppKey("script", list)


def _chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-scripted",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n".encode()


def _default_reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return {"text": f"The tool says: {last.get('content')}."}
    return {"text": f"You said: {last.get('content') or ''}."}


def _pieces(text: str, n: int) -> list[str]:
    n = max(1, min(n, len(text) or 1))
    size = -(-len(text) // n)
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


async def completions(request: web.Request) -> web.StreamResponse:
    try:
        return await _completions(request)
    except ConnectionError:  # the client went away (a cancelled reply): nothing to answer
        return web.Response(status=499)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    app = request.app
    app[REQUESTS].append(
        {
            "messages": body.get("messages"),
            "tools": body.get("tools"),
            "tool_choice": body.get("tool_choice"),
            "model": body.get("model"),
            "stream": body.get("stream"),
            "authorization": request.headers.get("Authorization", ""),
        }
    )
    script: list[dict[str, Any]] = app[SCRIPT]
    reply = script.pop(0) if script else _default_reply(body.get("messages") or [])
    if reply.get("hang"):
        await asyncio.sleep(3600)
    if reply.get("status"):
        return web.json_response({"error": {"message": "scripted failure"}}, status=int(reply["status"]))
    model = str(body.get("model", ""))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    delay = float(reply.get("delay_s", 0.0))
    await resp.write(_chunk(model, {"role": "assistant", "content": ""}))
    text = str(reply.get("text", ""))
    for piece in _pieces(text, int(reply.get("pieces", 4))) if text else []:
        await asyncio.sleep(delay)
        await resp.write(_chunk(model, {"content": piece}))
    finish = "stop"
    call = reply.get("tool_call")
    if call:
        finish = "tool_calls"
        first = {"index": 0, "id": call.get("id", "call_scripted_1"), "type": "function"}
        await resp.write(
            _chunk(model, {"tool_calls": [first | {"function": {"name": call["name"], "arguments": ""}}]})
        )
        for piece in _pieces(str(call.get("arguments", "{}")), 3):
            await asyncio.sleep(delay)
            await resp.write(_chunk(model, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
    await resp.write(_chunk(model, {}, finish))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def script(request: web.Request) -> web.Response:
    replies = await request.json()
    request.app[SCRIPT].extend(replies)
    return web.json_response({"scripted": len(request.app[SCRIPT])})


async def requests(request: web.Request) -> web.Response:
    return web.json_response(request.app[REQUESTS])


async def reset(request: web.Request) -> web.Response:
    request.app[REQUESTS].clear()
    request.app[SCRIPT].clear()
    return web.json_response({})


def make_app() -> web.Application:
    app = web.Application()
    app[REQUESTS] = []
    app[SCRIPT] = []
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/script", script)
    app.router.add_get("/requests", requests)
    app.router.add_post("/reset", reset)
    return app


async def serve(host: str, port: int) -> None:
    runner = web.AppRunner(make_app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()  # type: ignore[union-attr]
    print(json.dumps({"event": "listening", "url": f"http://{host}:{bound[1]}/v1"}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.chat_server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
