"""Mixtral: the Mistral block with a sparse mixture of experts as its MLP.

The router's top-k probabilities are always renormalised over the chosen experts (a softmax
over the chosen logits), and the experts' outputs are scaled in float32, as transformers does.
"""

from __future__ import annotations

from tapllm.models.moe import MoEForCausalLM, Routing


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral 8x7B / 8x22B and its kin (``block_sparse_moe.experts.N.w1/w2/w3`` checkpoints)."""

    def routing(self) -> Routing:
        hf = self.cfg.hf_config
        return Routing(int(hf.num_local_experts), int(hf.num_experts_per_tok), renormalize=True, float_weights=True)
