"""A session of a plugin served in stages (``session_service.plugins.cascade``) in process, with a
fake link per stage: where each stage's worker is placed, what each one is handed and when (the
transcript, the reply's text sentence by sentence, CLEAR and RESPOND once per reply and worker),
what of their output reaches the client, a cancel that reaches every stage, a stage's worker lost
mid-reply and its part redone (no text handed on twice, no audio heard twice), a stage that cannot
be placed, a stage's error, concurrent turns, the close."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from duplex.errors import ErrorCode, UnavailableError
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.api.cli import config_from_args
from session_service.api.server import SessionServer, later_stages
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import PluginLoadError, check_worker, split_sentences, validate_plugin
from session_service.plugins.cascade import CascadePlugin
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.runner import RunnerDeps, SessionRunner, WorkerHandle
from session_service.workers.step_routing import Router, SessionRegistry
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain, sample

SID = "sess_staged"
FRAME = b"\x01\x00" * 512  # one worker frame: 32 ms of 16 kHz s16le
CLEAR = worker_pb2.SUBMISSION_KIND_CLEAR
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
TEXT = worker_pb2.SUBMISSION_KIND_TEXT
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
CANCELLED = session_pb2.RESPONSE_STATUS_CANCELLED
FAILED = session_pb2.RESPONSE_STATUS_FAILED


class Placer:
    """Places the session on the next of ``links`` (and remembers who asked)."""

    def __init__(self, *links: FakeLink) -> None:
        self.links = list(links)
        self.asked: list[tuple[int, bool]] = []

    async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        self.asked.append((epoch, takeover))
        if not self.links:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "no healthy worker")
        return self.links.pop(0), epoch


@dataclasses.dataclass
class Stack:
    runner: SessionRunner
    asr: FakeLink
    responder: Placer
    tts: Placer


async def staged(
    *,
    responders: Sequence[FakeLink] = (),
    ttss: Sequence[FakeLink] = (),
    runtime: dict[str, object] | None = None,
    asrs: Sequence[FakeLink] = (),
) -> tuple[SessionRunner, FakeLink]:
    plugin = CascadePlugin()
    caps = plugin.capabilities(max_sessions=4)
    asr = FakeLink()
    r = SessionRunner(
        session_id=SID,
        settings=plugin.default_settings(),
        runtime_config=runtime or {},
        link=asr,
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=caps,
            config=RunnerConfig(coalesce_acks=False),
            placer=Placer(*asrs),
            stage_placers={"responder": Placer(*responders), "tts": Placer(*ttss)},
            clock=ManualClock(),
        ),
    )
    r.start()
    await settle()
    return r, asr


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


async def close(r: SessionRunner) -> None:
    r.close("test")  # type: ignore[arg-type]
    await r.wait_closed()


def kinds(events: Sequence[session_pb2.ServerEvent]) -> list[str]:
    return [e.WhichOneof("event") or "" for e in events]


def news(epoch: int, turn: int, **kw: object) -> worker_pb2.RequestUpdate:
    return worker_pb2.RequestUpdate(request_id=SID, fence=Fence(SID, epoch, turn).to_proto(), **kw)  # type: ignore[arg-type]


def turn_end(r: SessionRunner, transcript: str, epoch: int = 1, turn: int = 0) -> None:
    """The ASR stage ends the user's turn (its transcript on the same update)."""
    r.on_output(
        None, None, [news(epoch, turn, turn_ended=True, committed_samples=16000, user_transcript=transcript)]
    )


def words(r: SessionRunner, link: FakeLink, epoch: int, turn: int, *pieces: str, done: bool = False) -> None:
    """The responder writes its reply, a piece per step (the last one ``done``)."""
    for i, piece in enumerate(pieces):
        last = done and i == len(pieces) - 1
        r.on_stage_output(link, None, None, [news(epoch, turn, text=piece, response_finished=last)])
    if done and not pieces:
        r.on_stage_output(link, None, None, [news(epoch, turn, response_finished=True)])


