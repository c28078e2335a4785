"""Llama family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/2.5 with qkv bias).

Each block's forward reads like its math and passes every residual-stream point
(``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post``; ``embed`` and
``final`` around the blocks) through the step's tap, which steers and then records the
rows of the requests that asked: no module hooks involved.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata, AttentionOptions, paged_attention
from tapllm.layers.linear import Linear, pack_linears, packing_available
from tapllm.layers.norm import RMSNorm
from tapllm.layers.rotary import RotaryEmbedding, apply_rotary
from tapllm.models.tap import PSEUDO_LAYER, Tap, no_tap

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection and rotary embedding."""

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, cfg.dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias, cfg.dtype)
        window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        self.opts = AttentionOptions(scale=self.head_dim**-0.5, window=window)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation of q and k before rotary; identity in this family."""
        return q, k

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv, self.num_kv], dim=1)
        q, k = self.qk_norm(q, k)
        q, k = apply_rotary(q, k, cos_sin)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.opts)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        inter = int(cfg.hf_config.intermediate_size)
        self.inter = inter
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias, cfg.dtype)
        self.down_proj = Linear(inter, cfg.hidden_size, bias, cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: MLP) -> None:
        super().__init__()
        eps = float(cfg.hf_config.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.dtype)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, i: int, tap: Tap, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = tap("resid_pre", i, x)
        a = tap("attn_out", i, self.self_attn(self.input_layernorm(x), cos_sin, kv, meta))
        mid = tap("resid_mid", i, x + a)
        m = tap("mlp_out", i, self.mlp(self.post_attention_layernorm(mid)))
        return tap("resid_post", i, mid + m)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache."""

    attention_cls: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.cfg = cfg
        self.rotary = RotaryEmbedding(hf, cfg.head_dim, cfg.max_model_len)
        qkv_bias, o_bias = self.attention_biases()
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.attention_cls(cfg, i, qkv_bias, o_bias), MLP(cfg, mlp_bias))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, float(hf.rms_norm_eps), cfg.dtype)
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def attention_biases(self) -> tuple[bool, bool]:
        """(q/k/v bias, output bias) as the family's config declares them."""
        if self.cfg.architecture == "Qwen2ForCausalLM":
            return True, False
        bias = bool(getattr(self.cfg.hf_config, "attention_bias", False))
        return bias, bias

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        tap: Tap | None = None,
    ) -> torch.Tensor:
        """Run the ragged batch; returns the final-norm hidden states [T, hidden].

        ``tap`` (the step's, or none when no request captures or steers) sees every point.
        """
        tap = tap or no_tap
        x = tap("embed", PSEUDO_LAYER, self.embed_tokens(input_ids))
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, tap, cos_sin, kv_caches[i], meta)
        return tap("final", PSEUDO_LAYER, self.norm(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (model dtype) for the given final hidden rows."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def prepare_for_inference(self, device: torch.device) -> None:
        """After loading: prepack linear weights where the platform benefits (see layers/linear.py)."""
        if self.tied and packing_available(device, self.cfg.dtype):
            self.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.cfg.dtype)
            self.lm_head.weight.data = self.embed_tokens.weight.data
        pack_linears(self, device, self.cfg.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the fused parameters."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            target, offset = self._map_name(name)
            if target not in params:
                continue  # e.g. lm_head.weight of a tied checkpoint, rotary buffers
            param = params[target].data
            dst = param if offset is None else param.narrow(0, offset, tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            more = " ..." if len(missing) > 6 else ""
            raise ValueError(f"checkpoint is missing tensors for: {missing[:6]}{more}")

    def _map_name(self, name: str) -> tuple[str, int | None]:
        if name.startswith("model."):
            name = name[len("model."):]
        for src, dst, part in self._fused():
            if f".{src}." in name:
                return name.replace(src, dst), part
        return name, None

    def _fused(self) -> list[tuple[str, str, int]]:
        c = self.cfg
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, int(c.hf_config.intermediate_size)
        return [
            ("q_proj", "qkv_proj", 0),
            ("k_proj", "qkv_proj", q),
            ("v_proj", "qkv_proj", q + kv),
            ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", inter),
        ]
