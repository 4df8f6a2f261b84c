"""Unit tests (no processes) of the synthetic model's session plugin: the loader accepts it, it
refuses a worker of another model, it validates ``extra_body``, and what it sends is what the
synthetic worker model accepts."""

from __future__ import annotations

import asyncio
import math

import pytest
from google.protobuf import json_format

from duplex.audio import F32LE, PCM16K_MONO
from duplex.errors import ErrorCode
from duplex.v1 import common_pb2, session_pb2, worker_pb2
from session_service.config import RunnerConfig
from session_service.plugin import (
    DuplexModelPlugin,
    Fence,
    PluginLoadError,
    RuntimeConfigError,
    check_worker,
    load_plugin,
    validate_plugin,
)
from session_service.plugins.parrot import ParrotPlugin
from session_service.plugins.synthetic import SyntheticPlugin, SyntheticSampling
from session_service.session.runner import RunnerDeps, SessionRunner
from tests.session_helpers import FakeLink, drain
from worker_service.models.synthetic import SyntheticModel, SyntheticOptions

PATH = "session_service.plugins.synthetic:SyntheticPlugin"
SID = "sess_synth"
FRAME = b"\x10\x00" * 512


def _worker_desc(**kw: object) -> worker_pb2.WorkerDescription:
    base: dict[str, object] = {
        "model_id": SyntheticModel.model_id,
        "frame_samples": SyntheticModel.frame_samples,
        "audio_format": SyntheticModel.audio_format.to_proto(),
    }
    base.update(kw)
    return worker_pb2.WorkerDescription(**base)  # type: ignore[arg-type]


# ---- loader and worker match ------------------------------------------------------------------


@pytest.mark.parametrize("path", [PATH, "session_service.plugins.synthetic.SyntheticPlugin"])
def test_loader_accepts_the_plugin(path: str) -> None:
    plugin = load_plugin(path)
    assert isinstance(plugin, SyntheticPlugin)
    assert plugin.plugin_id == "synthetic" and plugin.model_id == "synthetic"
    validate_plugin(plugin)  # idempotent
    assert plugin.configure_sampling_params(runtime_config={}, defaults=plugin.sampling_defaults) == (
        SyntheticSampling(),
    )


def test_plugin_matches_the_synthetic_worker_model() -> None:
    check_worker(SyntheticPlugin(), _worker_desc())


@pytest.mark.parametrize(
    "desc",
    [
        _worker_desc(model_id="parrot"),
        _worker_desc(model_id=""),
        _worker_desc(frame_samples=480),
        _worker_desc(audio_format=common_pb2.AudioFormat(encoding=F32LE, sample_rate_hz=16000, channels=1)),
    ],
)
def test_worker_of_another_model_or_format_is_refused(desc: worker_pb2.WorkerDescription) -> None:
    with pytest.raises(PluginLoadError) as info:
        check_worker(SyntheticPlugin(), desc)
    assert info.value.code == ErrorCode.MODEL_MISMATCH


def test_the_two_plugins_refuse_each_others_workers() -> None:
    with pytest.raises(PluginLoadError):
        check_worker(ParrotPlugin(), _worker_desc())
    parrot_worker = worker_pb2.WorkerDescription(
        model_id="parrot", frame_samples=512, audio_format=PCM16K_MONO.to_proto()
    )
    with pytest.raises(PluginLoadError):
        check_worker(SyntheticPlugin(), parrot_worker)


def test_no_turn_detection_is_advertised_or_defaulted() -> None:
    plugin = SyntheticPlugin()
    caps = plugin.capabilities(max_sessions=8)
    assert caps.model == "synthetic" and not caps.turn_detection
    assert caps.max_sessions == 8 and PCM16K_MONO in caps.input_formats
    td = plugin.default_settings().turn_detection
    assert not td.auto_respond and not td.barge_in


# ---- extra_body -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [{}, {"reply_frames": 8}, {"reply_frames": 8.0, "emit_every": 3.0}, {"model": "synthetic"}],
)
def test_valid_extra_body(body: dict[str, object]) -> None:
    SyntheticPlugin().validate_client_extra_body(body)


