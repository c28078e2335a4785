"""GPT-2: learned absolute positions, LayerNorm with bias, ungated GELU MLP, no rotary.

The points: ``embed`` is token plus position embedding (the residual stream entering block
0); each block is pre-norm and sequential (``resid_mid = resid_pre + attn_out``);
``attn_out``/``mlp_out`` are the outputs of ``c_proj`` with their biases; ``final`` is
``ln_f``'s output, which the (tied) unembedding reads.

Checkpoints store the projections as ``Conv1D`` weights, ``[in, out]``: they are transposed
on loading. ``c_attn`` holds q, k and v stacked along its output, the layout of our
``qkv_proj``. Names come with or without the ``transformer.`` prefix (save_pretrained vs the
original hub files); the causal-mask buffers old checkpoints carry (``attn.bias``,
``attn.masked_bias``) are skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import LayerNorm
from tapllm.models.base import MLP, Attention, CausalLM, KVCache, Placement, activation
from tapllm.tap import Tap


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = float(hf.layer_norm_epsilon)
        scale = cfg.head_dim**-0.5 if hf.scale_attn_weights else 1.0
        if hf.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        # reorder_and_upcast_attn only changes numerics in mixed precision: scores here are
        # computed by SDPA or in float32 (decode), which is what that option is for.
        inner = hf.n_inner if hf.n_inner is not None else 4 * cfg.hidden_size
        self.ln_1 = LayerNorm(cfg.hidden_size, eps, cfg.dtype)
        self.attn = Attention(cfg, layer, qkv_bias=True, o_bias=True, scale=scale, rotary_dim=0)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps, cfg.dtype)
        self.mlp = MLP(cfg, activation(hf.activation_function), True, int(inner))

    def forward(self, x: torch.Tensor, i: int, tap: Tap, ctx: None, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = tap("resid_pre", i, x)
        a = tap("attn_out", i, self.attn(self.ln_1(x), None, kv, meta, tap, i))
        mid = tap("resid_mid", i, x + a)
        m = tap("mlp_out", i, self.mlp(self.ln_2(mid), tap, i))
        return tap("resid_post", i, mid + m)


# checkpoint name after "h.N." -> (our name after "layers.N.", stored as Conv1D [in, out])
_BLOCK = {
    "ln_1.weight": ("ln_1.weight", False), "ln_1.bias": ("ln_1.bias", False),
    "ln_2.weight": ("ln_2.weight", False), "ln_2.bias": ("ln_2.bias", False),
    "attn.c_attn.weight": ("attn.qkv_proj.weight", True), "attn.c_attn.bias": ("attn.qkv_proj.bias", False),
    "attn.c_proj.weight": ("attn.o_proj.weight", True), "attn.c_proj.bias": ("attn.o_proj.bias", False),
    "mlp.c_fc.weight": ("mlp.up_proj.weight", True), "mlp.c_fc.bias": ("mlp.up_proj.bias", False),
    "mlp.c_proj.weight": ("mlp.down_proj.weight", True), "mlp.c_proj.bias": ("mlp.down_proj.bias", False),
}
_TOP = {"wte.weight": "embed_tokens.weight", "wpe.weight": "embed_positions.weight",
        "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias", "lm_head.weight": "lm_head.weight"}


class GPT2LMHeadModel(CausalLM):
    """GPT-2 (and checkpoints in its layout, e.g. DistilGPT2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.embed_positions = embedding(int(hf.n_positions), cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = LayerNorm(cfg.hidden_size, float(hf.layer_norm_epsilon), cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> Placement:
        name = name.removeprefix("transformer.")
        if name in _TOP:
            return [(_TOP[name], None, tensor)]
        if name.startswith("h."):
            _, idx, rest = name.split(".", 2)
            if rest in _BLOCK:
                ours, conv1d = _BLOCK[rest]
                return [(f"layers.{idx}.{ours}", None, tensor.t() if conv1d else tensor)]
        return []  # attn.bias / attn.masked_bias mask buffers
