"""What a caller can hook into a training run without touching the trainer's code."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


class Callback:
    """Override the moments you need; every method does nothing by default."""

    def on_model_built(self, model: nn.Module) -> None:
        """The model exists on its device, before precision recipes and graphs."""

    def on_step_end(self, iteration: int) -> None:
        """The optimizer step of `iteration` (1-based) is done, before logging and validation."""