@pytest.mark.parametrize("key", ["hidden_size", "layers", "seed", "_worker_params", "model_path"])
def test_private_runtime_keys_are_refused(key: str) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        SyntheticPlugin().validate_client_extra_body({key: 1, "reply_frames": 4})
    assert info.value.code == ErrorCode.PRIVATE_RUNTIME_KEY


@pytest.mark.parametrize(
    "body",
    [
        {"pitch_semitones": 2.0},  # a parrot option
        {"silence_ms": 500},
        {"auto_commit": False},
        {"reply_frames": 0},
        {"reply_frames": 100_001},
        {"reply_frames": 2.5},
        {"reply_frames": True},
        {"reply_frames": "8"},
        {"reply_frames": None},
        {"reply_frames": math.nan},
        {"reply_frames": math.inf},
        {"emit_every": 0},
        {"emit_every": 1001},
        {"emit_every": [1]},
    ],
)
def test_invalid_extra_body(body: dict[str, object]) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        SyntheticPlugin().validate_client_extra_body(body)
    assert info.value.code == ErrorCode.INVALID_RUNTIME_CONFIG


async def test_runtime_config_and_worker_params() -> None:
    plugin = SyntheticPlugin()
    settings = plugin.default_settings()

    def params(cfg: dict[str, object]) -> dict[str, object]:
        sampling = plugin.configure_sampling_params(runtime_config=cfg, defaults=plugin.sampling_defaults)
        return plugin.worker_params(settings=settings, runtime_config=cfg, sampling=sampling)

    cfg = await plugin.prepare_runtime_config(settings, {})
    assert params(cfg) == {}  # the worker's defaults
    cfg = await plugin.prepare_runtime_config(settings, {"reply_frames": 8.0})
    assert params(cfg) == {"reply_frames": 8}
    cfg = plugin.runtime_config_for_update(settings, cfg, {"emit_every": 2.0})
    assert params(cfg) == {"reply_frames": 8, "emit_every": 2}
    with pytest.raises(RuntimeConfigError):
        plugin.runtime_config_for_update(settings, cfg, {"layers": 9})


async def test_worker_params_are_accepted_by_the_worker_model() -> None:
    # Through the wire form: a Struct on the submission, read back as the worker's servicer does.
    plugin = SyntheticPlugin()
    settings = plugin.default_settings()
    cfg = await plugin.prepare_runtime_config(settings, {"reply_frames": 7.0, "emit_every": 3.0})
    sampling = plugin.configure_sampling_params(runtime_config=cfg, defaults=plugin.sampling_defaults)
    wp = plugin.worker_params(settings=settings, runtime_config=cfg, sampling=sampling)
    sub = plugin.plan_control(
        request_id=SID, fence=Fence(SID, 1, 1), kind=worker_pb2.SUBMISSION_KIND_RESPOND, params=wp
    )
    assert sub.HasField("params")
    defaults = SyntheticOptions(emit_every=1, reply_frames=25)
    opts = SyntheticOptions.parse(json_format.MessageToDict(sub.params), defaults)
    assert opts == SyntheticOptions(emit_every=3, reply_frames=7)
    # No options chosen: the worker's defaults stand.
    assert SyntheticOptions.parse({}, defaults) == defaults


# ---- one runner with a fake worker link -------------------------------------------------------


