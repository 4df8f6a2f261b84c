"""Session progress in resume tokens (claim ``g``), and what a resumed caller is told.

A token records how far its session had got: the highest turn id, how many server events were
numbered, the last response and whether it had ended. ``response_started`` and
``response_done`` carry fresh tokens. A replica that takes the session over continues turn ids
and event numbering (raised to the client's ``last_event_id``, bounded), tells the caller in
``opened.last_response`` what became of the last response (INTERRUPTED when the token says it
had not ended) and restarts an interrupted response for its turn. A resume onto the live runner
tells its own last response. SessionManager level, fake worker links, no processes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from duplex.audio import PCM16K_MONO
from duplex.errors import DuplexError, ErrorCode
from duplex.fence import Fence
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.manager import MAX_EVENTS_AHEAD, SessionManager
from session_service.session.runner import SessionRunner, WorkerHandle
from session_service.trust import resume_tokens as resume
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import ResumeClaims, ResumeKeys, SessionProgress
from session_service.workers.step_routing import SessionRegistry
from tests.fakes import ManualClock
from tests.session_helpers import FakeLink, drain

SECRET = ResumeKeys.single(b"progress-resume-secret-of-32-byt", kid="k1")
T0 = 1_700_000_000.0
FRAME = b"\x10\x00" * 512
RESPOND = worker_pb2.SUBMISSION_KIND_RESPOND
UNSPECIFIED = session_pb2.RESPONSE_STATUS_UNSPECIFIED
COMPLETED = session_pb2.RESPONSE_STATUS_COMPLETED
INTERRUPTED = session_pb2.RESPONSE_STATUS_INTERRUPTED


class FakePlacer:
    """Places every session on one link; a takeover is granted a higher epoch."""

    def __init__(self) -> None:
        self.link = FakeLink()
        self.calls: list[tuple[str, int, bool]] = []

    async def __call__(
        self, session_id: str, epoch: int, takeover: bool, *, prefer: str | None = None
    ) -> tuple[WorkerHandle, int]:
        self.calls.append((session_id, epoch, takeover))
        return self.link, epoch + 1 if takeover else epoch


def replica(**runner: Any) -> tuple[SessionManager, FakePlacer]:
    placer = FakePlacer()
    cfg = ServiceConfig(
        plugin="parrot",
        workers=("fake:1",),
        resume_keys=SECRET,
        max_sessions=8,
        runner=RunnerConfig(**runner),
    )
    manager = SessionManager(
        plugin=ParrotPlugin(),
        config=cfg,
        registry=SessionRegistry(),
        placer=placer,
        wall_clock=lambda: T0,
        clock=ManualClock(),
    )
    return manager, placer


def open_msg() -> session_pb2.SessionOpen:
    cfg = session_pb2.SessionConfig(
        input_format=PCM16K_MONO.to_proto(),
        turn_detection=session_pb2.TurnDetection(auto_respond=False, barge_in=True),
    )
    return session_pb2.SessionOpen(model="parrot", config=cfg)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def kinds(evs: list[session_pb2.ServerEvent]) -> list[str]:
    return [e.WhichOneof("event") or "" for e in evs]


def number(ev: session_pb2.ServerEvent) -> int:
    prefix, _, n = ev.event_id.partition("_")
    assert prefix == "se", ev.event_id
    return int(n)


def claims_of(token: str, session_id: str) -> ResumeClaims:
    return resume.decode(SECRET, token, session_id=session_id, now=T0)


async def post(r: SessionRunner, **event: Any) -> None:
    await r.post(session_pb2.ClientEvent(**event))


async def turn(r: SessionRunner, seq: int) -> session_pb2.ResponseStarted:
    """An utterance (one frame), its commit and a response to it; returns the response."""
    await post(r, append=session_pb2.InputAudioAppend(seq=seq, pcm=FRAME))
    await post(r, commit=session_pb2.InputAudioCommit())
    await post(r, response_create=session_pb2.ResponseCreate())
    await settle()
    evs = drain(r)
    assert kinds(evs)[-3:] == ["input_ack", "committed", "response_started"], kinds(evs)
    return evs[-1].response_started


def audio(r: SessionRunner, frames: int = 3) -> list[session_pb2.ServerEvent]:
    """``frames`` reply frames of the active response from its worker; returns the events."""
    resp = r.response
    assert resp is not None
    fence = Fence(r.session_id, resp.epoch, resp.turn_id).to_proto()
    for _ in range(frames):
        r.on_output(fence, common_pb2.AudioPayload(pcm=FRAME), [])
    evs = drain(r)
    assert kinds(evs) == ["audio_delta"] * frames
    return evs


def finish(r: SessionRunner) -> session_pb2.ResponseDone:
    resp = r.response
    assert resp is not None
    upd = worker_pb2.RequestUpdate(
        request_id=r.session_id,
        fence=Fence(r.session_id, resp.epoch, resp.turn_id).to_proto(),
        response_finished=True,
    )
    r.on_output(None, None, [upd])
    evs = drain(r)
    assert kinds(evs) == ["response_done"]
    return evs[0].response_done


async def close_all(*managers: SessionManager) -> None:
    for m in managers:
        await m.drain(0)


def resume_msg(session_id: str, token: str, last_event_id: str = "") -> session_pb2.SessionResume:
    return session_pb2.SessionResume(session_id=session_id, resume_token=token, last_event_id=last_event_id)


# ---- the claim -----------------------------------------------------------------------------------


def test_progress_round_trips_and_a_fresh_session_carries_none() -> None:
    progress = SessionProgress(turn_id=3, events=4242, last_response_id="resp_abc", last_response_status=2)
    claims = ResumeClaims(session_id="s", issued_at=int(T0), principal="alice", progress=progress)
    assert claims_of(resume.issue(SECRET, claims), "s").progress == progress
    bare = ResumeClaims(session_id="s", issued_at=int(T0), principal="alice")
    token = resume.issue(SECRET, bare)
    assert "g" not in json.loads(SECRET.open(token))
    assert claims_of(token, "s").progress == SessionProgress()
    # The event count alone does not make another session state (the client names its last
    # event on resume); anything else in the progress does.
    assert claims.same_state(
        ResumeClaims(
            session_id="s",
            issued_at=int(T0) + 5,
            principal="alice",
            progress=SessionProgress(3, 1, "resp_abc", 2),
        )
    )
    for other in (SessionProgress(4, 4242, "resp_abc", 2), SessionProgress(3, 4242, "resp_abc", 1)):
        assert not claims.same_state(
            ResumeClaims(session_id="s", issued_at=int(T0), principal="alice", progress=other)
        )


@pytest.mark.parametrize(
    "g",
    [
        [1, 2, "resp"],
        [1, 2, "resp", 0, 0],
        {"turn": 1},
        None,
        "1,2,resp,0",
        ["1", 2, "resp", 0],
        [1, 2.5, "resp", 0],
        [1, 2, 7, 0],
        [1, 2, "resp", "0"],
        [True, 2, "resp", 0],
        [1, 2, "resp", False],
        [-1, 2, "resp", 0],
        [1, -2, "resp", 0],
        [1, 2, "resp", -1],
    ],
)
def test_an_unreadable_progress_claim_is_refused(g: object) -> None:
    body = {"sid": "s", "iat": int(T0), "p": "alice", "g": g}
    token = SECRET.seal(json.dumps(body).encode())
    with pytest.raises(resume.InvalidResumeTokenError):
        resume.decode(SECRET, token, session_id="s", now=T0)


# ---- tokens that follow the session --------------------------------------------------------------


async def test_response_events_carry_tokens_that_know_the_response() -> None:
    a, _ = replica()
    r = await a.open(open_msg())
    assert kinds(drain(r)) == ["opened"]
    assert claims_of(r.resume_token, r.session_id).progress == SessionProgress()
    started = await turn(r, 1)
    g = claims_of(started.resume_token, r.session_id).progress
    assert (g.turn_id, g.last_response_id, g.last_response_status) == (1, started.response_id, UNSPECIFIED)
    assert g.events >= 3  # opened, the ack and committed were numbered before it
    audio(r)
    done = finish(r)
    assert done.status == COMPLETED and done.resume_token not in ("", started.resume_token)
    g = claims_of(done.resume_token, r.session_id).progress
    assert (g.turn_id, g.last_response_id, g.last_response_status) == (1, started.response_id, COMPLETED)
    assert r.resume_token == done.resume_token  # the session's current token (go_away sends it)
    await close_all(a)


# ---- a takeover on another replica ---------------------------------------------------------------


async def interrupted_session(a: SessionManager) -> tuple[SessionRunner, session_pb2.ResponseStarted, int]:
    """A session on ``a`` two turns in, its second response playing; returns the runner, the
    response's ``response_started`` and the number of the last event the client got."""
    r = await a.open(open_msg())
    drain(r)
    await turn(r, 1)
    audio(r)
    finish(r)
    started = await turn(r, 2)
    assert started.turn_id == 2
    last = number(audio(r, 4)[-1])
    return r, started, last


