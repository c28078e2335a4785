"""Model families, selected by the checkpoint's ``architectures`` entry (``tapllm.config.ARCHITECTURES``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tapllm.config import ARCHITECTURES
from tapllm.models.registry import model_class

if TYPE_CHECKING:
    from torch import nn

    from tapllm.config import ModelConfig

__all__ = ["ARCHITECTURES", "build_model"]


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate (uninitialised) the model class for ``config.architecture``."""
    return model_class(config.architecture)(config)
