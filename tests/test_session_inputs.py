"""Hostile client input gets a stable code, never INTERNAL/UNKNOWN: NaN and infinities, deep
nesting, huge strings, wrong types, modalities the model cannot produce, instructions too long
for a resume token, and the output format's default.

At three levels: the wire settings (``session_service.session.settings``) and ``SessionManager`` (opens,
call-ending: INVALID_ARGUMENT), one runner with a fake worker link (later events: an ``error``
event, the session goes on), and end to end against the in-process stack. A client value quoted
in a message is bounded and escaped (``duplex.errors.echo``), so a status always fits in the
trailers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import struct
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, struct_pb2

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat
from duplex.errors import (
    MAX_ECHO_CHARS,
    MAX_STATUS_MESSAGE_BYTES,
    BadEventError,
    BadRequestError,
    DuplexError,
    ErrorCode,
    echo,
    to_rpc_status,
)
from duplex.v1 import session_pb2
from session_service.config import RunnerConfig, ServiceConfig
from session_service.plugin import Capabilities, DuplexModelPlugin
from session_service.plugins.parrot import ParrotPlugin
from session_service.plugins.synthetic import SyntheticPlugin
from session_service.session.manager import SessionManager
from session_service.session.runner import RunnerDeps, SessionRunner, WorkerHandle
from session_service.session.settings import (
    MAX_EXTRA_BODY_DEPTH,
    MAX_INSTRUCTIONS_BYTES,
    instructions_size,
    settings_from_proto,
    struct_to_dict,
)
from session_service.trust import resume_tokens as resume
from session_service.trust.resume_tokens import ResumeKeys
from session_service.workers.placement import MAX_WORKER_ID_LENGTH
from session_service.workers.step_routing import SessionRegistry
from tests.fakes import ManualClock
from tests.session_helpers import Conversation, FakeLink, InProcessStack, drain

F32_48K_STEREO = PcmFormat(F32LE, 48000, 2)
FRAME = b"\x10\x00" * 512
NON_FINITE = [math.nan, math.inf, -math.inf]
#: A bounded message: the echo of one value plus the server's own words.
SHORT = 400


def _deep(levels: int, leaf: Any = 1, into: struct_pb2.Struct | None = None) -> struct_pb2.Struct:
    """``{"a": {"a": ... leaf}}``: ``levels`` objects deep (the outermost is level 1), built in
    ``into`` when given (past protobuf's parse depth a copy would fail)."""
    s = struct_pb2.Struct() if into is None else into
    cur = s
    for _ in range(levels - 1):
        cur = cur.get_or_create_struct("a")
    cur.update({"a": leaf})
    return s


def _struct(body: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(body)
    return s


def _cfg(**kw: Any) -> session_pb2.SessionConfig:
    return session_pb2.SessionConfig(**kw)


# ---- echoes and statuses ------------------------------------------------------------------------


def test_an_echoed_value_is_bounded_and_escaped() -> None:
    assert echo("parrot") == '"parrot"'
    huge = echo("m" * 100_000)
    assert huge == '"' + "m" * MAX_ECHO_CHARS + '"... (100000 characters)'
    tricky = echo('a"b\\c\x00\n\u00e9\U0001f600' * 50)
    assert tricky.isascii() and len(tricky) <= MAX_ECHO_CHARS + 30
    assert tricky.startswith('"a\\"b\\\\c\\u0000\\n\\u00e9\\ud83d\\ude00')
    nested = echo({"a": [1, 2, {"b": "x" * 500}] * 100})
    assert nested.isascii() and len(nested) <= MAX_ECHO_CHARS
    assert echo(math.nan) == "nan" and echo(None) == "None"


def test_a_status_message_always_fits_in_the_trailers() -> None:
    for text in ("x" * 100_000, "\u00e9" * 100_000, "\U0001f600" * 10_000):
        status = to_rpc_status(BadRequestError(ErrorCode.INVALID_CONFIG, text))
        assert len(status.details.encode()) <= MAX_STATUS_MESSAGE_BYTES
        trailer = dict(status.trailing_metadata)["grpc-status-details-bin"]
        assert isinstance(trailer, bytes) and len(trailer) < 2 * MAX_STATUS_MESSAGE_BYTES
    short = to_rpc_status(BadRequestError(ErrorCode.INVALID_CONFIG, "short"))
    assert short.details == "short"


# ---- extra_body -------------------------------------------------------------------------------


@pytest.mark.parametrize("x", NON_FINITE)
@pytest.mark.parametrize("where", ["top", "list", "object"])
def test_non_finite_numbers_in_extra_body_are_invalid_runtime_config(x: float, where: str) -> None:
    body: dict[str, Any] = {
        "top": {"pitch_semitones": x},
        "list": {"opts": [1, [2, x]]},
        "object": {"opts": {"inner": {"v": x}}},
    }[where]
    with pytest.raises(BadEventError) as err:
        struct_to_dict(_struct(body))
    assert err.value.code == ErrorCode.INVALID_RUNTIME_CONFIG
    assert "finite" in err.value.message


def test_deep_extra_body_is_invalid_runtime_config_without_recursing_away() -> None:
    ok = _deep(MAX_EXTRA_BODY_DEPTH)
    assert struct_to_dict(ok) == json_format.MessageToDict(ok)
    lists = struct_pb2.Struct()
    inner = lists.get_or_create_list("l")
    for _ in range(MAX_EXTRA_BODY_DEPTH):  # a list inside a list ... is a level each
        inner = inner.add_list()
    # Deeper than the wire allows (about 32) and than Python's recursion limit: built here.
    for s in (_deep(MAX_EXTRA_BODY_DEPTH + 1), lists, _deep(1100)):
        with pytest.raises(BadEventError) as err:
            struct_to_dict(s)
        assert err.value.code == ErrorCode.INVALID_RUNTIME_CONFIG
        assert "nested" in err.value.message


def test_extra_body_converts_as_json_format_does() -> None:
    body = {"n": 7, "f": -1.5, "s": "x", "b": True, "z": None, "l": [1, "a", {"k": [False]}], "o": {"p": {}}}
    s = _struct(body)
    assert struct_to_dict(s) == json_format.MessageToDict(s) == body
    assert struct_to_dict(struct_pb2.Struct()) == {}


# ---- modalities, formats, turn detection, instructions (wire settings) ---------------------------


PARROT_CAPS = ParrotPlugin().capabilities(max_sessions=1)


@pytest.mark.parametrize(
    "modalities",
    [["text"], ["audio", "text"], ["audio", "audio"], ["video"], ["x" * 100_000], [""]],
)
def test_modalities_must_be_offered_by_the_model_and_named_once(modalities: list[str]) -> None:
    cfg = _cfg(input_format=PCM16K_MONO.to_proto(), modalities=modalities)
    with pytest.raises(BadEventError) as err:
        settings_from_proto(cfg, None, require_input=True, capabilities=PARROT_CAPS)
    assert err.value.code == ErrorCode.INVALID_CONFIG
    assert len(err.value.message) < SHORT


def test_the_output_defaults_to_the_input_rate_with_the_models_encoding_mono() -> None:
    for plugin in (ParrotPlugin(), SyntheticPlugin()):
        caps = plugin.capabilities(max_sessions=1)
        cfg = _cfg(input_format=F32_48K_STEREO.to_proto())
        s = settings_from_proto(cfg, None, require_input=True, capabilities=caps)
        assert (
            s.output_format == PcmFormat(caps.output_format.encoding, 48000, 1) == PcmFormat(S16LE, 48000, 1)
        )
        # An explicit output format is kept.
        cfg.output_format.CopyFrom(F32_48K_STEREO.to_proto())
        assert (
            settings_from_proto(cfg, None, require_input=True, capabilities=caps).output_format
            == F32_48K_STEREO
        )


def test_an_input_format_the_model_does_not_list_is_unsupported() -> None:
    narrow = dataclasses.replace(PARROT_CAPS, input_formats=(PCM16K_MONO,))
    cfg = _cfg(input_format=F32_48K_STEREO.to_proto())
    with pytest.raises(BadEventError) as err:
        settings_from_proto(cfg, None, require_input=True, capabilities=narrow)
    assert err.value.code == ErrorCode.UNSUPPORTED_AUDIO_FORMAT


def test_instructions_are_bounded_as_the_resume_token_stores_them() -> None:
    base = _cfg(input_format=PCM16K_MONO.to_proto())
    at_limit = [
        "x" * MAX_INSTRUCTIONS_BYTES,
        '"' * (MAX_INSTRUCTIONS_BYTES // 2),
        "\u00e9" * 2048,
        "\x01" * 682,
    ]
    for text in at_limit:
        assert instructions_size(text) <= MAX_INSTRUCTIONS_BYTES
        base.instructions = text
        assert settings_from_proto(base, None, require_input=True).instructions == text
    over = [
        "x" * (MAX_INSTRUCTIONS_BYTES + 1),
        '"' * 2049,
        "\x01" * 683,
        "\U0001f600" * 1025,
        "y" * 320 * 1024,
    ]
    for text in over:
        base.instructions = text
        with pytest.raises(BadEventError) as err:
            settings_from_proto(base, None, require_input=True)
        assert err.value.code == ErrorCode.INVALID_CONFIG and len(err.value.message) < SHORT


# ---- opens (SessionManager): call-ending INVALID_ARGUMENT ------------------------------------


class _Placer:
    def __init__(self, worker_id: str = "fake-worker") -> None:
        self.link = FakeLink(worker_id)

    async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        return self.link, epoch


def _manager(
    plugin: DuplexModelPlugin | None = None, keys: ResumeKeys | None = None, *, worker_id: str = "fake-worker"
) -> SessionManager:
    plugin = plugin or ParrotPlugin()
    cfg = ServiceConfig(
        plugin=plugin.plugin_id,
        workers=("fake:1",),
        resume_keys=keys or ResumeKeys.single(b"s" * 32),
        max_sessions=8,
    )
    return SessionManager(plugin=plugin, config=cfg, registry=SessionRegistry(), placer=_Placer(worker_id))


def _open(
    *, model: str = "parrot", extra: struct_pb2.Struct | None = None, **cfg: Any
) -> session_pb2.SessionOpen:
    cfg.setdefault("input_format", PCM16K_MONO.to_proto())
    msg = session_pb2.SessionOpen(model=model, config=_cfg(**cfg))
    if extra is not None:
        msg.extra_body.CopyFrom(extra)
    return msg


BAD_OPENS: dict[str, tuple[session_pb2.SessionOpen, str]] = {
    "NaN": (_open(extra=_struct({"pitch_semitones": math.nan})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "Infinity": (_open(extra=_struct({"pitch_semitones": math.inf})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "-Infinity": (_open(extra=_struct({"silence_ms": -math.inf})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "deep": (_open(extra=_deep(MAX_EXTRA_BODY_DEPTH + 1)), ErrorCode.INVALID_RUNTIME_CONFIG),
    "wrong type": (_open(extra=_struct({"pitch_semitones": {"a": [1]}})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "null": (_open(extra=_struct({"silence_ms": None})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "huge key": (_open(extra=_struct({"k" * 15_000: 1})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "huge model": (_open(model="m" * 100_000), ErrorCode.MODEL_MISMATCH),
    "odd model": (_open(model="\x00\n\u202e" * 50), ErrorCode.MODEL_MISMATCH),
    "huge extra_body.model": (_open(extra=_struct({"model": "m" * 15_000})), ErrorCode.MODEL_MISMATCH),
    "list extra_body.model": (_open(extra=_struct({"model": ["parrot"] * 1000})), ErrorCode.MODEL_MISMATCH),
    "text modality": (_open(modalities=["text"]), ErrorCode.INVALID_CONFIG),
    "modality twice": (_open(modalities=["audio"] * 10_000), ErrorCode.INVALID_CONFIG),
    "huge modality": (_open(modalities=["a" * 100_000]), ErrorCode.INVALID_CONFIG),
    "long instructions": (_open(instructions="x" * (MAX_INSTRUCTIONS_BYTES + 1)), ErrorCode.INVALID_CONFIG),
    "320 KiB instructions": (_open(instructions="i" * 320 * 1024), ErrorCode.INVALID_CONFIG),
    "no input format": (session_pb2.SessionOpen(model="parrot"), ErrorCode.INVALID_CONFIG),
}


@pytest.mark.parametrize("name", list(BAD_OPENS))
async def test_a_bad_open_ends_the_call_with_its_code_and_a_short_message(name: str) -> None:
    msg, code = BAD_OPENS[name]
    manager = _manager()
    with pytest.raises(DuplexError) as err:
        await manager.open(msg)
    assert err.value.code == code, err.value
    assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.value.message) < SHORT and err.value.message.isascii(), err.value.message
    assert len(manager) == 0


async def test_server_turn_detection_cannot_be_switched_on_where_the_model_has_none() -> None:
    manager = _manager(SyntheticPlugin())
    td = session_pb2.TurnDetection(auto_respond=True)
    with pytest.raises(DuplexError) as err:
        await manager.open(_open(model="synthetic", turn_detection=td))
    assert (err.value.code, err.value.status) == (ErrorCode.INVALID_CONFIG, grpc.StatusCode.INVALID_ARGUMENT)


async def test_an_f32_session_gets_the_models_encoding_out_by_default() -> None:
    manager = _manager()
    runner = await manager.open(_open(input_format=F32_48K_STEREO.to_proto()))
    opened = drain(runner)[0].opened
    assert PcmFormat.from_proto(opened.config.output_format) == PcmFormat(S16LE, 48000, 1)
    assert opened.capabilities.output_format.encoding == S16LE
    await manager.drain(0)


class _TextParrot(ParrotPlugin):
    """A parrot that offers text too: the longest modalities a session can have."""

    def capabilities(self, *, max_sessions: int) -> Capabilities:
        return dataclasses.replace(
            super().capabilities(max_sessions=max_sessions), modalities=("audio", "text")
        )


#: The longest principal a session is guaranteed to fit in a token with (bytes of UTF-8).
MAX_PRINCIPAL_BYTES = 1024

#: The longest worker id a token names (``worker_link.MAX_WORKER_ID_LENGTH`` characters), in its
#: longest UTF-8 form.
WORST_WORKER_ID = "\U0001f600" * MAX_WORKER_ID_LENGTH


async def test_a_maximal_session_always_fits_in_a_resume_token() -> None:
    """Every setting at its longest, the longest key id, a 1 KiB principal, the longest worker
    id: the open's token and every refresh after updates that keep the session maximal are
    issued (never only a warning)."""
    keys = ResumeKeys({"k" * 32: b"s" * 32})
    manager = _manager(_TextParrot(), keys, worker_id=WORST_WORKER_ID)
    worst = '"' * (MAX_INSTRUCTIONS_BYTES // 2)  # 2 bytes each in the token
    principal = "\u00e9" * (MAX_PRINCIPAL_BYTES // 2)
    msg = _open(
        input_format=F32_48K_STEREO.to_proto(),
        output_format=F32_48K_STEREO.to_proto(),
        instructions=worst,
        turn_detection=session_pb2.TurnDetection(auto_respond=True, silence_ms=10_000, barge_in=True),
        modalities=["text", "audio"],
        idle_timeout_s=2**32 - 1,
        extra=_struct({"pitch_semitones": -11.999999999999998, "silence_ms": 4999.5, "model": "parrot"}),
    )
    runner = await manager.open(msg, principal=principal)
    assert len(runner.resume_token) <= resume.MAX_TOKEN_CHARS
    claims = resume.decode(keys, runner.resume_token, session_id=runner.session_id)
    assert claims.settings == runner.settings and claims.principal == principal
    assert claims.worker_id == WORST_WORKER_ID
    # Updates to other worst cases: the token is refreshed each time (it says the new state).
    for text in ("\x01" * (MAX_INSTRUCTIONS_BYTES // 6), "\\" * (MAX_INSTRUCTIONS_BYTES // 2)):
        before = runner.resume_token
        await runner.post(
            session_pb2.ClientEvent(update=session_pb2.SessionUpdate(config=_cfg(instructions=text)))
        )
        await _settle()
        assert runner.settings.instructions == text
        token = manager.refresh_resume_token(runner)
        assert token != before and len(token) <= resume.MAX_TOKEN_CHARS
        assert resume.decode(keys, token, session_id=runner.session_id).settings == runner.settings
        assert resume.decode(keys, token, session_id=runner.session_id).worker_id == WORST_WORKER_ID
    # One byte more is refused, at the open and in an update (the session keeps its settings).
    with pytest.raises(DuplexError) as err:
        await manager.open(_open(instructions=worst + "x"), principal=principal)
    assert err.value.code == ErrorCode.INVALID_CONFIG
    drain(runner)
    await runner.post(
        session_pb2.ClientEvent(
            event_id="long", update=session_pb2.SessionUpdate(config=_cfg(instructions=worst + "x"))
        )
    )
    await _settle()
    (ev,) = drain(runner)
    assert (ev.error.code, ev.error.event_id) == (ErrorCode.INVALID_CONFIG, "long")
    assert runner.settings.instructions == "\\" * (MAX_INSTRUCTIONS_BYTES // 2)
    await manager.drain(0)


# ---- later events (one runner, fake worker link): an error event, the session goes on -----------


def _runner(
    plugin: DuplexModelPlugin | None = None, *, input_format: PcmFormat = PCM16K_MONO
) -> SessionRunner:
    plugin = plugin or ParrotPlugin()
    settings = dataclasses.replace(plugin.default_settings(), input_format=input_format)

    async def placer(session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        raise AssertionError("not expected")

    r = SessionRunner(
        session_id="sess_inputs",
        settings=settings,
        runtime_config={"pitch_semitones": 4.0, "silence_ms": None},
        link=FakeLink(),
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=plugin.capabilities(max_sessions=4),
            config=RunnerConfig(),
            placer=placer,
            clock=ManualClock(),
        ),
    )
    r.start()
    return r


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _update(eid: str, *, extra: struct_pb2.Struct | None = None, **cfg: Any) -> session_pb2.ClientEvent:
    up = session_pb2.SessionUpdate(config=_cfg(**cfg))
    if extra is not None:
        up.extra_body.CopyFrom(extra)
    return session_pb2.ClientEvent(event_id=eid, update=up)


def _append(seq: int, pcm: bytes = FRAME, eid: str = "") -> session_pb2.ClientEvent:
    return session_pb2.ClientEvent(
        event_id=eid or f"a{seq}", append=session_pb2.InputAudioAppend(seq=seq, pcm=pcm)
    )


BAD_UPDATES: dict[str, tuple[session_pb2.ClientEvent, str]] = {
    "NaN": (_update("u", extra=_struct({"pitch_semitones": math.nan})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "Infinity": (_update("u", extra=_struct({"silence_ms": math.inf})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "NaN in a list": (_update("u", extra=_struct({"x": [1, math.nan]})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "deep": (_update("u", extra=_deep(MAX_EXTRA_BODY_DEPTH + 1)), ErrorCode.INVALID_RUNTIME_CONFIG),
    "huge key": (_update("u", extra=_struct({"k" * 15_000: 1})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "wrong type": (_update("u", extra=_struct({"pitch_semitones": "5"})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "text modality": (_update("u", modalities=["text"]), ErrorCode.INVALID_CONFIG),
    "modality twice": (_update("u", modalities=["audio", "audio"]), ErrorCode.INVALID_CONFIG),
    "huge modality": (_update("u", modalities=["v" * 100_000]), ErrorCode.INVALID_CONFIG),
    "320 KiB instructions": (_update("u", instructions="i" * 320 * 1024), ErrorCode.INVALID_CONFIG),
    "silence out of range": (
        _update("u", turn_detection=session_pb2.TurnDetection(silence_ms=2**32 - 1)),
        ErrorCode.INVALID_CONFIG,
    ),
}


@pytest.mark.parametrize("name", list(BAD_UPDATES))
async def test_a_bad_update_is_an_error_event_and_changes_nothing(name: str) -> None:
    event, code = BAD_UPDATES[name]
    r = _runner()
    drain(r)
    before = (r.settings, dict(r.runtime_config))
    await r.post(event)
    await r.post(_append(1, eid="good"))
    await _settle()
    evs = drain(r)
    assert [e.WhichOneof("event") for e in evs] == ["error", "input_ack"], evs
    assert (evs[0].error.code, evs[0].error.event_id) == (code, "u")
    assert len(evs[0].error.message) < SHORT
    assert (r.settings, dict(r.runtime_config)) == before
    r.close("test")


async def test_an_update_cannot_switch_on_turn_detection_the_model_lacks() -> None:
    r = _runner(SyntheticPlugin())
    drain(r)
    await r.post(_update("u", turn_detection=session_pb2.TurnDetection(auto_respond=True)))
    await _settle()
    (ev,) = drain(r)
    assert ev.error.code == ErrorCode.INVALID_CONFIG
    assert not r.settings.turn_detection.auto_respond
    r.close("test")


@pytest.mark.parametrize("x", NON_FINITE)
async def test_response_create_with_non_finite_extra_body_is_invalid_runtime_config(x: float) -> None:
    r = _runner()
    await r.post(_append(1))
    await r.post(session_pb2.ClientEvent(commit=session_pb2.InputAudioCommit()))
    await _settle()
    drain(r)
    rc = session_pb2.ResponseCreate(extra_body=_struct({"pitch_semitones": x}))
    await r.post(session_pb2.ClientEvent(event_id="rc", response_create=rc))
    await _settle()
    (ev,) = drain(r)
    assert (ev.error.code, ev.error.event_id) == (ErrorCode.INVALID_RUNTIME_CONFIG, "rc")
    assert r.response is None
    r.close("test")


@pytest.mark.parametrize("x", NON_FINITE)
async def test_non_finite_float_pcm_is_refused_before_it_takes_its_seq(x: float) -> None:
    fmt = PcmFormat(F32LE, 16000, 1)
    r = _runner(input_format=fmt)
    drain(r)
    good = struct.pack("<512f", *([0.25] * 512))
    bad = struct.pack("<512f", *([0.25] * 511 + [x]))
    await r.post(_append(1, bad, eid="bad"))
    await r.post(_append(1, good, eid="again"))  # the same seq: the refused append did not take it
    await _settle()
    evs = drain(r)
    assert [e.WhichOneof("event") for e in evs] == ["error", "input_ack"], evs
    assert (evs[0].error.code, evs[0].error.event_id) == (ErrorCode.INVALID_EVENT, "bad")
    assert evs[1].input_ack.seq == 1
    r.close("test")


# ---- end to end ---------------------------------------------------------------------------------


def _open_event(**kw: Any) -> session_pb2.ClientEvent:
    extra = kw.pop("extra", None)
    ev = session_pb2.ClientEvent(event_id="open", open=_open(**kw))
    if extra is not None:
        ev.open.extra_body.CopyFrom(extra)
    return ev


async def test_bad_opens_end_to_end_get_invalid_argument_with_their_code(stack: InProcessStack) -> None:
    fatal = {
        "NaN": (_open_event(extra=_struct({"pitch_semitones": math.nan})), "invalid_runtime_config"),
        "Infinity": (_open_event(extra=_struct({"pitch_semitones": -math.inf})), "invalid_runtime_config"),
        "deep": (_open_event(extra=_deep(MAX_EXTRA_BODY_DEPTH + 1)), "invalid_runtime_config"),
        "15 KB key": (_open_event(extra=_struct({"k" * 15_000: 1})), "invalid_runtime_config"),
        "100 KB model": (_open_event(model="m" * 100_000), "model_mismatch"),
        "text modality": (_open_event(modalities=["text"]), "invalid_config"),
        "long instructions": (_open_event(instructions="x" * 20_000), "invalid_config"),
    }
    async with grpc.aio.insecure_channel(stack.target) as ch:
        for name, (ev, code) in fatal.items():
            c = Conversation(ch).start(ev)
            await c.wait_done()
            assert c.status == grpc.StatusCode.INVALID_ARGUMENT and c.error is not None, (
                name,
                c.status,
                c.error,
            )
            assert c.error.code == code and len(c.error.message) < SHORT, (name, c.error)
            assert c.events == [], name


async def test_bad_updates_end_to_end_are_error_events_and_the_session_goes_on(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        c = Conversation(ch).start(_open_event(input_format=F32_48K_STEREO.to_proto()))
        opened = (await c.wait_kind("opened")).opened
        # The output defaults to the input's rate with the model's encoding, mono.
        assert PcmFormat.from_proto(opened.config.output_format) == PcmFormat(S16LE, 48000, 1)
        bad = [
            (_update("nan", extra=_struct({"pitch_semitones": math.nan})), "invalid_runtime_config"),
            (_update("deep", extra=_deep(MAX_EXTRA_BODY_DEPTH + 1)), "invalid_runtime_config"),
            (_update("text", modalities=["text"]), "invalid_config"),
            (_update("long", instructions="x" * 300 * 1024), "invalid_config"),
        ]
        for ev, _ in bad:
            c.send(ev)
        c.send(_update("fine", instructions="be brief"))
        updated = await c.wait_kind("updated")
        errors = [(e.error.event_id, e.error.code) for e in c.of("error")]
        assert errors == [(ev.event_id, code) for ev, code in bad]
        assert updated.updated.config.instructions == "be brief"
        assert list(updated.updated.config.modalities) == ["audio"]
        c.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await c.wait_done()
        assert c.status == grpc.StatusCode.OK and c.of("closed")[0].closed.reason == "client_close"


# The gRPC layer parses a message before the handler runs: one that does not parse (not a
# ClientEvent, invalid UTF-8, or nested deeper than protobuf's 100 messages: about 32 extra_body
# levels) raises DecodeError from the read. The servicer reads with ``context.read()``, which
# goes on with the next message, and maps it to invalid_event.


async def test_an_open_that_does_not_parse_is_invalid_event(stack: InProcessStack) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        ev = _open_event()
        _deep(40, into=ev.open.extra_body)  # past the parse depth: gRPC cannot read it
        c = Conversation(ch).start(ev)
        await c.wait_done()
        assert c.status == grpc.StatusCode.INVALID_ARGUMENT and c.error is not None
        assert c.error.code == "invalid_event"


async def test_an_event_that_does_not_parse_is_an_error_event_and_the_session_goes_on(
    stack: InProcessStack,
) -> None:
    async with grpc.aio.insecure_channel(stack.target) as ch:
        c = Conversation(ch).start(_open_event())
        await c.wait_kind("opened")
        deep = _update("deep")
        _deep(40, into=deep.update.extra_body)
        c.send(deep)
        c.send(_update("fine", instructions="be brief"))
        await c.wait_kind("updated", within=3)
        assert [e.error.code for e in c.of("error")] == ["invalid_event"]
        c.send(session_pb2.ClientEvent(close=session_pb2.SessionClose()))
        await c.wait_done()


def test_the_resume_token_json_is_what_instructions_size_measures() -> None:
    for text in ('"\\\n\t\x00\u00e9\U0001f600 x', "plain"):
        assert (
            instructions_size(text)
            == len(json.dumps(text, ensure_ascii=False, separators=(",", ":")).encode()) - 2
        )
