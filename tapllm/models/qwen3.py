"""Qwen3: the Llama family plus per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from typing import Any

import torch

from tapllm.config import ModelConfig
from tapllm.layers.norm import RMSNorm
from tapllm.models.base import Attention
from tapllm.models.llama import LlamaForCausalLM


class Qwen3Attention(Attention):
    """Attention with q_norm/k_norm over each head's dimension."""

    def __init__(self, cfg: ModelConfig, layer: int, **kwargs: Any) -> None:
        super().__init__(cfg, layer, **kwargs)
        eps = float(cfg.hf_config.rms_norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, eps, cfg.dtype)
        self.k_norm = RMSNorm(cfg.head_dim, eps, cfg.dtype)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder."""

    attention_cls = Qwen3Attention