def speak(
    r: SessionRunner, link: FakeLink, epoch: int, turn: int, *updates: worker_pb2.RequestUpdate
) -> None:
    """A step of the TTS stage: a frame of the reply's audio."""
    r.on_stage_output(
        link, Fence(SID, epoch, turn).to_proto(), common_pb2.AudioPayload(pcm=FRAME), list(updates)
    )


def texts(link: FakeLink) -> list[tuple[str, bool]]:
    return [(s.text, s.text_final) for s in link.subs if s.kind == TEXT]


def test_sentences_are_cut_where_they_end() -> None:
    assert split_sentences("You said: hello. What", final=False) == (["You said: hello."], "What")
    assert split_sentences("Really?! Yes. ", final=False) == (["Really?!", "Yes."], "")
    assert split_sentences('He said "stop." Then', final=False) == (['He said "stop."'], "Then")
    assert split_sentences("no end yet", final=False) == ([], "no end yet")
    assert split_sentences("the end", final=True) == (["the end"], "")
    assert split_sentences("  ", final=True) == ([], "")


def test_a_plugin_in_stages_is_checked_when_it_loads() -> None:
    plugin = CascadePlugin()
    validate_plugin(plugin)  # the cascade itself is sound
    bad = CascadePlugin()
    bad.sampling_defaults = (None,)
    with pytest.raises(PluginLoadError, match="one per stage"):
        validate_plugin(bad)
    first_replies = CascadePlugin()
    first_replies.stages = (dataclasses.replace(plugin.stages[0], responds=True), *plugin.stages[1:])
    with pytest.raises(PluginLoadError, match="first stage"):
        validate_plugin(first_replies)
    text_last = CascadePlugin()
    text_last.stages = plugin.stages[:2]
    text_last.sampling_defaults = (None, None)
    with pytest.raises(PluginLoadError, match="last stage"):
        validate_plugin(text_last)
    twins = CascadePlugin()
    twins.stages = (
        plugin.stages[0],
        plugin.stages[1],
        dataclasses.replace(plugin.stages[2], name="responder"),
    )
    with pytest.raises(PluginLoadError, match="unique"):
        validate_plugin(twins)


def latencies() -> dict[str, float]:
    return {
        stage: sample("duplex_session_stage_latency_seconds_count", {"stage": stage})
        for stage in ("responder", "tts")
    }