async def test_a_takeover_continues_numbering_and_restarts_the_interrupted_response() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r, started, last = await interrupted_session(a)
    token_events = claims_of(started.resume_token, r.session_id).progress.events
    assert token_events < last  # the lost replica numbered events after it issued the token
    # Replica a is lost (its runner never says anything more); the client resumes on b with the
    # token of response_started and the last event it received.
    taken = await b.resume(resume_msg(r.session_id, started.resume_token, f"se_{last}"))
    assert placer_b.calls == [(r.session_id, r.epoch, True)]
    evs = drain(taken)
    assert kinds(evs) == ["opened"]
    opened = evs[0].opened
    assert number(evs[0]) == last + 1
    assert opened.turn_id == 2 and opened.capabilities.turn_failover
    assert (opened.last_response.response_id, opened.last_response.turn_id, opened.last_response.status) == (
        started.response_id,
        2,
        INTERRUPTED,
    )
    # The interrupted response restarts for its turn on the session's worker.
    await settle()
    evs = drain(taken)
    assert kinds(evs) == ["response_started"]
    again = evs[0].response_started
    assert number(evs[0]) == last + 2
    assert again.turn_id == 2 and again.response_id != started.response_id
    assert again.epoch == taken.epoch == r.epoch + 1
    responds = [s for s in placer_b.link.subs if s.kind == RESPOND]
    assert [(s.fence.epoch, s.fence.turn_id) for s in responds] == [(taken.epoch, 2)]
    # The session's options go with the first submission on the new replica's worker.
    assert placer_b.link.subs[0].HasField("params")
    # Its token now knows the restarted response; the next turn is turn 3.
    g = claims_of(again.resume_token, r.session_id).progress
    assert (g.turn_id, g.last_response_id, g.last_response_status) == (2, again.response_id, UNSPECIFIED)
    finish(taken)
    nxt = await turn(taken, 1)
    assert nxt.turn_id == 3
    await close_all(a, b)


