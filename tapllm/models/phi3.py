"""Phi-3 (Phi-3/3.5 mini and medium, Phi-4-mini): a Llama-shaped block over fused checkpoints.

The checkpoint already stores ``qkv_proj`` as [q; k; v] and ``gate_up_proj`` as [gate; up],
our own layouts, so its tensors load as they are. Rotary may be partial
(``partial_rotary_factor``, Phi-4-mini) and may be LongRoPE (``rope_type`` "longrope", the
128k models): transformers rotates a forward with the long factors once the sequence it
covers is longer than ``original_max_position_embeddings``. Here the choice depends on the
request alone, never on how it was scheduled: a position takes the long factors when its
request's prompt is longer than the limit or the position itself is at or past it. That is
exactly transformers running the whole prompt in one forward and then decoding over its KV
cache, and it stays the same under chunked prefill, batching and preemption; the prefix
cache keeps the two regimes apart (``prompt_salt``).
"""

from __future__ import annotations

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNorm
from tapllm.layers.rotary import LongRopeEmbedding, RotaryEmbedding
from tapllm.models.base import Attention, CausalLM, GatedMLP, activation
from tapllm.models.llama import DecoderLayer


class Phi3ForCausalLM(CausalLM):
    """Phi-3: pre-norm blocks, fused qkv and gate/up, SwiGLU, optional partial rotary and LongRoPE."""

    stack_block = DecoderLayer  # untapped blocks of decode steps may run in C++ (models/stack.py)
    fused_blocks = True  # the Llama block hands on a Residual (models/residual.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        rope = hf.rope_parameters
        rotary_dim = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
        if rope.get("rope_type", "default") == "longrope":
            self.rotary: nn.Module = LongRopeEmbedding(hf)
        else:
            self.rotary = RotaryEmbedding(hf, rotary_dim, cfg.max_model_len)
        eps = float(hf.rms_norm_eps)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, Attention(cfg, i, qkv_bias=False, o_bias=False, rotary_dim=rotary_dim),
                         GatedMLP(cfg, activation(cfg.hf_config.hidden_act)))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    @property
    def needs_prompt_lengths(self) -> bool:
        """LongRoPE picks its factors from each row's prompt length (``AttentionMetadata.prompt_lens``)."""
        return isinstance(self.rotary, LongRopeEmbedding)

    def prompt_salt(self, num_prompt: int) -> bytes:
        """KV computed under the long factors is never shared with a request under the short ones."""
        if isinstance(self.rotary, LongRopeEmbedding) and num_prompt > self.rotary.original_max:
            return b"longrope:long"
        return b""

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.rotary, LongRopeEmbedding):
            limit = self.rotary.original_max
            long_rows = (positions >= limit) | (meta.prompt_lens > limit)
            return self.rotary.cos_sin(positions, long_rows, dtype)
        return self.rotary.cos_sin(positions, dtype)
