"""Phi-3 (Phi-3/3.5 mini and medium, Phi-4-mini): a Llama-shaped block over fused checkpoints.

The checkpoint already stores ``qkv_proj`` as [q; k; v] and ``gate_up_proj`` as [gate; up],
our own layouts, so its tensors load as they are. Rotary may be partial
(``partial_rotary_factor``, Phi-4-mini) and may be LongRoPE (``rope_type`` "longrope", the
128k models): transformers rotates a whole forward with the long factors once its positions
reach past ``original_max_position_embeddings``. Here a step plays the part of that
forward, sequence by sequence: a row takes the long factors when its sequence's last
position in this step is at or past the limit. Keys already in the cache keep the factors
they were computed with, exactly as in a transformers forward over its KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNorm
from tapllm.layers.rotary import LongRopeEmbedding, RotaryEmbedding
from tapllm.models.base import Attention, CausalLM, GatedMLP, activation
from tapllm.models.llama import DecoderLayer


def sequence_last_positions(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """For each row of the step, the last position its sequence reaches in this step.

    A sequence's rows are contiguous with consecutive positions. A new sequence starts at
    each decode row (rows ``[0, num_decodes)``, one sequence each), at the first row after
    them, at each chunk that continues a cached context (``meta.prefills``), and wherever
    the position is 0 (a fresh prompt, alone or in a group).
    """
    t = positions.shape[0]
    first = positions == 0
    first[: meta.num_decodes + 1] = True
    for chunk in meta.prefills:
        first[chunk.start] = True
    seq = first.long().cumsum(0) - 1
    last = torch.zeros(t, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, seq, positions, reduce="amax", include_self=False)
    return last[seq]


class Phi3ForCausalLM(CausalLM):
    """Phi-3: pre-norm blocks, fused qkv and gate/up, SwiGLU, optional partial rotary and LongRoPE."""

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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, Attention(cfg, i, qkv_bias=False, o_bias=False, rotary_dim=rotary_dim),
                         GatedMLP(cfg, activation(cfg.hf_config.hidden_act)))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.rotary, LongRopeEmbedding):
            long_rows = sequence_last_positions(positions, meta) >= self.rotary.original_max
            return self.rotary.cos_sin(positions, long_rows, dtype)
        return self.rotary.cos_sin(positions, dtype)
