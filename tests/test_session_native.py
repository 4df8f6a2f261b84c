"""A model-native session (``session_service.plugins.moshi``) in process, with a fake link: the
policy ``opened`` states, the turn events it refuses, the model's own speech spans as responses,
silence whenever the client falls behind, what ``response_cancel`` means, and a lost worker that
resets the model's context (nothing replayed, the session goes on elsewhere)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from duplex.errors import ErrorCode, UnavailableError
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.plugins.moshi import MoshiPlugin
from session_service.session.runner import RunnerDeps, SessionRunner, WorkerHandle
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain

SID = "sess_native"
FRAME = b"\x01\x00" * 1920  # one worker frame: 80 ms of 24 kHz s16le
APPEND = worker_pb2.SUBMISSION_KIND_APPEND
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
FAILED = session_pb2.RESPONSE_STATUS_FAILED


class Placer:
    """Places the session on the next of ``links``."""

    def __init__(self, *links: FakeLink) -> None:
        self.links = list(links)

    async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        if not self.links:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "no healthy worker")
        return self.links.pop(0), epoch


def native_runner(
    link: FakeLink, placer: Placer | None = None, clock: ManualClock | None = None
) -> SessionRunner:
    plugin = MoshiPlugin()
    # As the session manager completes them.
    caps = dataclasses.replace(plugin.capabilities(max_sessions=4), model_native=True, frame_period_ms=80)
    r = SessionRunner(
        session_id=SID,
        settings=plugin.default_settings(),
        runtime_config={},
        link=link,
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=caps,
            config=RunnerConfig(coalesce_acks=False),
            placer=placer or Placer(),
            clock=clock or ManualClock(),
        ),
    )
    r.start()
    return r


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def kinds(events: Sequence[session_pb2.ServerEvent]) -> list[str]:
    return [e.WhichOneof("event") or "" for e in events]


def append(seq: int) -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(
        event_id=f"a{seq}", append=session_pb2.InputAudioAppend(seq=seq, pcm=FRAME)
    )


def news(epoch: int, turn: int, **kw: object) -> worker_pb2.RequestUpdate:
    return worker_pb2.RequestUpdate(request_id=SID, fence=Fence(SID, epoch, turn).to_proto(), **kw)  # type: ignore[arg-type]


def speak(r: SessionRunner, epoch: int, turn: int, *updates: worker_pb2.RequestUpdate) -> None:
    """A step of the model's: a frame of its audio (under the fence of the input that clocked it)."""
    r.on_output(Fence(SID, epoch, turn).to_proto(), common_pb2.AudioPayload(pcm=FRAME), list(updates))


