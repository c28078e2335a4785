"""OLMo-2: no pre-norms; RMSNorm after each sublayer, before it joins the residual stream.

``attn_out`` and ``mlp_out`` are the post-sublayer norms' outputs (what is added to the
residual stream). q and k are normalised over the whole projection (all heads at once,
before the head split), and rotary is computed in float32, as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNormScaledInFloat32
from tapllm.layers.rotary import RotaryEmbedding
from tapllm.models.base import Attention, CausalLM, GatedMLP, KVCache, activation, gate_up_fused, qkv_fused
from tapllm.tap import Tap


class Olmo2Attention(Attention):
    """Attention with q_norm over ``H*D`` and k_norm over ``Hkv*D``."""

    qk_norm_spans_heads = True  # split over tensor-parallel ranks, the norms need every rank's heads

    def __init__(self, cfg: ModelConfig, layer: int, **kwargs: Any) -> None:
        super().__init__(cfg, layer, **kwargs)
        eps = float(cfg.hf_config.rms_norm_eps)
        self.q_norm = RMSNormScaledInFloat32(self.q_size, eps, cfg.dtype)
        self.k_norm = RMSNormScaledInFloat32(self.kv_size, eps, cfg.dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block: each sublayer reads the stream unnormalised; its normed output is added."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = float(cfg.hf_config.rms_norm_eps)
        bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        self.self_attn = Olmo2Attention(cfg, layer, qkv_bias=bias, o_bias=bias)
        self.post_attention_layernorm = RMSNormScaledInFloat32(cfg.hidden_size, eps, cfg.dtype)
        self.mlp = GatedMLP(cfg, activation(cfg.hf_config.hidden_act))
        self.post_feedforward_layernorm = RMSNormScaledInFloat32(cfg.hidden_size, eps, cfg.dtype)

    def forward(self, x: torch.Tensor, i: int, tap: Tap, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = tap("resid_pre", i, x)
        a = tap("attn_out", i, self.post_attention_layernorm(self.self_attn(x, cos_sin, kv, meta, tap, i)))
        mid = tap("resid_mid", i, x + a)
        m = tap("mlp_out", i, self.post_feedforward_layernorm(self.mlp(mid, tap, i)))
        return tap("resid_post", i, mid + m)


class Olmo2ForCausalLM(CausalLM):
    """OLMo-2 (1B-32B): post-sublayer norms, whole-projection q/k norm, SwiGLU, untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        self.rotary = RotaryEmbedding(hf, cfg.head_dim, cfg.max_model_len)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNormScaledInFloat32(cfg.hidden_size, float(hf.rms_norm_eps), cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, torch.float32)  # rotated in float32, cast back (see apply_rotary)

    def fused(self) -> list[tuple[str, str, int]]:
        return qkv_fused(self.cfg) + gate_up_fused(int(self.cfg.hf_config.intermediate_size))