async def _placer(session_id: str, epoch: int, takeover: bool) -> tuple[object, int]:
    raise AssertionError("not expected")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_runner_drives_manual_turns_with_the_plugin() -> None:
    plugin: DuplexModelPlugin = load_plugin(PATH)
    settings = plugin.default_settings()
    link = FakeLink()
    runner = SessionRunner(
        session_id=SID,
        settings=settings,
        runtime_config=await plugin.prepare_runtime_config(settings, {"reply_frames": 3.0}),
        link=link,  # type: ignore[arg-type]
        epoch=1,
        resume_token="tok",
        deps=RunnerDeps(
            plugin=plugin,
            capabilities=plugin.capabilities(max_sessions=4),
            config=RunnerConfig(),
            placer=_placer,  # type: ignore[arg-type]
        ),
    )
    runner.start()
    try:
        ev = session_pb2.ClientEvent
        await runner.post(ev(append=session_pb2.InputAudioAppend(seq=1, pcm=FRAME * 2)))
        await runner.post(ev(commit=session_pb2.InputAudioCommit()))
        await runner.post(ev(response_create=session_pb2.ResponseCreate()))
        await _settle()
        kinds = [s.kind for s in link.subs]
        assert kinds == [
            worker_pb2.SUBMISSION_KIND_APPEND,
            worker_pb2.SUBMISSION_KIND_COMMIT,
            worker_pb2.SUBMISSION_KIND_RESPOND,
        ]
        assert json_format.MessageToDict(link.subs[0].params) == {"reply_frames": 3.0}
        respond = link.subs[-1]
        assert (respond.fence.epoch, respond.fence.turn_id) == (1, 1)
        # The reply: three frames, the last with response_finished.
        fence = Fence(SID, 1, 1).to_proto()
        for i in range(3):
            upd = worker_pb2.RequestUpdate(
                request_id=SID, fence=fence, response_started=i == 0, response_finished=i == 2
            )
            runner.on_output(fence, common_pb2.AudioPayload(pcm=FRAME), [upd])
        await asyncio.sleep(0.1)  # a few frame periods: nothing more is submitted after the turn
        assert len(link.subs) == 3
        events = drain(runner)
        names = [e.WhichOneof("event") for e in events]
        assert names == [
            "input_ack",
            "committed",
            "response_started",
            "audio_delta",
            "audio_delta",
            "audio_delta",
            "response_done",
        ]
        assert events[-1].response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED
        assert sum(len(e.audio_delta.pcm) for e in events if e.HasField("audio_delta")) == 3 * len(FRAME)
    finally:
        runner.close("test")
        await runner.wait_closed()


async def _fake_placer(session_id: str, epoch: int, takeover: bool):  # type: ignore[no-untyped-def]
    return FakeLink(), epoch


def _manager(plugin: ParrotPlugin):  # type: ignore[no-untyped-def]
    from session_service.config import ServiceConfig
    from session_service.session.manager import SessionManager
    from session_service.workers.step_routing import SessionRegistry

    cfg = ServiceConfig(plugin="x", workers=("fake:1",))
    return SessionManager(plugin=plugin, config=cfg, registry=SessionRegistry(), placer=_fake_placer)


def _open(**turn: bool) -> session_pb2.SessionOpen:
    msg = session_pb2.SessionOpen(config=session_pb2.SessionConfig(input_format=PCM16K_MONO.to_proto()))
    if turn:
        msg.config.turn_detection.CopyFrom(session_pb2.TurnDetection(**turn))
    return msg


async def test_open_takes_the_plugins_turn_detection_defaults() -> None:
    """No turn_detection in open: the plugin decides (parrot: server turns; synthetic: manual)."""
    parrot = await _manager(ParrotPlugin()).open(_open())
    synthetic = await _manager(SyntheticPlugin()).open(_open())
    try:
        assert parrot.settings.turn_detection.auto_respond and parrot.settings.turn_detection.barge_in
        assert not synthetic.settings.turn_detection.auto_respond
        assert not synthetic.settings.turn_detection.barge_in
    finally:
        for r in (parrot, synthetic):
            r.close("client_close")


async def test_open_refuses_server_turns_for_a_model_without_turn_detection() -> None:
    from duplex.errors import BadRequestError

    with pytest.raises(BadRequestError) as err:
        await _manager(SyntheticPlugin()).open(_open(auto_respond=True))
    assert err.value.code == ErrorCode.INVALID_CONFIG


def test_only_lockstep_plugins_get_silence_fed() -> None:
    assert ParrotPlugin.silence_continuation and not SyntheticPlugin.silence_continuation
