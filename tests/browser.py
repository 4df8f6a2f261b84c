"""A real headless Chromium for the tests of pages: started with a fake microphone fed from a WAV
file, driven over the DevTools protocol (``Runtime.evaluate`` in a page), stopped by its own pid.

Debian's ``chromium`` (``apt-get install chromium``) is run directly (``/usr/lib/chromium/chromium``,
not the wrapper script) with its own ``HOME`` and ``TMPDIR`` under a temporary directory.
``--allow-loopback-in-peer-connection``: without it Chrome leaves loopback out of ICE, and the
tests' edges are on loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from duplex.spawn import popen

CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")


def chromium_path() -> str | None:
    """The Chromium binary of this machine (None without one)."""
    for path in CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


class BrowserError(Exception):
    pass


class Page:
    """One tab, driven over its DevTools WebSocket."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self.console: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self._ws.recv())
            if message.get("method") == "Runtime.consoleAPICalled":
                args = message["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                self.console.append("exception: " + str(details.get("exception", {}).get("description")))
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", timeout_s=15)

    async def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The value of ``expression`` in the page (a promise is awaited), as JSON."""
        async with asyncio.timeout(timeout_s):
            result = await self.call(
                "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
            )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression[:80]}: {text}\nconsole: {self.console[-20:]}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression}\nconsole: {self.console[-20:]}")
            await asyncio.sleep(0.1)


class Browser:
    """A headless Chromium process whose fake microphone plays ``microphone`` (a WAV, looped)."""

    def __init__(self, microphone: Path, *, binary: str | None = None) -> None:
        found = binary or chromium_path()
        if found is None:
            raise BrowserError("no chromium on this machine (apt-get install chromium)")
        self.binary = found
        self.microphone = microphone
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="duplex-chromium-"))
        self.port = 0

    def start(self, timeout_s: float = 20.0) -> None:
        profile = self._dir / "profile"
        home = self._dir / "home"
        tmp = self._dir / "tmp"
        for d in (profile, home, tmp):
            d.mkdir()
        args = [
            self.binary,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--mute-audio",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={self.microphone}",
            "--autoplay-policy=no-user-gesture-required",
            "--allow-loopback-in-peer-connection",
            "about:blank",
        ]
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp)}
        # Its own process group (led by its pid): its renderer and utility processes go with it.
        self.proc = popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            new_session=True,
            parent_death_signal=signal.SIGKILL,
        )
        marker = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not marker.exists() or not marker.read_text().strip():
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise BrowserError("chromium did not open its DevTools port")
            time.sleep(0.05)
        self.port = int(marker.read_text().split()[0])

    def stop(self) -> None:
        """SIGTERM to the browser (its pid), then SIGKILL to what is left of its process group
        (the group this test started: its pid is the group's id)."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Browser:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _get(self, path: str, method: str = "GET") -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    @contextlib.asynccontextmanager
    async def page(self, url: str = "about:blank") -> AsyncIterator[Page]:
        """A new tab (closed at the end), its console collected, at ``url``."""
        target = json.loads(await asyncio.to_thread(self._get, "/json/new?about:blank", "PUT"))
        try:
            async with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.call("Page.enable")
                if url != "about:blank":
                    await page.goto(url)
                yield page
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._get, f"/json/close/{target['id']}")
