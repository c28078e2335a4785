"""GPT-NeoX / Pythia: partial rotary, LayerNorm with bias, ungated GELU MLP, parallel or sequential residual.

With ``use_parallel_residual`` (Pythia's default) attention and MLP both read the block
input ``x`` and the block returns ``x + attn_out + mlp_out``. ``resid_mid`` there is
``resid_pre + attn_out``, as TransformerLens defines it: no MLP reads it, and steering it
changes the block's output (which is ``resid_mid + mlp_out``). Without it the block is the
usual sequential pre-norm block. ``attn_out`` is the output of ``attention.dense`` (bias
included), ``mlp_out`` that of ``dense_4h_to_h``; ``final`` is ``final_layer_norm``'s output.

Rotary turns the first ``rotary_pct`` (transformers 5: ``rope_parameters
["partial_rotary_factor"]``) of each head's dims, rotate-half layout, the rest pass
through. The checkpoint's ``query_key_value`` interleaves q, k, v per head (rows
``[h0 q, h0 k, h0 v, h1 q, ...]``); loading reorders it (weight and bias) into
``qkv_proj``'s ``[q; k; v]``. The untied head is ``embed_out`` (``lm_head`` in transformers
5's module names).
"""

from __future__ import annotations

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import LayerNorm
from tapllm.layers.rotary import RotaryEmbedding
from tapllm.models.base import MLP, Attention, CausalLM, KVCache, Placement, activation
from tapllm.tap import Tap


def rotary_dims(cfg: ModelConfig) -> int:
    """How many dims of each head rotary turns (transformers truncates ``head_dim * factor``)."""
    params = getattr(cfg.hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg.hf_config, "rotary_pct", 1.0))
    return int(cfg.head_dim * float(factor))


class GPTNeoXLayer(nn.Module):
    """Pre-norm block; parallel (``x + attn(ln1(x)) + mlp(ln2(x))``) or sequential residual."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = float(hf.layer_norm_eps)
        bias = bool(getattr(hf, "attention_bias", True))
        self.parallel = bool(hf.use_parallel_residual)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps, cfg.dtype)
        self.attention = Attention(cfg, layer, qkv_bias=bias, o_bias=bias, rotary_dim=rotary_dims(cfg))
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps, cfg.dtype)
        self.mlp = MLP(cfg, activation(hf.hidden_act), True, int(hf.intermediate_size))

    def forward(self, x: torch.Tensor, i: int, tap: Tap, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = tap("resid_pre", i, x)
        a = tap("attn_out", i, self.attention(self.input_layernorm(x), cos_sin, kv, meta, tap, i))
        mid = tap("resid_mid", i, x + a)
        m = tap("mlp_out", i, self.mlp(self.post_attention_layernorm(x if self.parallel else mid), tap, i))
        return tap("resid_post", i, mid + m)


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX and Pythia."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        self.rotary = RotaryEmbedding(hf, rotary_dims(cfg), cfg.max_model_len)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(GPTNeoXLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = LayerNorm(cfg.hidden_size, float(hf.layer_norm_eps), cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, dtype)

    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> Placement:
        if name in ("embed_out.weight", "lm_head.weight"):
            return [("lm_head.weight", None, tensor)]
        name = name.removeprefix("gpt_neox.")
        if name == "embed_in.weight":
            return [("embed_tokens.weight", None, tensor)]
        if name.startswith("final_layer_norm."):
            return [(name.replace("final_layer_norm", "norm"), None, tensor)]
        if not name.startswith("layers."):
            return []
        if ".attention.query_key_value." in name:
            # [heads, (q, k, v), head_dim, ...] -> [(q, k, v), heads, head_dim, ...]
            h, d = self.cfg.num_heads, self.cfg.head_dim
            tensor = tensor.reshape(h, 3, d, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
            return [(name.replace("query_key_value", "qkv_proj"), None, tensor)]
        name = name.replace(".attention.dense.", ".attention.o_proj.")
        name = name.replace(".mlp.dense_h_to_4h.", ".mlp.up_proj.").replace(".mlp.dense_4h_to_h.", ".mlp.down_proj.")
        if name.endswith((".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")):
            return []  # buffers of old checkpoints
        return [(name, None, tensor)]
