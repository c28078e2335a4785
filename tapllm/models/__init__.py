"""Model families, selected by the checkpoint's ``architectures`` entry (see ``registry.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tapllm.models.registry import ARCHITECTURES, model_class

if TYPE_CHECKING:
    from torch import nn

    from tapllm.config import ModelConfig

__all__ = ["ARCHITECTURES", "build_model"]


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate (uninitialised) the model class for ``config.architecture``."""
    return model_class(config.architecture)(config)
