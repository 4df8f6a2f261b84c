"""The model registry: name -> factory. A new model adds one line here and touches nothing else."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from duplex.errors import BadRequestError, DuplexError, ErrorCode
from worker_service.model import StepModel

ModelFactory = Callable[[torch.device, Mapping[str, object]], StepModel[Any]]


def _parrot(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.parrot import ParrotModel

    # Options come from the command line untyped; the model checks each (TypeError/ValueError).
    return ParrotModel(device, **options)  # type: ignore[arg-type]  # see above


def _synthetic(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.synthetic import SyntheticModel

    # As for parrot: the model checks its options itself.
    return SyntheticModel(device, **options)  # type: ignore[arg-type]  # see above


def _null(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.null import NullModel

    return NullModel(device, **options)


def _moshi(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.moshi.checkpoint import import_moshi

    import_moshi()  # a missing package says how to install it, not where it failed to import
    from worker_service.models.moshi.model import MoshiModel

    # As for parrot: the model checks its options itself.
    return MoshiModel(device, **options)  # type: ignore[arg-type]  # see above


def _asr(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.asr import AsrModel

    return AsrModel(device, **options)  # type: ignore[arg-type]  # the model checks them


def _responder(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.responder import ResponderModel

    return ResponderModel(device, **options)  # type: ignore[arg-type]  # the model checks them


def _chat(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.chat import ChatModel

    return ChatModel(device, **options)  # type: ignore[arg-type]  # the model checks them


def _tts(device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    from worker_service.models.tts import TtsModel

    return TtsModel(device, **options)  # type: ignore[arg-type]  # the model checks them


MODELS: dict[str, ModelFactory] = {
    "asr": _asr,
    "chat": _chat,
    "moshi": _moshi,
    "responder": _responder,
    "tts": _tts,
    "null": _null,
    "parrot": _parrot,
    "synthetic": _synthetic,
}


def create_model(name: str, device: torch.device, options: Mapping[str, object]) -> StepModel[Any]:
    """Build a registered model on ``device``; unknown names and bad options are BadRequestError."""
    factory = MODELS.get(name)
    if factory is None:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"unknown model {name!r}; known: {sorted(MODELS)}")
    try:
        return factory(device, options)
    except (TypeError, ValueError, DuplexError) as exc:
        raise BadRequestError(ErrorCode.INVALID_CONFIG, f"bad options for model {name!r}: {exc}") from exc