async def test_a_takeover_after_the_response_ended_restarts_nothing() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r, started, last = await interrupted_session(a)
    done = finish(r)
    taken = await b.resume(resume_msg(r.session_id, done.resume_token, f"se_{last + 1}"))
    await settle()
    evs = drain(taken)
    assert kinds(evs) == ["opened"]
    assert number(evs[0]) == last + 2
    lr = evs[0].opened.last_response
    assert (lr.response_id, lr.turn_id, lr.status) == (started.response_id, 2, COMPLETED)
    assert RESPOND not in placer_b.link.kinds() and taken.response is None
    await close_all(a, b)


async def test_without_turn_failover_the_caller_is_told_but_nothing_restarts() -> None:
    a, _ = replica(turn_failover=False)
    b, placer_b = replica(turn_failover=False)
    r, started, last = await interrupted_session(a)
    taken = await b.resume(resume_msg(r.session_id, started.resume_token, f"se_{last}"))
    await settle()
    evs = drain(taken)
    assert kinds(evs) == ["opened"]
    assert evs[0].opened.last_response.status == INTERRUPTED
    assert not evs[0].opened.capabilities.turn_failover
    assert RESPOND not in placer_b.link.kinds() and taken.response is None
    await close_all(a, b)


@pytest.mark.parametrize(
    "last_event_id",
    [
        "",
        "se_",
        "se_x",
        "ev_99",
        "SE_99",
        "se_-3",
        "se_+3",
        "se_1.5",
        "se_ 9",
        "se_1",  # below the token's count: the token's count holds
        "se_" + "9" * 21,
        "se_\u00b2",  # a Unicode digit: not a number int() takes
    ],
)
async def test_a_garbage_last_event_id_leaves_numbering_to_the_token(last_event_id: str) -> None:
    a, _ = replica()
    b, _ = replica()
    r, started, _ = await interrupted_session(a)
    token_events = claims_of(started.resume_token, r.session_id).progress.events
    taken = await b.resume(resume_msg(r.session_id, started.resume_token, last_event_id))
    evs = drain(taken)
    assert number(evs[0]) == token_events + 1, (last_event_id, evs[0].event_id)
    await close_all(a, b)


