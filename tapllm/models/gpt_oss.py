"""gpt-oss: a pre-norm block with attention sinks, sliding-window layers alternating with global ones,
and a mixture of experts with a biased router and a clamped SwiGLU.

* Attention: q/k/v and output biases; a learned logit per query head (``sinks``) joins every
  softmax's denominator and reads no value (:class:`~tapllm.layers.attention.AttentionOptions`);
  ``layer_types`` alternate sliding-window and global layers; YaRN rotary.
* Router: a linear with bias; the top-k of its logits, then a softmax over those k.
* Experts, with biases: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` where
  ``g = clamp(gate, max=limit)``. transformers stores them stacked as ``x @ W``
  (``gate_up_proj`` ``[E, hidden, 2I]`` with gate and up interleaved column by column,
  ``down_proj`` ``[E, I, hidden]``); they are turned into tapllm's ``[gate; up]`` rows at load.
  MXFP4 checkpoints (``*_blocks``/``*_scales``) and GGUF files reach the model in that layout, dequantized
  once by the loader (:mod:`tapllm.loader.mxfp4`, :mod:`tapllm.loader.gguf_moe`).
* Norms scale in float32 before the cast back, as transformers' (equal in float32).

The sinks are in the PyTorch attention only, so the model runs the eager step
(:attr:`~tapllm.models.base.CausalLM.eager_only`); its experts (biases, the clamped SwiGLU) are not
what the CUDA backend's fused expert kernels compute, so they would keep the grouped path, and its
steps no CUDA graphs, there too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.norm import RMSNormScaledInFloat32
from tapllm.models.base import Attention, Placement
from tapllm.models.moe import Glu, MoEForCausalLM, Routing, SparseMoE


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """gpt-oss's gated activation of the experts (see the module docstring)."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    return glu


class GptOssAttention(Attention):
    """Attention with a sink logit per query head (``sinks`` ``[heads]``, loaded from the checkpoint)."""

    def __init__(self, cfg: ModelConfig, layer: int, **kwargs: Any) -> None:
        super().__init__(cfg, layer, **kwargs)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=cfg.dtype), requires_grad=False)
        self.opts = replace(self.opts, sinks=self.sinks)  # the parameter itself: loading fills it in place


class GptOssForCausalLM(MoEForCausalLM):
    """gpt-oss-20b / gpt-oss-120b (their MXFP4 experts dequantized by the loader)."""

    attention_cls = GptOssAttention
    eager_only = "attention sinks are computed by the PyTorch attention only"
    # (a class attribute over MoEForCausalLM's property: the fused expert kernels take no biases or clamps)
    graphs_off = "its biased experts with a clamped SwiGLU run the grouped path, which reads row counts on the host"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        eps = float(cfg.hf_config.rms_norm_eps)
        for layer in self.layers:
            layer.input_layernorm = RMSNormScaledInFloat32(cfg.hidden_size, eps, cfg.dtype)
            layer.post_attention_layernorm = RMSNormScaledInFloat32(cfg.hidden_size, eps, cfg.dtype)
        self.norm = RMSNormScaledInFloat32(cfg.hidden_size, eps, cfg.dtype)

    def routing(self) -> Routing:
        hf = self.cfg.hf_config
        return Routing(int(hf.num_local_experts), int(hf.num_experts_per_tok), renormalize=False, topk_first=True)

    def block_mlp(self, layer: int) -> nn.Module:
        hf = self.cfg.hf_config
        glu = clamped_swiglu(float(getattr(hf, "swiglu_alpha", 1.702)), float(hf.swiglu_limit))
        return SparseMoE(self.cfg, self.routing(), self.expert_size(), torch.sigmoid, glu=glu, bias=True)

    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> Placement:
        name = name.removeprefix("model.").replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, hidden, 2I], gate/up interleaved -> [E * 2I, hidden]
            w = tensor.transpose(1, 2)
            return [(name, None, torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).reshape(-1, w.shape[-1]))]
        if name.endswith(".mlp.experts.gate_up_proj_bias"):  # [E, 2I] interleaved -> [gate; up]
            return [(name, None, torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1))]
        if name.endswith(".mlp.experts.down_proj"):  # [E, I, hidden] -> [E * hidden, I]
            return [(name, None, tensor.transpose(1, 2).reshape(-1, tensor.shape[1]))]
        return super().checkpoint_names(name, tensor)

    def attention_biases(self) -> tuple[bool, bool]:
        bias = bool(getattr(self.cfg.hf_config, "attention_bias", True))
        return bias, bias
