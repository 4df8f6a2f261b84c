"""What the calls need to know of the server's lifecycle, and the gate each of them passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duplex.errors import ErrorCode, UnavailableError
from worker_service.model import StepModel


@dataclass
class ServingState:
    """What the calls need to know about the server's lifecycle (the server sets it)."""

    model: StepModel[Any] | None = None
    """Set once the model is loaded (the worker serves from then on)."""
    draining: bool = False
    failed: bool = False

    def serving_model(self) -> StepModel[Any]:
        """The model, while the worker takes work; else the reason it does not (UNAVAILABLE)."""
        if self.failed:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the worker's engine failed")
        if self.draining:
            raise UnavailableError(ErrorCode.DRAINING, "the worker is draining")
        if self.model is None:
            raise UnavailableError(ErrorCode.WORKER_UNAVAILABLE, "the worker is still loading its model")
        return self.model
