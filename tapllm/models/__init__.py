"""Model families, selected by the checkpoint's ``architectures`` entry."""

from __future__ import annotations

from torch import nn

from tapllm.config import ModelConfig


def build_model(config: ModelConfig) -> nn.Module:
    """Instantiate (uninitialised) the model class for ``config.architecture``."""
    if config.architecture == "Qwen3ForCausalLM":
        from tapllm.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM(config)
    from tapllm.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(config)
