"""Llama family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/2.5 with qkv bias).

Each block's forward reads like its math and passes every residual-stream point through
the step's tap, which steers and then records the rows of the requests that asked; a block's
residual adds are done by the norms that read them (:mod:`tapllm.models.residual`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNorm
from tapllm.layers.rotary import RotaryEmbedding
from tapllm.models.base import Attention, CausalLM, GatedMLP, KVCache, gate_up_fused, qkv_fused
from tapllm.models.residual import Residual, add_norm
from tapllm.tap import Tap


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then MLP, each added to the residual stream.

    The block takes the residual as the previous block (or the embedding) left it, its end add
    and taps still pending, and hands on its own likewise (:mod:`tapllm.models.residual`): each
    norm does the add before it, so a block is one norm-and-add per half.
    """

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        eps = float(cfg.hf_config.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.mlp = mlp

    def forward(self, res: Residual, i: int, tap: Tap, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache,
                meta: AttentionMetadata) -> Residual:
        x, h = add_norm(self.input_layernorm, tap, res, (("resid_pre", i),))
        a = self.self_attn(h, cos_sin, kv, meta, tap, i)
        mid, h = add_norm(self.post_attention_layernorm, tap, Residual(x, a, (("attn_out", i),)), (("resid_mid", i),))
        m = self.mlp(h, tap, i)
        return Residual(mid, m, (("mlp_out", i),), (("resid_post", i),))


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 (qkv bias) and, through ``attention_cls``, Qwen3."""

    attention_cls: type[Attention] = Attention
    stack_block = DecoderLayer  # untapped blocks of decode steps may run in C++ (models/stack.py)
    fused_blocks = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        self.rotary = RotaryEmbedding(hf, cfg.head_dim, cfg.max_model_len)
        qkv_bias, o_bias = self.attention_biases()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.attention_cls(cfg, i, qkv_bias=qkv_bias, o_bias=o_bias),
                         self.block_mlp(i))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, float(hf.rms_norm_eps), cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def block_mlp(self, layer: int) -> nn.Module:
        """Block ``layer``'s MLP: a gated SiLU MLP here (mixture-of-experts families return their sparse block)."""
        return GatedMLP(self.cfg, F.silu, bool(getattr(self.cfg.hf_config, "mlp_bias", False)))

    def attention_biases(self) -> tuple[bool, bool]:
        """(q/k/v bias, output bias) as the family's config declares them."""
        if self.cfg.architecture == "Qwen2ForCausalLM":
            return True, False
        bias = bool(getattr(self.cfg.hf_config, "attention_bias", False))
        return bias, bias

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, dtype)

    def fused(self) -> list[tuple[str, str, int]]:
        return qkv_fused(self.cfg) + gate_up_fused(int(self.cfg.hf_config.intermediate_size))