async def test_a_reply_goes_through_every_stage_and_only_the_last_one_is_heard() -> None:
    responder, tts = FakeLink(), FakeLink()
    r, asr = await staged(responders=[responder], ttss=[tts])
    before = latencies()
    try:
        # Placed at the start, each from its own pool, fenced under the session's epoch.
        assert r.holds(responder) and r.holds(tts) and r.holds(asr)
        # The user's words as they are heard, then the turn's end with its transcript.
        r.on_output(None, None, [news(1, 0, user_text="please")])
        r.on_output(None, None, [news(1, 0, user_text=" call")])
        turn_end(r, "please call my mother")
        evs = drain(r)
        assert kinds(evs) == [
            "transcript_delta",
            "transcript_delta",
            "committed",
            "input_transcribed",
            "response_started",
        ]
        assert [(e.transcript_delta.role, e.transcript_delta.text) for e in evs[:2]] == [
            ("user", "please"),
            ("user", " call"),
        ]
        assert (
            evs[3].input_transcribed.turn_id == 1
            and evs[3].input_transcribed.transcript == "please call my mother"
        )
        # The responder gets the transcript; the TTS stage nothing yet (no sentence is written).
        assert responder.kinds() == [CLEAR, RESPOND, TEXT] and texts(responder) == [
            ("please call my mother", True)
        ]
        assert all(s.fence.epoch == 1 and s.fence.turn_id == 1 for s in responder.subs)
        assert tts.subs == []
        words(r, responder, 1, 1, "You", " said:", " please", " call", " my", " mother.")
        assert tts.subs == []  # the sentence may go on ("mother.com")
        words(r, responder, 1, 1, " What")
        assert tts.kinds() == [CLEAR, RESPOND, TEXT] and texts(tts) == [
            ("You said: please call my mother.", False)
        ]
        words(r, responder, 1, 1, " else?", done=True)
        assert texts(tts)[-1] == ("What else?", True)
        # The responder's text is not the client's (the TTS stage's is, with its audio).
        assert drain(r) == []
        speak(r, tts, 1, 1, news(1, 1, text="You said: please call my mother.", response_started=True))
        speak(r, tts, 1, 1)
        speak(r, tts, 1, 1, news(1, 1, text="What else?"))
        speak(r, tts, 1, 1, news(1, 1, response_finished=True))
        evs = drain(r)
        assert kinds(evs) == [
            "transcript_delta",
            "audio_delta",
            "audio_delta",
            "transcript_delta",
            "audio_delta",
            "audio_delta",
            "response_done",
        ]
        assert {e.transcript_delta.role for e in evs if e.HasField("transcript_delta")} == {"assistant"}
        assert evs[-1].response_done.status == COMPLETED and evs[-1].response_done.audio_ms == 128
        # Each stage's share of the first audio was measured once.
        assert {k: v - before[k] for k, v in latencies().items()} == {"responder": 1, "tts": 1}
        # The responder's text after the reply is no one's.
        words(r, responder, 1, 1, " more", done=True)
        assert drain(r) == [] and texts(tts)[-1] == ("What else?", True)
    finally:
        await close(r)
    # The session's close releases it at every stage's worker.
    assert [len(link.releases) for link in (asr, responder, tts)] == [1, 1, 1]


async def test_a_barge_in_reaches_every_stage_and_nothing_of_the_reply_follows() -> None:
    responder, tts = FakeLink(), FakeLink()
    r, asr = await staged(responders=[responder], ttss=[tts])
    try:
        turn_end(r, "hello")
        words(r, responder, 1, 1, "You said: hello.", " What", " else?", done=True)
        speak(r, tts, 1, 1, news(1, 1, text="You said: hello.", response_started=True))
        drain(r)
        # The user speaks over the reply (heard by the ASR stage in input of turn 1).
        r.on_output(
            None, None, [news(1, 1, vad=[worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED)])]
        )
        evs = drain(r)
        assert kinds(evs) == ["speech_started", "audio_cancelled", "response_done"]
        assert evs[2].response_done.status == CANCELLED
        # Every stage's worker hears of the new epoch; the ASR keeps the input, the others drop it all.
        assert [(a.fence.epoch, a.keep_input) for a in asr.aborts] == [(2, True)]
        assert [(a.fence.epoch, a.keep_input) for a in responder.aborts] == [(2, False)]
        assert [(a.fence.epoch, a.keep_input) for a in tts.aborts] == [(2, False)]
        # What the stages still send of the cancelled reply is dropped.
        speak(r, tts, 1, 1, news(1, 1, text="What else?"))
        words(r, responder, 1, 1, " more")
        assert drain(r) == []
        # The next turn is answered under the new epoch.
        turn_end(r, "bye", epoch=2, turn=1)
        assert kinds(drain(r)) == ["speech_stopped", "committed", "input_transcribed", "response_started"]
        assert [(s.kind, s.fence.epoch, s.fence.turn_id) for s in responder.subs[-3:]] == [
            (CLEAR, 2, 2),
            (RESPOND, 2, 2),
            (TEXT, 2, 2),
        ]
    finally:
        await close(r)


