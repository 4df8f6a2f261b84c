"""duplex.serving's event loop choice (``--event-loop``) and both services' flag."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys

import pytest

from duplex import serving
from duplex.serving import event_loop_name, run_service, running_loop_name, stop_signals
from duplex.stack import LocalStack
from session_service.api.cli import config_from_args as session_config
from session_service.config import ServiceConfig
from worker_service.cli import build_parser as worker_parser
from worker_service.cli import config_from_args as worker_config
from worker_service.config import WorkerConfig

# uvloop is a base dependency everywhere but Windows, where it does not run.
needs_uvloop = pytest.mark.skipif(sys.platform == "win32", reason="uvloop does not run on Windows")


async def _loop_name() -> str:
    return running_loop_name()


@needs_uvloop
def test_auto_is_uvloop_where_installed_and_asyncio_is_the_standard_loop():
    assert importlib.util.find_spec("uvloop") is not None  # a base dependency on this platform
    assert event_loop_name("auto") == "uvloop"
    assert event_loop_name("uvloop") == "uvloop"
    assert event_loop_name("asyncio") == "asyncio"
    assert run_service(_loop_name()) == "uvloop"
    assert run_service(_loop_name(), "uvloop") == "uvloop"
    assert run_service(_loop_name(), "asyncio") == "asyncio"


def test_auto_falls_back_to_asyncio_and_uvloop_is_refused_where_it_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        serving.importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    assert event_loop_name("auto") == "asyncio"
    assert run_service(_loop_name(), "auto") == "asyncio"
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop_name("uvloop")


def test_an_unknown_loop_is_refused_and_the_service_coroutine_is_closed_unrun():
    with pytest.raises(ValueError, match="--event-loop must be one of auto, uvloop, asyncio"):
        event_loop_name("trio")
    main = _loop_name()
    with pytest.raises(ValueError):
        run_service(main, "trio")
    assert main.cr_frame is None  # closed: no "never awaited" warning, nothing ran


@needs_uvloop
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_service_returns_what_the_service_returns_and_closes_its_loop(loop):
    async def main() -> asyncio.AbstractEventLoop:
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    ran_on = run_service(main(), loop)
    assert ran_on.is_closed()


def test_run_service_closes_a_service_that_fails_and_passes_its_error_on():
    async def main() -> None:
        raise RuntimeError("boom")

    coro = main()
    with pytest.raises(RuntimeError, match="boom"):
        run_service(coro, "asyncio")
    assert coro.cr_frame is None


@needs_uvloop
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_stop_signal_sets_the_event_and_its_handler_is_given_back(loop):
    before = signal.getsignal(signal.SIGTERM)

    async def main() -> object:
        with stop_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 5)
        return signal.getsignal(signal.SIGTERM)

    # Given back while the loop ran (uvloop's loop would not once it had stopped), and still so after.
    assert run_service(main(), loop) == before
    assert signal.getsignal(signal.SIGTERM) == before


def test_both_configs_refuse_an_unknown_loop():
    with pytest.raises(ValueError, match="event_loop must be one of"):
        ServiceConfig(plugin="p:P", workers=("127.0.0.1:1",), event_loop="trio")
    with pytest.raises(ValueError, match="event_loop must be one of"):
        WorkerConfig(event_loop="trio")


def test_both_services_take_the_flag():
    argv = ["--plugin", "session_service.plugins.parrot:ParrotPlugin", "--workers", "127.0.0.1:1"]
    assert session_config(argv).event_loop == "auto"
    assert session_config([*argv, "--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        session_config([*argv, "--event-loop", "trio"])
    assert worker_config(worker_parser().parse_args([])).event_loop == "auto"
    assert worker_config(worker_parser().parse_args(["--event-loop", "uvloop"])).event_loop == "uvloop"
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--event-loop", "trio"])


@needs_uvloop
@pytest.mark.process
def test_real_processes_announce_their_loop_uvloop_by_default_asyncio_when_asked():
    with LocalStack(startup_timeout_s=60) as stack:
        assert stack.session is not None and stack.session.event_loop == "uvloop"
        assert [w.event_loop for w in stack.worker_children] == ["uvloop"]
        assert stack.describe()["session"]["event_loop"] == "uvloop"  # type: ignore[index]
    flag = ["--event-loop", "asyncio"]
    with LocalStack(startup_timeout_s=60, session_args=flag, worker_args=flag) as stack:
        assert stack.session is not None and stack.session.event_loop == "asyncio"
        assert [w.event_loop for w in stack.worker_children] == ["asyncio"]


def test_settle_heap_moves_the_startup_heap_out_of_the_collectors_reach() -> None:
    import gc

    from duplex.serving import settle_heap

    kept = [[i] for i in range(1000)]  # startup objects that live for good
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(kept)  # a full collection no longer scans them
    finally:
        gc.unfreeze()
