"""Resume tokens and resumes at the SessionManager level, with fake worker links (no processes).

A session taken over by another replica (the drain path) keeps its formats, turn detection,
instructions and extra_body, carried by the signed token; tampered, expired and foreign tokens
are refused with UNAUTHENTICATED/invalid_resume_token; concurrent resumes of one session yield
one runner; the token stays small.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat
from duplex.errors import DuplexError, ErrorCode
from duplex.v1 import session_pb2, worker_pb2
from session_service.config import ServiceConfig
from session_service.plugin import Capabilities, SessionSettings, TurnDetection
from session_service.plugins.parrot import ParrotPlugin
from session_service.session.manager import SessionManager
from session_service.session.outbound import Outbound
from session_service.session.runner import SessionRunner, WorkerHandle
from session_service.trust import resume_tokens as resume
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import ResumeKeys
from session_service.workers.step_routing import SessionRegistry
from tests.session_helpers import FakeLink
from tests.session_helpers import drain as events

SECRET_BYTES = b"shared-resume-secret-of-32-bytes"
SECRET = ResumeKeys.single(SECRET_BYTES, kid="k1")
T0 = 1_700_000_000.0
IN_FMT = PcmFormat(F32LE, 48000, 2)
OUT_FMT = PcmFormat(S16LE, 24000, 1)


class TextParrot(ParrotPlugin):
    """A parrot that also offers text, so the tokens' modalities are not just the default."""

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        return dataclasses.replace(
            super().capabilities(max_sessions=max_sessions), modalities=("audio", "text")
        )


class FakePlacer:
    """Places every session on one link; a takeover is granted a higher epoch."""

    def __init__(self, *, hold: asyncio.Event | None = None) -> None:
        self.link = FakeLink()
        self.calls: list[tuple[str, int, bool]] = []
        self.preferred: list[str | None] = []
        """The ``prefer`` of every call."""
        self.hold = hold

    async def __call__(
        self, session_id: str, epoch: int, takeover: bool, *, prefer: str | None = None
    ) -> tuple[WorkerHandle, int]:
        self.calls.append((session_id, epoch, takeover))
        self.preferred.append(prefer)
        if self.hold is not None:
            await self.hold.wait()
        return self.link, epoch + 1 if takeover else epoch


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def replica(
    *, secret: ResumeKeys = SECRET, clock: Clock | None = None, placer: FakePlacer | None = None, **kw: object
) -> tuple[SessionManager, FakePlacer]:
    placer = placer or FakePlacer()
    cfg = ServiceConfig(
        plugin="parrot",
        workers=("fake:1",),
        resume_keys=kw.pop("resume_keys", secret),  # type: ignore[arg-type]
        max_sessions=8,
        **{k: kw.pop(k) for k in ("max_sessions_per_principal",) if k in kw},  # type: ignore[arg-type]
    )
    manager = SessionManager(
        plugin=TextParrot(),
        config=cfg,
        registry=SessionRegistry(),
        placer=placer,
        wall_clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )
    return manager, placer


def open_msg(
    *, instructions: str = "answer briefly", extra: dict[str, Any] | None = None
) -> session_pb2.SessionOpen:
    cfg = session_pb2.SessionConfig(
        input_format=IN_FMT.to_proto(),
        output_format=OUT_FMT.to_proto(),
        instructions=instructions,
        turn_detection=session_pb2.TurnDetection(auto_respond=False, silence_ms=700, barge_in=False),
        modalities=["audio", "text"],
        idle_timeout_s=42,
    )
    msg = session_pb2.SessionOpen(model="parrot", config=cfg)
    msg.extra_body.update({"pitch_semitones": 7} if extra is None else extra)
    return msg


def resume_msg(runner_or_id: SessionRunner | str, token: str | None = None) -> session_pb2.SessionResume:
    if isinstance(runner_or_id, SessionRunner):
        return session_pb2.SessionResume(
            session_id=runner_or_id.session_id, resume_token=token or runner_or_id.resume_token
        )
    return session_pb2.SessionResume(session_id=runner_or_id, resume_token=token or "")