async def test_a_lost_tts_worker_is_replaced_and_the_reply_goes_on_where_the_client_is() -> None:
    responder, tts, tts2 = FakeLink(), FakeLink(), FakeLink()
    r, _ = await staged(responders=[responder], ttss=[tts, tts2])
    try:
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two.", " Three", done=True)
        speak(r, tts, 1, 1, news(1, 1, text="One.", response_started=True))
        speak(r, tts, 1, 1)
        speak(r, tts, 1, 1, news(1, 1, text="Two."))
        heard = drain(r)
        r.on_worker_lost(tts)
        await settle()
        # Placed again; the new worker gets all of the reply's text, and leaves out what was heard.
        assert not r.holds(tts) and r.holds(tts2)
        assert len(tts.releases) == 1  # what the lost one holds goes when it is back
        assert tts2.kinds()[:2] == [CLEAR, RESPOND]
        assert dict(tts2.subs[0].params) == {"voice": "en-us", "wpm": 160.0, "skip_samples": 3.0 * 512}
        assert texts(tts2) == [("One.", False), ("Two.", False), ("Three", True)]
        # The old worker's output, should it come back, is not the session's.
        speak(r, tts, 1, 1, news(1, 1, text="Two."))
        speak(r, tts2, 1, 1, news(1, 1, response_started=True))
        speak(r, tts2, 1, 1, news(1, 1, text="Three", response_finished=True))
        evs = drain(r)
        assert kinds(evs) == ["audio_delta", "transcript_delta", "audio_delta", "response_done"]
        done = evs[-1].response_done
        assert done.status == COMPLETED and done.audio_ms == 5 * 32
        assert len([e for e in heard + evs if e.HasField("audio_delta")]) == 5
    finally:
        await close(r)


async def test_a_lost_asr_worker_is_replaced_and_the_reply_on_the_later_stages_goes_on() -> None:
    responder, tts, asr2 = FakeLink(), FakeLink(), FakeLink()
    r, asr = await staged(responders=[responder], ttss=[tts], asrs=[asr2])
    try:
        await r.post(session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=1, pcm=FRAME)))
        await settle()
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two.", done=True)
        speak(r, tts, 1, 1, news(1, 1, text="One.", response_started=True))
        drain(r)
        r.on_worker_lost(asr)  # the first stage's worker: the session's own
        await settle()
        # Placed again, its kept input replayed there; the reply is the later stages' and goes on.
        assert r.link is asr2 and asr2.kinds()[0] == CLEAR
        assert r.response is not None
        speak(r, tts, 1, 1, news(1, 1, text="Two.", response_finished=True))
        evs = drain(r)
        assert kinds(evs) == ["transcript_delta", "audio_delta", "response_done"]
        assert evs[-1].response_done.status == COMPLETED
        assert responder.aborts == [] and tts.aborts == []
    finally:
        await close(r)


async def test_a_lost_responder_runs_again_and_what_it_said_goes_on_once() -> None:
    responder, responder2, tts = FakeLink(), FakeLink(), FakeLink()
    r, _ = await staged(responders=[responder, responder2], ttss=[tts])
    try:
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two")
        assert texts(tts) == [("One.", False)]
        r.on_worker_lost(responder)
        await settle()
        assert responder2.kinds() == [CLEAR, RESPOND, TEXT] and texts(responder2) == [("hello", True)]
        # The same words again: checked, not handed on twice; then on as before.
        words(r, responder2, 1, 1, "One.", " Two.", " Three.", done=True)
        assert texts(tts) == [("One.", False), ("Two.", False), ("Three.", True)]
        assert r.response is not None
    finally:
        await close(r)


async def test_a_responder_that_words_it_otherwise_after_a_failover_fails_the_reply() -> None:
    responder, responder2, tts = FakeLink(), FakeLink(), FakeLink()
    r, _ = await staged(responders=[responder, responder2], ttss=[tts])
    try:
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two")
        drain(r)
        r.on_worker_lost(responder)
        await settle()
        words(r, responder2, 1, 1, "Uno.")
        evs = drain(r)
        assert kinds(evs) == ["response_done", "error"]
        assert evs[0].response_done.status == FAILED
        assert evs[0].response_done.reason == evs[1].error.code == ErrorCode.WORKER_UNAVAILABLE.value
        assert texts(tts) == [("One.", False)]  # nothing of the other wording went on
    finally:
        await close(r)


