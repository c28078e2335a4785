"""Qwen2-MoE and Qwen3-MoE: the Qwen2/Qwen3 blocks with sparse mixtures of experts as MLPs.

Qwen2-MoE adds a shared expert to every sparse block, scaled by ``sigmoid(shared_expert_gate(x))``,
and has q/k/v biases; Qwen3-MoE normalises q and k per head. Both renormalise the chosen experts'
probabilities only with ``norm_topk_prob``, and keep dense MLPs in ``mlp_only_layers`` and in the
blocks ``decoder_sparse_step`` skips.
"""

from __future__ import annotations

from tapllm.models.moe import MoEForCausalLM, Routing
from tapllm.models.qwen3 import Qwen3Attention
from tapllm.models.shapes import is_sparse_layer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen1.5-MoE, Qwen2-57B-A14B: q/k/v biases, a gated shared expert."""

    def routing(self) -> Routing:
        hf = self.cfg.hf_config
        return Routing(int(hf.num_experts), int(hf.num_experts_per_tok), renormalize=bool(hf.norm_topk_prob))

    def expert_size(self) -> int:
        return int(self.cfg.hf_config.moe_intermediate_size)

    def shared_expert_size(self) -> int | None:
        return int(getattr(self.cfg.hf_config, "shared_expert_intermediate_size", 0) or 0) or None

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(self.cfg, layer)  # not in mlp_only_layers, and where decoder_sparse_step says

    def attention_biases(self) -> tuple[bool, bool]:
        return bool(getattr(self.cfg.hf_config, "qkv_bias", True)), False


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B: per-head q/k norms, no shared expert, biases as ``attention_bias``."""

    attention_cls = Qwen3Attention

    def shared_expert_size(self) -> int | None:
        return None

    def attention_biases(self) -> tuple[bool, bool]:
        bias = bool(getattr(self.cfg.hf_config, "attention_bias", False))
        return bias, bias