EXPECTED = SessionSettings(
    input_format=IN_FMT,
    output_format=OUT_FMT,
    instructions="answer briefly",
    turn_detection=TurnDetection(auto_respond=False, silence_ms=700, barge_in=False),
    modalities=("audio", "text"),
    idle_timeout_s=42,
)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def close_all(*managers: SessionManager) -> None:
    for m in managers:
        await m.drain(0)


def assert_invalid_token(err: DuplexError) -> None:
    assert err.code == ErrorCode.INVALID_RESUME_TOKEN
    assert err.status == grpc.StatusCode.UNAUTHENTICATED


# ---- the drain path: another replica takes the session over with its settings -------------------


async def test_takeover_on_another_replica_restores_settings_and_extra_body() -> None:
    a, _ = replica()
    b, placer_b = replica()
    first = await a.open(open_msg())
    assert first.settings == EXPECTED
    taken = await b.resume(resume_msg(first))
    assert placer_b.calls == [(first.session_id, 1, True)]
    assert taken.session_id == first.session_id and taken.epoch == 2
    assert taken.settings == EXPECTED
    assert taken.runtime_config == first.runtime_config == {"pitch_semitones": 7.0, "silence_ms": None}
    opened = events(taken)[0].opened
    assert opened.config == EXPECTED.to_proto() and opened.resume_token == taken.resume_token

    # Raw 48 kHz f32 stereo without a per-append format is read as such: 3072 samples at
    # 48 kHz are 1024 at 16 kHz, two 512-sample worker frames once the commit flushes the
    # resampler (misread as 16 kHz s16 mono they would be 24 frames).
    pcm = b"\x00\x00\x80\x3e" * 2 * 3072
    await taken.post(session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=1, pcm=pcm)))
    await taken.post(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
    await settle()
    subs = placer_b.link.subs
    appends = [sub for sub in subs if sub.kind == worker_pb2.SUBMISSION_KIND_APPEND]
    assert sum(len(sub.pcm) for sub in appends) == 2 * 512 * PCM16K_MONO.frame_bytes
    assert subs[-1].kind == worker_pb2.SUBMISSION_KIND_COMMIT
    params = dict(subs[0].params)
    assert params["pitch_semitones"] == 7.0 and params["auto_commit"] is False
    assert params["silence_ms"] == 700  # from turn detection, as on the first replica
    assert [e.WhichOneof("event") for e in events(taken)] == ["input_ack", "committed"]
    await close_all(a, b)


async def test_go_away_carries_settings_changed_by_update() -> None:
    a, _ = replica()
    b, _ = replica()
    r = await a.open(open_msg())
    opened_token = r.resume_token
    update = session_pb2.SessionUpdate(
        config=session_pb2.SessionConfig(
            instructions="speak slowly",
            turn_detection=session_pb2.TurnDetection(auto_respond=True, silence_ms=300, barge_in=True),
        )
    )
    update.extra_body.update({"pitch_semitones": -3, "silence_ms": 450})
    await r.post(session_pb2.ClientEvent(update=update))
    await settle()
    assert [e.WhichOneof("event") for e in events(r)] == ["opened", "updated"]
    await a.drain(0)
    away = next(e.go_away for e in events(r) if e.HasField("go_away"))
    assert away.reason == "draining" and away.resume_token != opened_token
    taken = await b.resume(resume_msg(r.session_id, away.resume_token))
    assert taken.settings.instructions == "speak slowly"
    assert taken.settings.turn_detection == TurnDetection(auto_respond=True, silence_ms=300, barge_in=True)
    assert taken.settings.input_format == IN_FMT and taken.settings.output_format == OUT_FMT
    assert taken.runtime_config == {"pitch_semitones": -3.0, "silence_ms": 450}
    await close_all(b)


async def test_go_away_keeps_a_fresh_token_that_still_describes_the_session() -> None:
    clock = Clock()
    a, _ = replica(clock=clock)
    r = await a.open(open_msg())
    token = r.resume_token
    clock.t += 60
    await a.drain(0)
    away = next(e.go_away for e in events(r) if e.HasField("go_away"))
    assert away.resume_token == token


async def test_go_away_reissues_a_token_past_half_its_life() -> None:
    clock = Clock()
    a, _ = replica(clock=clock, resume_max_age_s=100.0)
    b, _ = replica(clock=clock, resume_max_age_s=100.0)
    r = await a.open(open_msg())
    token = r.resume_token
    clock.t += 80  # the opened token would expire 20 s from now
    await a.drain(0)
    away = next(e.go_away for e in events(r) if e.HasField("go_away"))
    assert away.resume_token != token
    assert resume.decode(SECRET, away.resume_token, session_id=r.session_id, now=clock.t).issued_at == int(
        clock.t
    )
    clock.t += 90  # past the opened token's life, within the new one's
    taken = await b.resume(resume_msg(r.session_id, away.resume_token))
    assert taken.settings == EXPECTED
    await close_all(b)


async def test_takeover_hands_back_the_presented_token_while_it_is_fresh() -> None:
    a, _ = replica()
    b, _ = replica()
    r = await a.open(open_msg())
    taken = await b.resume(resume_msg(r))
    assert taken.resume_token == r.resume_token
    await close_all(a, b)


async def test_same_replica_resume_rebinds_and_refreshes_the_token_after_an_update() -> None:
    a, placer = replica()
    r = await a.open(open_msg())
    again = await a.resume(resume_msg(r))
    assert again is r and len(placer.calls) == 1
    assert events(r)[0].opened.resume_token == r.resume_token
    update = session_pb2.SessionUpdate()
    update.extra_body.update({"pitch_semitones": 2})
    old = r.resume_token
    await r.post(session_pb2.ClientEvent(update=update))
    await settle()
    events(r)
    assert await a.resume(resume_msg(r, old)) is r
    opened = events(r)[0].opened
    assert opened.resume_token != old
    claims = resume.decode(SECRET, opened.resume_token, session_id=r.session_id, now=T0)
    assert claims.extra_body == {"pitch_semitones": 2.0}
    await close_all(a)


# ---- refusals ----------------------------------------------------------------------------------


async def test_any_flipped_byte_is_refused() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r = await a.open(open_msg())
    token = r.resume_token
    for i in range(len(token)):
        bad = token[:i] + chr(ord(token[i]) ^ 1) + token[i + 1 :]
        with pytest.raises(DuplexError) as err:
            await b.resume(resume_msg(r.session_id, bad))
        assert_invalid_token(err.value)
    with pytest.raises(DuplexError) as err:
        await b.resume(resume_msg(r.session_id, token + "A"))
    assert_invalid_token(err.value)
    assert placer_b.calls == [] and len(b) == 0
    await close_all(a)


async def test_expired_and_future_tokens_are_refused_on_every_replica() -> None:
    clock = Clock()
    a, _ = replica(clock=clock)
    b, _ = replica(clock=clock)
    r = await a.open(open_msg())
    clock.t += resume.DEFAULT_MAX_AGE_S + 1
    for manager in (a, b):  # the live runner on a does not make an expired token good
        with pytest.raises(DuplexError) as err:
            await manager.resume(resume_msg(r))
        assert_invalid_token(err.value)
        assert "expired" in err.value.message
    future = resume.issue(
        SECRET, resume.ResumeClaims(session_id=r.session_id, issued_at=int(clock.t) + 3600, model="parrot")
    )
    with pytest.raises(DuplexError) as err:
        await b.resume(resume_msg(r.session_id, future))
    assert_invalid_token(err.value)
    await close_all(a, b)


async def test_a_token_of_another_secret_or_session_is_refused() -> None:
    a, _ = replica(secret=ResumeKeys.single(b"another-deployment-secret-of-32b"))
    b, _ = replica()
    r = await a.open(open_msg())
    other = await b.open(open_msg())
    for msg in (
        resume_msg(r),
        resume_msg(other.session_id, r.resume_token),
        resume_msg(r.session_id, "0" * 64),
    ):
        with pytest.raises(DuplexError) as err:
            await b.resume(msg)
        assert_invalid_token(err.value)
    with pytest.raises(DuplexError) as err:  # a token of a live session names only that session
        await b.resume(resume_msg(r.session_id, other.resume_token))
    assert_invalid_token(err.value)
    await close_all(a, b)


async def test_a_signed_token_cannot_inject_private_keys_or_another_model() -> None:
    b, placer = replica()
    for extra in ({"threshold": 0.01}, {"pitch_semitones": 99}):
        claims = resume.ResumeClaims(
            session_id="sess_x",
            issued_at=int(T0),
            principal=ANONYMOUS,
            model="parrot",
            settings=EXPECTED,
            extra_body=extra,
        )
        with pytest.raises(DuplexError) as err:
            await b.resume(resume_msg("sess_x", resume.issue(SECRET, claims)))
        assert_invalid_token(err.value)
    other_model = resume.ResumeClaims(
        session_id="sess_x", issued_at=int(T0), principal=ANONYMOUS, model="synthetic", settings=EXPECTED
    )
    with pytest.raises(DuplexError) as err:
        await b.resume(resume_msg("sess_x", resume.issue(SECRET, other_model)))
    assert err.value.code == ErrorCode.MODEL_MISMATCH
    # Proves the id (and whose it is), carries no state.
    bare = resume.issue(
        SECRET, resume.ResumeClaims(session_id="sess_x", issued_at=int(T0), principal=ANONYMOUS)
    )
    with pytest.raises(DuplexError) as err:
        await b.resume(resume_msg("sess_x", bare))
    assert_invalid_token(err.value)
    assert placer.calls == [] and len(b) == 0


def test_decode_refuses_malformed_tokens_without_reading_claims() -> None:
    claims = resume.ResumeClaims(
        session_id="s", issued_at=int(T0), principal="alice", model="parrot", settings=EXPECTED
    )
    good = resume.issue(SECRET, claims)
    assert resume.decode(SECRET, good, session_id="s", now=T0) == claims
    _, kid, box = good.split(".")
    flipped = box[:-2] + ("A" if box[-2] != "A" else "B") + box[-1]
    for bad in (
        "",
        "v2",
        "v2..",
        f"v1.{kid}.{box}",
        f"v2.other.{box}",
        f"v2.{kid}.{flipped}",  # one bit of the ciphertext or its tag changed
        good + "=",
        "é" + good,
        "x" * 10_000,
    ):
        with pytest.raises(resume.InvalidResumeTokenError):
            resume.decode(SECRET, bad, session_id="s", now=T0)
    # Authentic but not our claims layout (an incompatible issuer): refused, not crashed.
    with pytest.raises(resume.InvalidResumeTokenError):
        resume.decode(
            SECRET,
            SECRET.seal(json.dumps({"sid": "s", "iat": int(T0), "s": {"i": [1]}}).encode()),
            session_id="s",
            now=T0,
        )
    # The layout the module documents, built here from the primitives, is a token it accepts:
    # that pins the layout.
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"duplex.resume.v2.k1").derive(
        SECRET_BYTES
    )
    nonce = b"\x07" * 12
    body = json.dumps({"sid": "s", "iat": int(T0), "p": "alice"}).encode()
    sealed = nonce + AESGCM(key).encrypt(nonce, body, b"duplex.resume.v2.k1")
    token = f"v2.k1.{_b64(sealed)}"
    assert resume.decode(SECRET, token, session_id="s", now=T0).principal == "alice"


