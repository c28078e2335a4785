"""OLMoE: a pre-norm block whose q and k are normalised over the whole projection (all heads at
once, as OLMo-2 does, but with the Llama norm's rounding), optionally clipped (``clip_qkv``), and
whose MLP is a sparse mixture of experts (renormalised only with ``norm_topk_prob``)."""

from __future__ import annotations

from typing import Any

import torch

from tapllm.config import ModelConfig
from tapllm.layers.norm import RMSNorm
from tapllm.models.base import Attention
from tapllm.models.moe import MoEForCausalLM, Routing


class OlmoeAttention(Attention):
    """Attention with q_norm over ``H*D`` and k_norm over ``Hkv*D``, then q, k and v clipped."""

    qk_norm_spans_heads = True

    def __init__(self, cfg: ModelConfig, layer: int, **kwargs: Any) -> None:
        super().__init__(cfg, layer, **kwargs)
        eps = float(cfg.hf_config.rms_norm_eps)
        self.q_norm = RMSNorm(self.q_size, eps, cfg.dtype)
        self.k_norm = RMSNorm(self.kv_size, eps, cfg.dtype)
        clip = getattr(cfg.hf_config, "clip_qkv", None)
        self.clip_qkv = float(clip) if clip is not None else None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class OlmoeForCausalLM(MoEForCausalLM):
    """OLMoE-1B-7B: 64 experts, top-8, every block sparse."""

    attention_cls = OlmoeAttention

    def routing(self) -> Routing:
        hf = self.cfg.hf_config
        return Routing(int(hf.num_experts), int(hf.num_experts_per_tok), renormalize=bool(hf.norm_topk_prob))
