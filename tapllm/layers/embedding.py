"""An embedding table whose rows come from a checkpoint."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, dim: int, dtype: torch.dtype) -> nn.Embedding:
    """A frozen ``nn.Embedding`` on uninitialised storage: its random initialisation (what
    ``nn.Embedding`` does by default) would be overwritten by the checkpoint anyway, and for a
    large vocabulary it costs a noticeable share of a small model's start."""
    weight = torch.empty(num_embeddings, dim, dtype=dtype)
    return nn.Embedding(num_embeddings, dim, _weight=weight, _freeze=True, dtype=dtype)
