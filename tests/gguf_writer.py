"""Write small GGUF checkpoints for tests, in llama.cpp's layout, with the ``gguf`` package.

Every tiny test model uses the default model's tokenizer, so the tokenizer metadata is
copied from the default model's GGUF file. A family's test gives the architecture's
metadata keys and its tensors under llama.cpp's names, transformed as llama.cpp's converter
stores them (e.g. Llama's q/k rows permuted for its rotary layout, Gemma's norm weights + 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def _copy_tokenizer(writer: Any) -> None:
    import gguf

    from tapllm.loader import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


def write_gguf(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, torch.Tensor | np.ndarray],
               types: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (float32, Hugging Face shapes ``[out, in]``) and ``{arch}.*`` metadata ``kv``.

    ``types`` stores the named tensors quantized by the ``gguf`` package (e.g. ``"Q4_0"``); a
    ``uint8`` tensor of that type's blocks (``[out, bytes per row]``) is written as it is (the
    package cannot quantize to K-quants).

    ``kv`` keys are given without the ``{arch}.`` prefix; ints become uint32, floats
    float32, strings strings, bools bools, lists arrays.
    """
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tapllm-test-{arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in kv.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_array(full, list(value))
    _copy_tokenizer(writer)
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
            writer.add_tensor(name, t.numpy(), raw_dtype=gguf.GGMLQuantizationType[types[name]])
            continue
        array = t.detach().float().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        kind = (types or {}).get(name)
        if kind is None:
            writer.add_tensor(name, array)
        else:
            from gguf.quants import quantize

            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute_for_llama_cpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rotary layout of a q/k projection (the inverse of what loaders undo)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_gguf(folder: Path, path: Path, kinds: dict[str, str], types: dict[str, str], tied: bool) -> Path:
    """A GGUF of the tiny Llama in ``folder`` (safetensors): block tensors of llama.cpp name ``kinds[name]``
    in that type, ``types``: full tensor names' types overriding them (e.g. ``token_embd.weight``,
    ``output.weight``, one block's ``blk.0.attn_v.weight``), every other tensor F32; ``tied``: no
    ``output.weight`` (the head reads ``token_embd``)."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(folder / "model.safetensors")
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not tied:
        tensors["output.weight"] = sd["lm_head.weight"]
    all_types = {}
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, cpp in _LLAMA_NAMES.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if cpp == "attn_q":
                w = permute_for_llama_cpp(w, cfg["num_attention_heads"])
            elif cpp == "attn_k":
                w = permute_for_llama_cpp(w, cfg["num_key_value_heads"])
            tensors[f"blk.{i}.{cpp}.weight"] = w
            if cpp in kinds:
                all_types[f"blk.{i}.{cpp}.weight"] = kinds[cpp]
    all_types.update({name: kind for name, kind in types.items() if name in tensors})
    kv = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
          "rope.freq_base": float(cfg["rope_parameters"]["rope_theta"]),
          "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "vocab_size": cfg["vocab_size"],
          "rope.dimension_count": cfg["hidden_size"] // cfg["num_attention_heads"]}
    return write_gguf(path, "llama", kv, tensors, all_types)
