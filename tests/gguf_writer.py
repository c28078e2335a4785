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
