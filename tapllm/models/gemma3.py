"""Gemma-3 (text): Gemma-2's block plus (1 + weight) RMSNorm on q and k per head before rotary,
and two rotary tables: local (sliding-window) layers and global layers each have their own
``rope_parameters`` entry (base 10k and 1M by default; rope scaling only on global layers).

Points are Gemma-2's (see :mod:`tapllm.models.gemma2`). As in transformers, attention logits
are never soft-capped (``attn_logit_softcapping`` is not used); final logits are where the
config sets ``final_logit_softcapping``.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.config import ModelConfig
from tapllm.layers.norm import GemmaRMSNorm
from tapllm.models.base import Attention
from tapllm.models.gemma2 import Gemma2ForCausalLM


class Gemma3Attention(Attention):
    """Attention with q_norm/k_norm, Gemma RMSNorms over each head's dimension."""

    def __init__(self, cfg: ModelConfig, layer: int, **kwargs: Any) -> None:
        super().__init__(cfg, layer, **kwargs)
        eps = float(cfg.hf_config.rms_norm_eps)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, eps, cfg.dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, eps, cfg.dtype)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma-3 text decoder (``Gemma3TextConfig``, model_type ``gemma3_text``)."""

    def attention(self, cfg: ModelConfig, layer: int, bias: bool) -> Attention:
        scale = float(cfg.hf_config.query_pre_attn_scalar) ** -0.5
        return Gemma3Attention(cfg, layer, qkv_bias=bias, o_bias=bias, scale=scale)

    def rope_kinds(self) -> dict[str, str | None]:
        return {t: t for t in sorted(set(self.cfg.hf_config.layer_types))}

    def rope_kind(self, layer: int) -> str:
        return self.cfg.hf_config.layer_types[layer]
