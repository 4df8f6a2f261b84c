"""Loading a plugin by dotted path, validating its contract, and checking a worker against it."""

from __future__ import annotations

import importlib

from duplex.audio import PcmFormat
from duplex.errors import BadEventError, ErrorCode
from duplex.v1 import worker_pb2
from session_service.plugin._base import DuplexModelPlugin
from session_service.plugin._data_plane import DataPlane
from session_service.plugin._errors import PluginLoadError


def load_plugin(path: str) -> DuplexModelPlugin:
    """Import ``module:Class`` (or ``module.Class``), instantiate it and validate the contract."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, sep, attr = path.rpartition(".")
    if not sep or not module_name or not attr:
        raise PluginLoadError(f"invalid plugin path {path!r}: expected module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginLoadError(f"unknown plugin {path!r}: cannot import {module_name!r} ({exc})") from exc
    plugin_type = getattr(module, attr, None)
    if plugin_type is None:
        raise PluginLoadError(f"unknown plugin {path!r}: {module_name!r} has no {attr!r}")
    if not isinstance(plugin_type, type) or not issubclass(plugin_type, DuplexModelPlugin):
        raise PluginLoadError(f"{path!r} is not a DuplexModelPlugin subclass")
    try:
        plugin = plugin_type()
    except Exception as exc:
        raise PluginLoadError(f"{path!r} failed to construct: {exc}") from exc
    validate_plugin(plugin)
    return plugin


def validate_plugin(plugin: DuplexModelPlugin) -> None:
    """Fail fast on a plugin that breaks the contract (raises ``PluginLoadError``)."""
    name = type(plugin).__name__
    if not isinstance(plugin.plugin_id, str) or not plugin.plugin_id:
        raise PluginLoadError(f"plugin {name} must declare plugin_id")
    if not plugin.model_id:
        plugin.model_id = plugin.plugin_id
    if not isinstance(getattr(plugin, "data_plane", None), DataPlane):
        raise PluginLoadError(f"plugin {name} must declare a DataPlane as data_plane")
    if not isinstance(plugin.worker_format, PcmFormat):
        raise PluginLoadError(f"plugin {name} must declare worker_format as a PcmFormat")
    if not isinstance(plugin.frame_samples, int) or plugin.frame_samples <= 0:
        raise PluginLoadError(f"plugin {name} must declare a positive frame_samples")
    if plugin.model_native and plugin.replayable:
        # Its state is the whole conversation: replaying a turn's input cannot rebuild it.
        raise PluginLoadError(f"plugin {name}: a model-native model cannot be replayable")
    defaults = plugin.sampling_defaults
    if not isinstance(defaults, tuple) or not defaults:
        raise PluginLoadError(f"plugin {name} must declare sampling_defaults, one per stage")
    configured = plugin.configure_sampling_params(runtime_config={}, defaults=defaults)
    if not isinstance(configured, tuple):
        raise PluginLoadError(f"plugin {name} must return sampling parameters as a tuple")
    if len(configured) != len(defaults):
        raise PluginLoadError(
            f"plugin {name} must return one sampling parameter per stage "
            f"({len(defaults)} stages, got {len(configured)})"
        )
    for stage, (value, default) in enumerate(zip(configured, defaults, strict=True)):
        if default is not None and not isinstance(value, type(default)):
            raise PluginLoadError(
                f"plugin {name} sampling parameter type mismatch for stage {stage}: "
                f"expected {type(default).__name__}, got {type(value).__name__}"
            )


def check_worker(plugin: DuplexModelPlugin, desc: worker_pb2.WorkerDescription) -> None:
    """Refuse a worker that serves another model or another frame format."""
    if desc.model_id != plugin.model_id:
        raise PluginLoadError(
            f"worker serves model {desc.model_id!r}, plugin {plugin.plugin_id!r} needs {plugin.model_id!r}",
            code=ErrorCode.MODEL_MISMATCH,
        )
    if desc.frame_samples and desc.frame_samples != plugin.frame_samples:
        raise PluginLoadError(
            f"worker frame is {desc.frame_samples} samples, plugin needs {plugin.frame_samples}",
            code=ErrorCode.MODEL_MISMATCH,
        )
    if desc.HasField("audio_format"):
        try:
            fmt = PcmFormat.from_proto(desc.audio_format)
        except BadEventError as exc:
            raise PluginLoadError(f"worker audio format: {exc}", code=ErrorCode.MODEL_MISMATCH) from exc
        if fmt != plugin.worker_format:
            raise PluginLoadError(
                f"worker audio is {fmt}, plugin needs {plugin.worker_format}", code=ErrorCode.MODEL_MISMATCH
            )