def test_the_token_hides_the_session_it_carries() -> None:
    claims = resume.ResumeClaims(
        session_id="sess_x", issued_at=int(T0), principal="alice", model="parrot", settings=EXPECTED
    )
    token = resume.issue(SECRET, claims)
    payload = base64.urlsafe_b64decode(token.split(".")[2] + "==")
    for secret_part in (b"answer briefly", b"alice", b"sess_x", b"pitch"):
        assert secret_part not in payload and secret_part.decode() not in token


def test_keys_rotate_the_first_encrypts_all_decrypt_and_short_secrets_are_refused() -> None:
    old = ResumeKeys.single(b"o" * 32, kid="old")
    rotated = ResumeKeys.parse("new:" + "n" * 32 + ",old:" + "o" * 32)
    claims = resume.ResumeClaims(session_id="s", issued_at=int(T0), principal="alice")
    from_old = resume.issue(old, claims)
    assert resume.decode(rotated, from_old, session_id="s", now=T0) == claims  # old tokens still work
    from_new = resume.issue(rotated, claims)
    assert from_new.split(".")[1] == "new"
    with pytest.raises(resume.InvalidResumeTokenError):
        resume.decode(old, from_new, session_id="s", now=T0)  # a replica without the new key
    retired = ResumeKeys.parse("new:" + "n" * 32)
    with pytest.raises(resume.InvalidResumeTokenError):
        resume.decode(retired, from_old, session_id="s", now=T0)  # the old key was dropped
    for bad in ("k1:short", "no-colon", "k1:" + "x" * 32 + ",k1:" + "y" * 32, "bad kid!:" + "x" * 32):
        with pytest.raises(DuplexError) as err:
            ResumeKeys.parse(bad)
        assert err.value.code == ErrorCode.INVALID_CONFIG
    assert ResumeKeys.from_environment({"DUPLEX_RESUME_SECRETS": "a:" + "x" * 40}).shared
    assert not ResumeKeys.from_environment({}).shared


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def test_a_token_is_kept_while_it_says_the_session_s_state_and_is_young_and_renewed_after() -> None:
    """The replica remembers what the tokens it issued say (it does not open its own token at
    every response): the same state keeps the token, a new state or half its life gone renews it,
    and a token it did not issue (a client's, after a takeover) is read to compare."""
    clock = Clock()
    a, _ = replica(clock=clock, resume_max_age_s=100.0)
    r = await a.open(open_msg())
    first = a.refresh_resume_token(r)
    assert a.refresh_resume_token(r) == first
    clock.t += 49
    assert a.refresh_resume_token(r) == first
    clock.t += 2  # past half its life: renewed, though the state is the same
    second = a.refresh_resume_token(r)
    assert second != first
    assert resume.decode(SECRET, second, session_id=r.session_id, now=clock.t).issued_at == int(clock.t)
    r.turn_id += 1  # the state moved on (what a response does)
    third = a.refresh_resume_token(r)
    assert third != second
    assert resume.decode(SECRET, third, session_id=r.session_id, now=clock.t).progress.turn_id == r.turn_id
    # A token issued elsewhere for the same state is read and kept.
    b, _ = replica(clock=clock, resume_max_age_s=100.0)
    assert b.refresh_resume_token(r) == third
    await close_all(a, b)


