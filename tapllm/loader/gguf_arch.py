"""How a llama.cpp architecture's tensors become a Hugging Face checkpoint's (:class:`GGUFArch`), and the
Llama names and rotary fix-up that most architectures share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture's tensors become a Hugging Face checkpoint's.

    ``block`` maps a tensor name after ``blk.N.`` to the Hugging Face name after
    ``{block_prefix}N.``; ``top`` maps whole names. ``fix(hf_name, array, config)`` undoes
    what llama.cpp's converter did to a tensor (e.g. Llama's rotary permutation of q/k).
    ``architecture`` is the Hugging Face ``architectures`` entry when it is not the config
    class's name with ``ForCausalLM`` (GPT-2's ``GPT2LMHeadModel``, Gemma-3's
    ``Gemma3ForCausalLM``). ``configure(config_values, metadata, shapes)`` completes the config
    values transformers' GGUF reader made, where it leaves some out, from the file's
    ``{arch}.*`` metadata (keys without the prefix) and its tensors' shapes (``{name: shape}``,
    ``[out, in]`` order), before the config is built. ``config_tensors`` names small tensors
    that hold configuration (Phi-3's LongRoPE factors): their values join the metadata
    under their tensor names, as lists; ``configure`` may also set ``model_type`` (a Mixtral file
    is a ``llama`` one with experts). ``model_type`` names the transformers config to build from
    the metadata alone (:func:`metadata_config`) where transformers' GGUF reader has no such
    architecture. ``fix_on_rows``: ``fix`` only reorders or reshapes rows, so it applies to a
    tensor's quantized blocks as well (``quantization="gguf"``). ``combine(tensors, config)``
    joins or splits the dequantized ``{Hugging Face name: array}`` once all are read (gpt-oss's
    experts, stored by llama.cpp as separate gate and up halves).
    """

    block: dict[str, str]
    top: dict[str, str]
    block_prefix: str = "model.layers."
    fix: Callable[[str, np.ndarray, Any], np.ndarray] | None = None
    architecture: str | None = None
    configure: Callable[[dict[str, Any], dict[str, Any], dict[str, tuple[int, ...]]], None] | None = None
    config_tensors: tuple[str, ...] = ()
    model_type: str | None = None
    fix_on_rows: bool = False
    combine: Callable[[dict[str, np.ndarray], Any], None] | None = None

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of GGUF tensor ``name``, or None for tensors without one."""
        if name in self.top:
            return self.top[name]
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest in self.block:
                return f"{self.block_prefix}{idx}.{self.block[rest]}"
        return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q/k projection (rows grouped per head)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def llama_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return unpermute(data, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return unpermute(data, config.num_key_value_heads)
    return data


LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LLAMA_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# llama.cpp's generic metadata keys (without the ``{arch}.`` prefix) -> the transformers config's names
_GENERIC_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}


def metadata_config(model_type: str, meta: dict[str, Any], general: dict[str, Any]) -> dict[str, Any]:
    """The config values of a file whose architecture transformers' GGUF reader does not know (OLMoE): the
    generic llama.cpp keys of ``meta`` (``{arch}.*`` without the prefix) under transformers' names, the
    vocabulary size from the tokenizer where the file does not state it, and the special token ids
    (``general``: the file's other metadata, full keys)."""
    cfg: dict[str, Any] = {"model_type": model_type}
    for key, name in _GENERIC_KEYS.items():
        if key in meta:
            cfg[name] = meta[key]
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in general:
        cfg["vocab_size"] = len(general["tokenizer.ggml.tokens"])
    for key, name in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in general:
            cfg[name] = int(general[f"tokenizer.ggml.{key}"])
    return cfg