async def test_no_worker_for_a_stage_fails_the_reply_clearly() -> None:
    responder = FakeLink()
    r, _ = await staged(responders=[responder], ttss=[])  # the TTS pool has no worker
    try:
        assert isinstance(r._clock, ManualClock)
        await r._clock.advance(2.0, step=0.1)  # a few tries, then it gives up
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["error"] and evs[0].error.code == ErrorCode.WORKER_UNAVAILABLE.value
        assert "tts" in evs[0].error.message
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two.", done=True)
        await r._clock.advance(2.0, step=0.1)  # the TTS stage is needed now: it tries again
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["committed", "input_transcribed", "response_started", "response_done", "error"]
        assert evs[3].response_done.status == FAILED
        assert evs[3].response_done.reason == ErrorCode.WORKER_UNAVAILABLE.value
        assert not r.closed  # the session goes on
    finally:
        await close(r)


async def test_a_stage_error_fails_the_reply_with_its_code() -> None:
    responder, tts = FakeLink(), FakeLink()
    r, _ = await staged(responders=[responder], ttss=[tts])
    try:
        turn_end(r, "hello")
        drain(r)
        error = worker_pb2.WorkerError(code="model_error", message="the responder fell over")
        r.on_stage_output(responder, None, None, [news(1, 1, error=error)])
        evs = drain(r)
        assert kinds(evs) == ["response_done", "error"]
        assert evs[0].response_done.status == FAILED and evs[1].error.code == "model_error"
        assert "responder" in evs[1].error.message
    finally:
        await close(r)


async def test_overlapping_turns_let_the_last_stage_drain_under_the_next_turn() -> None:
    responder, tts = FakeLink(), FakeLink()
    r, asr = await staged(responders=[responder], ttss=[tts], runtime={"overlap_turns": True})
    speech = worker_pb2.VadEvent(kind=worker_pb2.VadEvent.KIND_SPEECH_STARTED)
    try:
        turn_end(r, "hello")
        words(r, responder, 1, 1, "One.", " Two")
        drain(r)
        # While the responder still writes, speech barges in as on any model... (checked in the
        # barge-in test); once its text is all written, the TTS stage drains under the next turn.
        words(r, responder, 1, 1, ".", done=True)
        speak(r, tts, 1, 1, news(1, 1, text="One.", response_started=True))
        r.on_output(None, None, [news(1, 1, vad=[speech])])
        turn_end(r, "and then", turn=1)
        evs = drain(r)
        assert kinds(evs) == [
            "transcript_delta",
            "audio_delta",
            "speech_started",
            "speech_stopped",
            "committed",
            "input_transcribed",
        ]
        assert asr.aborts == [] and tts.aborts == []
        speak(r, tts, 1, 1, news(1, 1, text="Two.", response_finished=True))
        evs = drain(r)
        # The reply ends whole; the turn heard meanwhile is answered next, with its own transcript.
        assert kinds(evs) == ["transcript_delta", "audio_delta", "response_done", "response_started"]
        assert evs[2].response_done.status == COMPLETED and evs[3].response_started.turn_id == 2
        assert texts(responder)[-1] == ("and then", True)
    finally:
        await close(r)


async def test_per_response_options_are_refused_for_a_model_in_stages() -> None:
    r, _ = await staged(responders=[FakeLink()], ttss=[FakeLink()])
    try:
        r.settings = dataclasses.replace(
            r.settings, turn_detection=dataclasses.replace(r.settings.turn_detection, auto_respond=False)
        )
        turn_end(r, "hello")
        drain(r)
        rc = session_pb2.ClientEvent(event_id="rc", response_create=session_pb2.ResponseCreate())
        rc.response_create.extra_body.update({"wpm": 200})
        await r.post(rc)
        await settle()
        evs = drain(r)
        assert kinds(evs) == ["error"] and evs[0].error.code == ErrorCode.UNSUPPORTED_BY_MODEL.value
        await r.post(session_pb2.ClientEvent(event_id="rc2", response_create=session_pb2.ResponseCreate()))
        await settle()
        assert kinds(drain(r)) == ["response_started"]
    finally:
        await close(r)