async def test_an_absurd_last_event_id_moves_numbering_a_bounded_way() -> None:
    a, _ = replica()
    b, _ = replica()
    r, started, _ = await interrupted_session(a)
    token_events = claims_of(started.resume_token, r.session_id).progress.events
    taken = await b.resume(resume_msg(r.session_id, started.resume_token, "se_" + "9" * 20))
    evs = drain(taken)
    assert number(evs[0]) == token_events + MAX_EVENTS_AHEAD + 1
    await close_all(a, b)


async def test_a_forged_or_foreign_token_takes_nothing_over() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r, started, last = await interrupted_session(a)
    # A token of this deployment's format, but sealed with another secret: its progress is
    # never read.
    forged = ResumeKeys.single(b"another-deployment-secret-of-32b", kid="k1").seal(
        json.dumps(
            {"sid": r.session_id, "iat": int(T0), "p": ANONYMOUS, "g": [99, 10**6, "resp_x", 0]}
        ).encode()
    )
    with pytest.raises(DuplexError) as err:
        await b.resume(resume_msg(r.session_id, forged, f"se_{last}"))
    assert err.value.code == ErrorCode.INVALID_RESUME_TOKEN
    assert placer_b.calls == [] and len(b) == 0
    assert started.response_id
    await close_all(a, b)


# ---- a resume onto the live runner ---------------------------------------------------------------


async def test_a_resume_onto_the_live_runner_tells_its_own_last_response() -> None:
    a, placer = replica()
    r, started, last = await interrupted_session(a)
    # The client names an event far ahead: the live runner's own numbering holds.
    again = await a.resume(resume_msg(r.session_id, started.resume_token, "se_900000"))
    assert again is r and len(placer.calls) == 1
    evs = drain(r)
    assert kinds(evs) == ["opened"] and number(evs[0]) == last + 1
    lr = evs[0].opened.last_response
    # Still running here: not ended, not interrupted; nothing restarts.
    assert (lr.response_id, lr.turn_id, lr.status) == (started.response_id, 2, UNSPECIFIED)
    assert evs[0].opened.turn_id == 2
    assert r.response is not None and r.response.response_id == started.response_id
    assert [s.kind for s in placer.link.subs].count(RESPOND) == 2
    finish(r)
    await a.resume(resume_msg(r.session_id, r.resume_token))
    evs = drain(r)
    lr = evs[0].opened.last_response
    assert (lr.response_id, lr.status) == (started.response_id, COMPLETED)
    await close_all(a)
