"""Hostile client input gets a stable code, never INTERNAL/UNKNOWN: NaN and infinities, deep
nesting, huge strings, wrong types, modalities the model cannot produce, instructions too long
for a resume token, and the output format's default.

At three levels: the wire settings (``session_service.settings``) and ``SessionManager`` (opens,
call-ending: INVALID_ARGUMENT), one runner with a fake worker link (later events: an ``error``
event, the session goes on), and end to end against the in-process stack. A client value quoted
in a message is bounded and escaped (``duplex.errors.echo``), so a status always fits in the
trailers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from duplex.audio import F32LE, PCM16K_MONO, S16LE, PcmFormat
from duplex.errors import (
    MAX_ECHO_CHARS,
    MAX_STATUS_MESSAGE_BYTES,
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
from session_service.resume import ResumeKeys
from session_service.routing import SessionRegistry
from session_service.runner import RunnerDeps, SessionRunner, WorkerHandle
from session_service.sessions import SessionManager
from session_service.settings import (
    settings_from_proto,
)
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


# ---- modalities, formats, turn detection, instructions (wire settings) ---------------------------


PARROT_CAPS = ParrotPlugin().capabilities(max_sessions=1)


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


# ---- opens (SessionManager): call-ending INVALID_ARGUMENT ------------------------------------


class _Placer:
    def __init__(self) -> None:
        self.link = FakeLink()

    async def __call__(self, session_id: str, epoch: int, takeover: bool) -> tuple[WorkerHandle, int]:
        return self.link, epoch


def _manager(plugin: DuplexModelPlugin | None = None, keys: ResumeKeys | None = None) -> SessionManager:
    plugin = plugin or ParrotPlugin()
    cfg = ServiceConfig(
        plugin=plugin.plugin_id,
        workers=("fake:1",),
        resume_keys=keys or ResumeKeys.single(b"s" * 32),
        max_sessions=8,
    )
    return SessionManager(plugin=plugin, config=cfg, registry=SessionRegistry(), placer=_Placer())


def _open(
    *, model: str = "parrot", extra: struct_pb2.Struct | None = None, **cfg: Any
) -> session_pb2.SessionOpen:
    cfg.setdefault("input_format", PCM16K_MONO.to_proto())
    msg = session_pb2.SessionOpen(model=model, config=_cfg(**cfg))
    if extra is not None:
        msg.extra_body.CopyFrom(extra)
    return msg


BAD_OPENS: dict[str, tuple[session_pb2.SessionOpen, str]] = {
    "wrong type": (_open(extra=_struct({"pitch_semitones": {"a": [1]}})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "null": (_open(extra=_struct({"silence_ms": None})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "huge key": (_open(extra=_struct({"k" * 15_000: 1})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "huge model": (_open(model="m" * 100_000), ErrorCode.MODEL_MISMATCH),
    "odd model": (_open(model="\x00\n\u202e" * 50), ErrorCode.MODEL_MISMATCH),
    "huge extra_body.model": (_open(extra=_struct({"model": "m" * 15_000})), ErrorCode.MODEL_MISMATCH),
    "list extra_body.model": (_open(extra=_struct({"model": ["parrot"] * 1000})), ErrorCode.MODEL_MISMATCH),
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
    "huge key": (_update("u", extra=_struct({"k" * 15_000: 1})), ErrorCode.INVALID_RUNTIME_CONFIG),
    "wrong type": (_update("u", extra=_struct({"pitch_semitones": "5"})), ErrorCode.INVALID_RUNTIME_CONFIG),
}


# ---- end to end ---------------------------------------------------------------------------------


def _open_event(**kw: Any) -> session_pb2.ClientEvent:
    extra = kw.pop("extra", None)
    ev = session_pb2.ClientEvent(event_id="open", open=_open(**kw))
    if extra is not None:
        ev.open.extra_body.CopyFrom(extra)
    return ev


async def test_bad_opens_end_to_end_get_invalid_argument_with_their_code(stack: InProcessStack) -> None:
    fatal = {
        "15 KB key": (_open_event(extra=_struct({"k" * 15_000: 1})), "invalid_runtime_config"),
        "100 KB model": (_open_event(model="m" * 100_000), "model_mismatch"),
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


# The gRPC layer parses a message before the handler runs: one that does not parse (not a
# ClientEvent, or nested deeper than protobuf's 100 messages: about 32 extra_body levels) fails
# in the request iterator. Mapping that to invalid_event is the servicer's (see the change this
# branch's report proposes); until it lands these are expected to fail.
_SERVICER_DECODE = pytest.mark.xfail(
    strict=True, reason="needs the servicer to map a DecodeError of a client message to invalid_event"
)
