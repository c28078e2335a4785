"""Random weights instead of a checkpoint (``load_format="dummy"``, as vLLM names it): for benchmarks
of a model's shape, from its config alone, with nothing to download or read."""

from __future__ import annotations

import torch
from torch import nn

from tapllm.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` in place, on its device: matrices ~ N(0, 0.02^2), norm
    scales 1 (0 for Gemma's norms, which store the scale minus one), biases 0."""
    index = 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            index += 1
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=torch.Generator(param.device).manual_seed(seed * 100003 + index))
            elif name == "weight" and isinstance(module, RMSNorm | LayerNorm):
                param.fill_(0.0 if isinstance(module, GemmaRMSNorm) else 1.0)
            else:
                param.zero_()
