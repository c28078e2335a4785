"""Gemma-2: scaled embeddings, (1 + weight) RMSNorms before and after both sublayers, GeGLU,
attention and final logit soft-capping, alternating local (sliding-window) and global layers.

Points: ``embed`` is the embedding times sqrt(hidden) (the scale rounded to the model dtype,
as transformers does); ``attn_out`` and ``mlp_out`` are what the block adds to the residual
stream, i.e. *after* ``post_attention_layernorm`` / ``post_feedforward_layernorm``;
``final`` is the final norm's output, which the (tied) unembedding reads before soft-capping.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.attention import AttentionMetadata
from tapllm.layers.embedding import embedding
from tapllm.layers.linear import Linear
from tapllm.layers.norm import GemmaRMSNorm
from tapllm.layers.rotary import RotaryEmbedding
from tapllm.models.base import Attention, CausalLM, GatedMLP, KVCache, gate_up_fused, qkv_fused
from tapllm.tap import Tap

# config.hidden_activation -> the function (transformers' ACT2FN names)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(hf_config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's gate activation named by the config (GeGLU: tanh-approximated GELU)."""
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "gelu_pytorch_tanh")
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GemmaBlock(nn.Module):
    """Norm -> sublayer -> norm, for attention and for the MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        eps, d, dt = float(cfg.hf_config.rms_norm_eps), cfg.hidden_size, cfg.dtype
        self.input_layernorm = GemmaRMSNorm(d, eps, dt)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(d, eps, dt)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps, dt)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps, dt)

    def forward(self, x: torch.Tensor, i: int, tap: Tap, cos_sin: list[tuple[torch.Tensor, torch.Tensor]],
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = tap("resid_pre", i, x)
        a = tap("attn_out", i, self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos_sin[i], kv, meta, tap, i)))
        mid = tap("resid_mid", i, x + a)
        m = tap("mlp_out", i, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(mid), tap, i)))
        return tap("resid_post", i, mid + m)


class Gemma2ForCausalLM(CausalLM):
    """Gemma-2; :class:`~tapllm.models.gemma3.Gemma3ForCausalLM` changes the attention and the rope."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        hf = cfg.hf_config
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError(f"{cfg.architecture} with use_bidirectional_attention (an embedding model) "
                             "is not supported: tapllm generates causally")
        self.rotary = nn.ModuleDict({name: RotaryEmbedding(hf, cfg.head_dim, cfg.max_model_len, rope_key)
                                     for name, rope_key in self.rope_kinds().items()})
        self.rope_of_layer = [self.rope_kind(i) for i in range(cfg.num_layers)]
        bias = bool(getattr(hf, "attention_bias", False))
        act = activation(hf)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5).to(cfg.dtype), persistent=False)
        self.layers = nn.ModuleList(
            GemmaBlock(cfg, self.attention(cfg, i, bias), GatedMLP(cfg, act)) for i in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, float(hf.rms_norm_eps), cfg.dtype)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)
        cap = getattr(hf, "final_logit_softcapping", None)
        self.final_logit_softcap = float(cap) if cap else None

    def attention(self, cfg: ModelConfig, layer: int, bias: bool) -> Attention:
        """Layer ``layer``'s attention: scale query_pre_attn_scalar ** -0.5, logits soft-capped."""
        hf = cfg.hf_config
        cap = getattr(hf, "attn_logit_softcapping", None)
        return Attention(cfg, layer, qkv_bias=bias, o_bias=bias, scale=float(hf.query_pre_attn_scalar) ** -0.5,
                         softcap=float(cap) if cap else None)

    def rope_kinds(self) -> dict[str, str | None]:
        """Rotary tables to build: name -> the ``rope_parameters`` key (None: the flat parameters)."""
        return {"all": None}

    def rope_kind(self, layer: int) -> str:
        """Which rotary table layer ``layer`` uses."""
        return "all"

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def block_context(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary cos/sin rows (computed once per table)."""
        tables = {name: rope.cos_sin(positions, dtype) for name, rope in self.rotary.items()}
        return [tables[name] for name in self.rope_of_layer]

    def fused(self) -> list[tuple[str, str, int]]:
        return qkv_fused(self.cfg) + gate_up_fused(int(self.cfg.hf_config.intermediate_size))