# ---- the worker the session lives on ------------------------------------------------------------


def worker_named(token: str, session_id: str) -> str:
    return resume.decode(SECRET, token, session_id=session_id, now=T0).worker_id


async def test_the_token_names_the_worker_the_session_lives_on_and_follows_it() -> None:
    a, placer_a = replica()
    b, placer_b = replica()
    placer_a.link = FakeLink("w-a")
    r = await a.open(open_msg())
    assert worker_named(r.resume_token, r.session_id) == "w-a"
    assert events(r)[0].opened.resume_token == r.resume_token
    # Its worker is lost: until it is placed again, its token names the last one it had.
    r.on_worker_lost(placer_a.link)
    assert worker_named(a.refresh_resume_token(r), r.session_id) == "w-a"
    # Placed again elsewhere (its next input): the next token says so.
    placer_a.link = FakeLink("w-b")
    pcm = b"\x00\x00\x80\x3e" * 2 * 3072
    await r.post(session_pb2.ClientEvent(append=session_pb2.InputAudioAppend(seq=1, pcm=pcm)))
    await r.post(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
    await settle()
    assert r.link is placer_a.link
    token = a.refresh_resume_token(r)
    assert worker_named(token, r.session_id) == "w-b"
    # A takeover elsewhere tries that worker first; its token names where the session went.
    placer_b.link = FakeLink("w-c")
    taken = await b.resume(resume_msg(r.session_id, token))
    assert placer_b.preferred == ["w-b"]
    assert worker_named(taken.resume_token, r.session_id) == "w-c"
    assert events(taken)[0].opened.resume_token == taken.resume_token
    await close_all(a, b)


async def test_a_token_that_names_no_worker_still_resumes_without_a_preference() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r = await a.open(open_msg())
    claims = resume.decode(SECRET, r.resume_token, session_id=r.session_id, now=T0)
    # What a replica issued before tokens named workers: no "w" claim at all.
    legacy = resume.issue(SECRET, dataclasses.replace(claims, worker_id=""))
    assert worker_named(legacy, r.session_id) == ""
    taken = await b.resume(resume_msg(r.session_id, legacy))
    assert placer_b.preferred == [None] and placer_b.calls == [(r.session_id, 1, True)]
    assert taken.settings == EXPECTED
    assert worker_named(taken.resume_token, r.session_id) == "fake-worker"
    await close_all(a, b)


# ---- concurrency -------------------------------------------------------------------------------


async def test_concurrent_resumes_yield_one_live_runner() -> None:
    a, _ = replica()
    hold = asyncio.Event()
    b, placer_b = replica(placer=FakePlacer(hold=hold))
    r = await a.open(open_msg())
    tasks = [asyncio.create_task(b.resume(resume_msg(r))) for _ in range(3)]
    await settle()
    assert len(placer_b.calls) == 1  # the others wait for the first takeover
    hold.set()
    runners = await asyncio.gather(*tasks)
    assert runners[0] is runners[1] is runners[2]
    assert len(b) == 1 and len(placer_b.calls) == 1
    assert b.resumes_in_progress == 0
    await close_all(a, b)


async def test_a_failed_takeover_lets_the_waiting_resume_try_again() -> None:
    a, _ = replica()
    hold = asyncio.Event()
    placer = FakePlacer(hold=hold)
    b, _ = replica(placer=placer)
    r = await a.open(open_msg())
    first = asyncio.create_task(b.resume(resume_msg(r)))
    await settle()
    second = asyncio.create_task(b.resume(resume_msg(r)))
    await settle()
    first.cancel()  # the first client hung up while attaching
    with pytest.raises(asyncio.CancelledError):
        await first
    hold.set()
    runner = await second
    assert len(b) == 1 and b.registry.get(r.session_id) is runner and len(placer.calls) == 2
    await close_all(a, b)


# ---- size --------------------------------------------------------------------------------------


async def test_the_token_is_bounded() -> None:
    a, _ = replica()
    r = await a.open(open_msg())
    assert len(r.resume_token) < 512
    long = await a.open(open_msg(instructions="x" * 4000))
    assert len(long.resume_token) <= resume.MAX_TOKEN_CHARS
    with pytest.raises(DuplexError) as err:
        await a.open(open_msg(instructions="x" * resume.MAX_TOKEN_CHARS))
    assert err.value.code == ErrorCode.INVALID_CONFIG
    assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert len(a) == 2
    await close_all(a)


def test_bare_token_helpers_keep_their_meaning() -> None:
    tok = resume.resume_token(SECRET, "sess_1")
    assert resume.verify_resume_token(SECRET, "sess_1", tok)
    assert not resume.verify_resume_token(ResumeKeys.single(b"o" * 32), "sess_1", tok)
    assert not resume.verify_resume_token(SECRET, "sess_2", tok)
    assert not resume.verify_resume_token(SECRET, "sess_1", tok, now=T0 * 2)


def test_client_extra_body_reflects_the_runtime_config_without_private_or_unset_keys() -> None:
    plugin = ParrotPlugin()
    runtime: dict[str, object] = {
        "pitch_semitones": 5.0,
        "silence_ms": None,
        "threshold": 0.5,
        "_worker_params": {"x": 1},
        "voice_embedding": object(),
    }
    base: dict[str, object] = {"pitch_semitones": 3, "silence_ms": 500, "model": "parrot"}
    assert resume.client_extra_body(plugin, runtime, base) == {"pitch_semitones": 5.0}


def test_resume_keys_come_from_the_environment_never_argv(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from session_service.api.cli import config_from_args

    base = ["--workers", "127.0.0.1:1", "--listen", "127.0.0.1:0"]
    monkeypatch.delenv("DUPLEX_RESUME_SECRET", raising=False)
    monkeypatch.setenv("DUPLEX_RESUME_SECRETS", "new:" + "n" * 32 + ",old:" + "o" * 32)
    keys = config_from_args(base).resume_keys
    assert keys is not None and keys.shared and keys.signing_kid == "new"
    with pytest.raises(SystemExit):  # there is no flag that would put a secret in argv
        config_from_args([*base, "--resume-secret", "x" * 32])
    monkeypatch.setenv("DUPLEX_RESUME_SECRETS", "k:too-short")
    with pytest.raises(SystemExit) as exit_:
        config_from_args(base)
    assert "at least 32" in str(exit_.value) and "too-short" not in str(exit_.value)
    monkeypatch.delenv("DUPLEX_RESUME_SECRETS")
    monkeypatch.setenv("DUPLEX_RESUME_SECRET", "s" * 32)  # one key, the older variable
    keys = config_from_args(base).resume_keys
    assert keys is not None and keys.shared
    monkeypatch.delenv("DUPLEX_RESUME_SECRET")
    keys = config_from_args(base).resume_keys
    assert keys is not None and not keys.shared  # replica-local, and said so in opened
    assert config_from_args(base).resume_max_age_s == 86_400.0


# ---- sessions belong to their principal -----------------------------------------------------------


async def test_only_the_principal_that_opened_a_session_may_resume_it() -> None:
    a, _ = replica()
    b, placer_b = replica()
    r = await a.open(open_msg(), principal="alice")
    assert r.principal == "alice"
    assert resume.decode(SECRET, r.resume_token, session_id=r.session_id, now=T0 + 1).principal == "alice"
    for manager in (a, b):  # rebinding a live session here, and taking it over from another replica
        with pytest.raises(DuplexError) as err:
            await manager.resume(resume_msg(r), principal="mallory")
        assert err.value.code == ErrorCode.NOT_SESSION_OWNER
        assert err.value.status == grpc.StatusCode.PERMISSION_DENIED
    assert placer_b.calls == [] and not r.closed
    taken = await b.resume(resume_msg(r), principal="alice")
    assert taken.principal == "alice" and taken.session_id == r.session_id
    await close_all(a, b)


async def test_one_caller_cannot_fill_the_replica() -> None:
    a, _ = replica(max_sessions_per_principal=2)
    first = [await a.open(open_msg(), principal="alice") for _ in range(2)]
    with pytest.raises(DuplexError) as err:
        await a.open(open_msg(), principal="alice")
    assert err.value.code == ErrorCode.CAPACITY_EXHAUSTED and err.value.retryable
    assert err.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await a.open(open_msg(), principal="bob")).principal == "bob"  # others are not held up
    first[0].close("client_close")
    await first[0].wait_closed()
    assert (await a.open(open_msg(), principal="alice")).principal == "alice"  # capacity comes back
    await close_all(a)


async def test_opened_says_whether_the_token_works_beyond_this_replica() -> None:
    shared, _ = replica()
    local, _ = replica(resume_keys=None)
    for manager, scope in ((shared, "deployment"), (local, "replica")):
        r = await manager.open(open_msg())
        assert events(r)[0].opened.capabilities.resume_scope == scope
    await close_all(shared, local)


async def test_a_session_that_ended_is_released_for_good_a_drained_one_is_not() -> None:
    a, placer = replica()
    closed = await a.open(open_msg())
    await closed.post(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
    await closed.wait_closed()
    drained = await a.open(open_msg())
    await a.drain(0)
    released = {rel.request_id: rel.closed for rel in placer.link.releases}
    assert released == {closed.session_id: True, drained.session_id: False}


async def test_a_resumed_stream_tells_the_one_it_displaces() -> None:
    a, _ = replica()
    r = await a.open(open_msg())
    first = r.attach_stream()
    assert (await r.outbound.get(first)).WhichOneof("event") == "opened"  # type: ignore[union-attr]
    await a.resume(resume_msg(r))
    second = r.attach_stream()
    farewell = await r.outbound.get(first)
    assert farewell is not None and farewell.closed.reason == "resumed_elsewhere"
    assert await r.outbound.get(first) is None  # and then that stream ends
    assert (await r.outbound.get(second)).WhichOneof("event") == "opened"  # type: ignore[union-attr]
    await close_all(a)


async def test_a_closed_session_stays_closed_on_the_replica_that_closed_it() -> None:
    clock = Clock()
    a, placer = replica(clock=clock)
    r = await a.open(open_msg())
    token = r.resume_token
    await r.post(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
    await r.wait_closed()
    with pytest.raises(DuplexError) as err:
        await a.resume(resume_msg(r.session_id, token))
    assert err.value.code == ErrorCode.SESSION_CLOSED and err.value.status == grpc.StatusCode.NOT_FOUND
    assert [c for c in placer.calls if c[2]] == []  # refused before any worker was asked
    # A drained session is not closed: it resumes.
    d = await a.open(open_msg())
    await a.drain(0)
    a.draining = False
    assert (await a.resume(resume_msg(d))).session_id == d.session_id
    await close_all(a)


# ---- event ids: given as events go out (issue 25) -------------------------------------------


def _ev(kind: str) -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(**{kind: {}})


def _audio() -> session_pb2.ServerEvent:
    return session_pb2.ServerEvent(audio_delta=session_pb2.AudioDelta(pcm=b"\x00" * 64))


def _ids(evs: list[session_pb2.ServerEvent | None]) -> list[tuple[str, str]]:
    return [(e.event_id, e.WhichOneof("event") or "") for e in evs if e is not None]


async def test_a_resumed_stream_gets_opened_first_and_ids_in_the_order_it_gets_events() -> None:
    """Events that waited for a resume were numbered as they were queued, and ``opened`` (put
    ahead of them) after them: ``se_4``, then ``se_2``. Output of a left epoch is dropped
    without a number, and the farewell of a stream that ended before taking it takes none."""
    epoch = 1
    out = Outbound(lambda: epoch)
    a = out.attach()
    out.put(_ev("committed"))
    assert _ids([await out.get(a)]) == [("se_1", "committed")]
    out.detached(a)  # the stream drops; the session goes on
    out.put(_audio(), epoch=1)
    out.put(_ev("committed"))
    epoch = 2  # the audio's epoch is left: it is dropped on the way out
    out.put(_audio(), epoch=2)
    out.put_front(_ev("opened"))  # the resume
    b = out.attach(farewell=_ev("closed"))
    got = [await out.get(b) for _ in range(3)]
    assert _ids(got) == [("se_2", "opened"), ("se_3", "committed"), ("se_4", "audio_delta")]
    assert out.next_ids_at_most() == 5


async def test_an_event_the_dropped_stream_could_not_write_goes_to_the_resumed_one() -> None:
    """The call ended while the stream wrote ``se_2`` (and a resume came meanwhile): it goes
    back, behind the resumed stream's ``opened``, and is numbered again as it goes out."""
    out = Outbound(lambda: 1)
    a = out.attach()
    for kind in ("committed", "updated", "cleared"):
        out.put(_ev(kind))
    await out.get(a)
    assert _ids([await out.get(a)]) == [("se_2", "updated")]  # its write fails
    out.put_front(_ev("opened"))  # the resume, while the write waited
    out.unsent(a)
    out.detached(a)
    b = out.attach()
    got = [await out.get(b) for _ in range(3)]
    assert _ids(got) == [("se_2", "opened"), ("se_3", "updated"), ("se_4", "cleared")]
    # Written is written: nothing goes back once the stream said so (or took again since), nor
    # once it is no longer the writer (displaced and cut off, another stream may have taken).
    out.wrote(b)
    out.unsent(b)
    assert len(out) == 0 and out.numbered == 4
    out.put(_ev("committed"))
    assert _ids([await out.get(b)]) == [("se_5", "committed")]
    out.detached(b)
    out.unsent(b)
    assert len(out) == 0 and out.numbered == 5


async def test_a_taking_stream_puts_back_only_what_it_did_not_write() -> None:
    """``ConverseMany`` takes several events and writes them in messages: those of the message
    whose write failed, and after it, go back; those written before it stay written."""
    out = Outbound(lambda: 1)
    a = out.attach()
    for kind in ("committed", "updated", "cleared"):
        out.put(_ev(kind))
    events, _ = out.take(a, 10)
    assert [e.event_id for e, _ in events] == ["se_1", "se_2", "se_3"]
    assert [size for _, size in events] == [e.ByteSize() for e, _ in events]
    out.unsent(a, 2)  # the message with the last two was not written
    out.detached(a)
    b = out.attach()
    events, _ = out.take(b, 10)
    assert _ids([e for e, _ in events]) == [("se_2", "updated"), ("se_3", "cleared")]


async def test_a_displaced_stream_s_farewell_takes_the_next_id_when_it_goes_out() -> None:
    out = Outbound(lambda: 1)
    a = out.attach()
    out.put(_ev("committed"))
    await out.get(a)
    out.put_front(_ev("opened"))
    b = out.attach(farewell=_ev("closed"))
    assert _ids([await out.get(b)]) == [("se_2", "opened")]
    assert _ids([await out.get(a)]) == [("se_3", "closed")]
    out.put(_ev("cleared"))
    assert _ids([await out.get(b)]) == [("se_4", "cleared")]