# ---- the pools of a plugin served in stages -----------------------------------------------------


def test_the_command_line_takes_each_later_stages_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUPLEX_RESUME_SECRETS", raising=False)
    cfg = config_from_args(
        [
            *("--plugin", "session_service.plugins.cascade:CascadePlugin", "--workers", "a0:1,a1:1"),
            *("--stage-workers", "responder=r0:1", "--stage-workers", "tts=dns:///tts.example:50052"),
        ]
    )
    assert cfg.workers == ("a0:1", "a1:1")
    assert dict(cfg.stage_workers) == {"responder": ("r0:1",), "tts": ("dns:///tts.example:50052",)}
    for bad in (
        ["--stage-workers", "tts"],  # no workers
        ["--stage-workers", "=w:1"],  # no stage
        ["--stage-workers", "tts=w:1", "--stage-workers", "tts=w:2"],  # twice
        ["--stage-workers", "tts=dns:///x:1,w:2"],  # a DNS target and a list
    ):
        with pytest.raises(SystemExit):
            config_from_args(["--workers", "w0:1", *bad])


async def test_a_server_has_a_pool_per_later_stage_and_refuses_a_missing_or_unknown_one() -> None:
    plugin = CascadePlugin()
    base = ServiceConfig(plugin="cascade", workers=("a0:1",), metrics_port=-1)
    with pytest.raises(PluginLoadError, match="--stage-workers responder=HOST:PORT, --stage-workers tts"):
        later_stages(base, plugin)
    with pytest.raises(PluginLoadError, match="not a later stage"):
        later_stages(dataclasses.replace(base, stage_workers=(("talker", ("t:1",)),)), ParrotPlugin())
    cfg = dataclasses.replace(
        base, stage_workers=(("responder", ("r0:1", "r1:1")), ("tts", ("dns:///tts.example:50052",)))
    )
    server = SessionServer(cfg, plugin)
    assert set(server.stage_pools) == {"responder", "tts"}
    assert set(server.stage_pools["responder"].links) == {"r0:1", "r1:1"}
    assert server.stage_pools["tts"].links == {}  # filled by its DNS discovery once started
    assert [pool for pool, _ in server._discoveries] == [server.stage_pools["tts"]]
    link = server.stage_pools["responder"].links["r0:1"]
    assert link.stage is not None and link.stage.model_id == "responder"


def test_a_stage_worker_of_another_model_is_refused() -> None:
    plugin = CascadePlugin()
    tts = plugin.stages[2]
    desc = worker_pb2.WorkerDescription(model_id="tts", frame_samples=512)
    check_worker(plugin, desc, tts)
    with pytest.raises(PluginLoadError, match="stage 'tts' needs 'tts'") as err:
        check_worker(plugin, worker_pb2.WorkerDescription(model_id="parrot", frame_samples=512), tts)
    assert err.value.code == ErrorCode.MODEL_MISMATCH.value


async def test_a_stage_worker_that_lists_the_session_keeps_it_and_one_it_left_releases_it() -> None:
    class Listing(FakeLink):
        def attaching(self, session_id: str) -> bool:
            return False

    responder, tts, old_tts = Listing(), Listing(), Listing()
    r, _ = await staged(responders=[responder], ttss=[tts])
    registry = SessionRegistry()
    registry.add(r)
    router = Router(registry)
    try:
        held = [Fence(SID, 1, 0).to_proto()]
        # A new Run stream of a stage's worker lists what it holds for this replica.
        assert router.reconcile(tts, held) == [] and tts.releases == []
        assert router.reconcile(old_tts, held) == [SID] and len(old_tts.releases) == 1
        # Its output is the session's; a worker the session left is not heard.
        speak(r, old_tts, 1, 1)
        assert drain(r) == []
    finally:
        await close(r)
