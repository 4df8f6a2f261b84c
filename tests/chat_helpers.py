"""The scripted chat server of the chat stage's tests (``tests.chat_server``) as a child process:
started on a loopback port 0, scripted and read over HTTP, stopped by its pid."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest


class ChatServer:
    """One ``python -m tests.chat_server`` process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chat_server", "--port", "0"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError("the scripted chat server did not start")
        self.url: str = json.loads(line)["url"]
        """The API base URL (``http://127.0.0.1:PORT/v1``): what ``--llm-url`` takes."""
        self._root = self.url.removesuffix("/v1")

    def _call(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self._root + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def script(self, *replies: dict[str, Any]) -> None:
        """Answer the next requests with ``replies``, in order (see ``tests.chat_server``)."""
        self._call("POST", "/script", list(replies))

    def requests(self) -> list[dict[str, Any]]:
        """Every request it got since the last ``reset``: messages, tools, tool choice, model."""
        result: list[dict[str, Any]] = self._call("GET", "/requests")
        return result

    def wait_requests(self, n: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The requests, once there are at least ``n``."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.requests()
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def reset(self) -> None:
        self._call("POST", "/reset", {})

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer()
    try:
        yield server
    finally:
        server.stop()


def user_texts(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "user"]
