"""The session's state and its synchronous transitions, without an event loop (no runner)."""

from __future__ import annotations

import asyncio

import pytest

from duplex.v1 import session_pb2
from session_service.config import RunnerConfig
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.lifecycle import ENDED_FOR_GOOD, CloseReason, OptionsStatus, SeqStatus
from session_service.session.state import SessionState, WorkerHandle
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink


async def _no_placer(session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
    raise AssertionError("the state never places the session")


def _state(link: FakeLink) -> SessionState:
    plugin = ParrotPlugin()
    return SessionState(
        session_id="s1",
        settings=plugin.default_settings(),
        runtime_config={"pitch_semitones": 0.0, "silence_ms": None},
        link=link,
        epoch=1,
        resume_token="tok",
        plugin=plugin,
        capabilities=plugin.capabilities(max_sessions=4),
        config=RunnerConfig(coalesce_acks=False),
        placer=_no_placer,
        clock=ManualClock(),
        issue_token=lambda: "fresh",
    )


def _events(s: SessionState) -> list[session_pb2.ServerEvent]:
    out = []
    while (ev := s.outbound.get_nowait()) is not None:
        out.append(ev)
    return out


def test_no_event_loop_needed() -> None:
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    s = _state(FakeLink())
    assert not s.closed and s.epoch == 1 and s.options_status is OptionsStatus.PENDING


def test_cancel_and_move_share_the_epoch_advance() -> None:
    link = FakeLink()
    s = _state(link)
    s.cancel("barge_in")
    assert s.epoch == 2 and s.seq_status is SeqStatus.RESTART_ALLOWED
    assert [a.fence.epoch for a in link.aborts] == [2]
    s._moved_to_epoch(5)
    assert s.epoch == 5 and s.seq_status is SeqStatus.RESTART_ALLOWED
    assert len(link.aborts) == 1  # a move tells the client, not the worker
    cancelled = [e.audio_cancelled for e in _events(s) if e.WhichOneof("event") == "audio_cancelled"]
    assert [(c.cancelled_epoch, c.epoch, c.reason) for c in cancelled] == [
        (1, 2, "barge_in"),
        (2, 5, "worker_moved"),
    ]


def test_options_go_once_until_pending_again() -> None:
    s = _state(FakeLink())
    assert s._take_options() is not None
    assert s._take_options() is None and s.options_status is OptionsStatus.CURRENT
    s.apply_runtime({"pitch_semitones": 2.0, "silence_ms": None})
    assert s.options_status is OptionsStatus.PENDING
    assert s._take_options() is not None


@pytest.mark.parametrize("reason", list(CloseReason))
def test_close_reasons_on_the_wire(reason: CloseReason) -> None:
    link = FakeLink()
    s = _state(link)
    s._close(reason)
    assert s.closed and s.close_reason is reason and s.link is None
    assert [r.closed for r in link.releases] == [reason in ENDED_FOR_GOOD]
    if reason is not CloseReason.SLOW_CONSUMER:  # a slow consumer's backlog is dropped
        closed = [e.closed.reason for e in _events(s) if e.WhichOneof("event") == "closed"]
        assert closed == [reason.value]
