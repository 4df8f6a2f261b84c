"""The Moshi family (model-native full duplex) on Kyutai's ``moshi`` package: ``MoshiModel`` (the
model in batch slots, ``model``), its speech spans (``spans``) and checkpoints (``checkpoint``)."""

from __future__ import annotations

from worker_service.models.moshi.checkpoint import checkpoint_info, write_small_checkpoint
from worker_service.models.moshi.model import FRAME, PCM24K_MONO, MoshiModel

__all__ = ["FRAME", "PCM24K_MONO", "MoshiModel", "checkpoint_info", "write_small_checkpoint"]
