"""The duplex model plugin contract, its loader, and the PCM append buffer most plugins share.

One plugin object per model binds session policy (capabilities, client ``extra_body``
validation, runtime config, per-session model state) and engine policy (sampling params,
append planning into worker submissions, output decisions, data-plane projection, model
context commits), so the two halves cannot disagree. The model itself runs in a worker that
advertises a ``model_id``; the plugin refuses any other.

Everything a plugin author needs is importable from here; the private modules hold the parts:
``_types`` (capabilities, settings, decisions), ``_pcm_buffer`` (client PCM to worker frames),
``_data_plane`` (step outputs to client events), ``_stages`` (models served in stages),
``_base`` (the plugin class and its per-session state), ``_loader`` (loading and validation),
``_errors``.
"""

from duplex.fence import Fence
from session_service.plugin._base import DuplexModelPlugin, ModelSessionState, ReplayStep
from session_service.plugin._data_plane import DataPlane, PcmDataPlane, ResponseProjection
from session_service.plugin._errors import PluginLoadError, RuntimeConfigError, reject_private_runtime_keys
from session_service.plugin._loader import check_worker, load_plugin, validate_plugin
from session_service.plugin._pcm_buffer import AppendReservation, FramePacketizer, PcmAppendBuffer
from session_service.plugin._stages import Flow, Stage, split_sentences
from session_service.plugin._types import (
    Capabilities,
    OutputAction,
    OutputDecision,
    SessionSettings,
    TurnDetection,
)

__all__ = [
    "AppendReservation",
    "Capabilities",
    "DataPlane",
    "DuplexModelPlugin",
    "Fence",
    "Flow",
    "FramePacketizer",
    "ModelSessionState",
    "OutputAction",
    "OutputDecision",
    "PcmAppendBuffer",
    "PcmDataPlane",
    "PluginLoadError",
    "ReplayStep",
    "ResponseProjection",
    "RuntimeConfigError",
    "SessionSettings",
    "Stage",
    "TurnDetection",
    "check_worker",
    "load_plugin",
    "reject_private_runtime_keys",
    "split_sentences",
    "validate_plugin",
]
