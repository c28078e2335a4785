"""Which class implements each ``architectures`` entry of a checkpoint's config.json.

Kept apart from the model code (and imported by ``tapllm.config``) so that reading a config
never imports a model; a family's module is imported only when its model is built.
"""

from __future__ import annotations

import importlib

# architecture name -> "module:class"
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tapllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tapllm.models.qwen3:Qwen3ForCausalLM",
    "GPT2LMHeadModel": "tapllm.models.gpt2:GPT2LMHeadModel",
    "GPTNeoXForCausalLM": "tapllm.models.gpt_neox:GPTNeoXForCausalLM",
    "Gemma2ForCausalLM": "tapllm.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "tapllm.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "tapllm.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "tapllm.models.olmo2:Olmo2ForCausalLM",
}


def model_class(architecture: str) -> type:
    """The class implementing ``architecture`` (a ``KeyError`` names the supported ones)."""
    try:
        target = ARCHITECTURES[architecture]
    except KeyError:
        raise KeyError(f"architecture {architecture!r} is not supported; supported: "
                       f"{', '.join(sorted(ARCHITECTURES))}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