async def test_opened_says_the_model_takes_turns_itself() -> None:
    r = native_runner(FakeLink())
    try:
        r.greet()
        caps = drain(r)[0].opened.capabilities
        assert caps.turn_policy == session_pb2.TURN_POLICY_MODEL_NATIVE
        assert caps.model_barge_in and caps.frame_period_ms == 80
        assert list(caps.modalities) == ["audio", "text"]
        assert not caps.turn_failover  # its state is the whole conversation
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_events_that_presume_turns_are_refused_and_the_session_goes_on() -> None:
    link = FakeLink()
    r = native_runner(link)
    try:
        for event_id, ev in (
            ("c", session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit())),
            ("x", session_pb2.ClientEvent(clear=session_pb2.InputAudioClear())),
            ("r", session_pb2.ClientEvent(response_create=session_pb2.ResponseCreate())),
            ("b", session_pb2.ClientEvent(barge_in=session_pb2.BargeIn())),
        ):
            ev.event_id = event_id
            await r.post(ev)
        await r.post(append(1))
        await settle()
        evs = drain(r)
        errors = [(e.error.code, e.error.event_id) for e in evs if e.HasField("error")]
        assert errors == [(ErrorCode.UNSUPPORTED_BY_MODEL.value, i) for i in "cxrb"]
        assert "input_ack" in kinds(evs) and not r.closed
        assert [s.kind for s in link.subs] == [APPEND]  # nothing of them reached the worker
        assert link.aborts == []
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_each_speech_span_of_the_model_is_a_response() -> None:
    r = native_runner(FakeLink())
    try:
        # The model starts speaking; its frames carry the turn of the input that clocked them.
        speak(r, 1, 0, news(1, 0, response_started=True, text=" hello"))
        speak(r, 1, 0, news(1, 0, text=" there"))
        speak(r, 1, 3, news(1, 3, response_finished=True))
        evs = drain(r)
        assert kinds(evs) == [
            "response_started",
            "transcript_delta",
            "audio_delta",
            "transcript_delta",
            "audio_delta",
            "audio_delta",
            "response_done",
        ]
        first = evs[0].response_started
        assert first.turn_id == 1
        assert (
            "".join(e.transcript_delta.text for e in evs if e.HasField("transcript_delta")) == " hello there"
        )
        assert evs[-1].response_done.status == COMPLETED and evs[-1].response_done.audio_ms == 240
        # Audio between spans is no one's; the next span is the next response.
        speak(r, 1, 0)
        assert drain(r) == []
        speak(r, 1, 0, news(1, 0, response_started=True))
        evs = drain(r)
        assert kinds(evs) == ["response_started", "audio_delta"]
        assert evs[0].response_started.turn_id == 2
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_silence_goes_to_the_model_whenever_the_client_falls_behind() -> None:
    clock = ManualClock()
    link = FakeLink()
    r = native_runner(link, clock=clock)
    try:
        await clock.advance(1.0, step=0.02)
        await settle()
        silent = [s for s in link.subs if s.kind == APPEND]
        # About a frame per 80 ms once the client is 100 ms behind: no response needed.
        assert 9 <= len(silent) <= 12, len(silent)
        assert all(s.pcm == bytes(len(FRAME)) for s in silent)
        # A client that streams keeps it quiet.
        before = len(link.subs)
        for seq in range(1, 13):
            await r.post(append(seq))
            await clock.advance(0.08, step=0.02)
        await settle()
        fed = [s for s in link.subs[before:] if s.pcm == bytes(len(FRAME))]
        assert len(fed) <= 1
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_response_cancel_silences_the_span_until_the_model_falls_silent() -> None:
    link = FakeLink()
    r = native_runner(link)
    try:
        speak(r, 1, 0, news(1, 0, response_started=True))
        started = drain(r)[0].response_started
        await r.post(session_pb2.ClientEvent(response_cancel=session_pb2.ResponseCancel()))
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["audio_cancelled", "response_done"]
        assert (
            evs[1].response_done.status == CANCELLED
            and evs[1].response_done.response_id == started.response_id
        )
        # The worker mutes the span (the abort keeps the input flowing to the model).
        assert [(a.fence.epoch, a.keep_input) for a in link.aborts] == [(2, True)]
        speak(r, 1, 0, news(1, 0, text=" late"))  # of the epoch left: not heard
        assert drain(r) == []
        # Once it falls silent and speaks again, that is a new response.
        speak(r, 2, 0, news(2, 0, response_started=True))
        evs = drain(r)
        assert kinds(evs) == ["response_started", "audio_delta"] and evs[0].response_started.epoch == 2
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_a_lost_worker_resets_the_models_context_and_the_session_goes_on() -> None:
    old, new = FakeLink(), FakeLink()
    r = native_runner(old, Placer(new))
    try:
        await r.post(append(1))
        speak(r, 1, 0, news(1, 0, response_started=True))
        drain(r)
        old.healthy = False
        r.on_worker_lost(old)  # type: ignore[arg-type]
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["response_done", "context_reset"]
        assert evs[0].response_done.status == FAILED and not evs[0].response_done.restarting
        assert evs[0].response_done.reason == "worker_unavailable"
        assert evs[1].context_reset.reason == "worker_lost"
        # Moved on at once, nothing replayed there; the old worker is told to let the session go.
        assert r.link is new and new.subs == []
        assert [rel.request_id for rel in old.releases] == [SID]
        await r.post(append(2))
        await settle()
        assert [s.kind for s in new.subs] == [APPEND] and new.subs[0].pcm == FRAME
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()


async def test_an_append_in_flight_when_the_worker_is_lost_is_no_error() -> None:
    """The worker dies with an append's write in flight: its context (and that input) went with
    it, and the client is told so by ``context_reset``, not by an error for the append."""

    class Holding(FakeLink):
        def __init__(self) -> None:
            super().__init__()
            self.in_flight: list[asyncio.Future[None]] = []

        def submit(
            self, subs: Sequence[worker_pb2.Submission], *, prompt: bool = False
        ) -> asyncio.Future[None]:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.subs.extend(subs)
            self.in_flight.append(fut)
            return fut

    old, new = Holding(), FakeLink()
    r = native_runner(old, Placer(new))
    try:
        await r.post(append(1))
        await settle()
        assert len(old.in_flight) == 1 and not old.in_flight[0].done()
        # As the link loses its stream: the writes fail, then the sessions hear of the loss.
        old.healthy = False
        old.in_flight[0].set_exception(ConnectionError("gone"))
        r.on_worker_lost(old)  # type: ignore[arg-type]
        await settle()
        evs = drain(r)
        assert "error" not in kinds(evs) and "context_reset" in kinds(evs), kinds(evs)
        # The session goes on at the new worker.
        await r.post(append(2))
        await settle()
        assert r.link is new and [s.kind for s in new.subs] == [APPEND]
        assert "error" not in kinds(drain(r))
    finally:
        r.close("test")  # type: ignore[arg-type]
        await r.wait_closed()
