"""A GGUF file's quantized tensors kept as stored (``quantization="gguf"``).

The GGUF blocks Q8_0, Q4_0, Q4_1, Q4_K and Q6_K are exactly the packed layouts of tapllm's
quantized linears (``tapllm.quant.pack``), so a linear whose checkpoint tensors are all of one such type
receives the file's bytes unchanged (copied once from the file's memory map, never
dequantized), and so does the embedding table when its tensor is of a kept type (a
:class:`~tapllm.quant.embedding.QuantEmbedding`; a tied LM head shares its blocks, as
llama.cpp reads ``token_embd`` for both). A fused weight whose parts are kept types that differ
(llama.cpp's Q4_K_M: a Q6_K ``attn_v`` beside Q4_K q and k) becomes a
:class:`~tapllm.quant.linear.SplitQuantLinear`, each part in its own blocks. Everything else
(norms, linears of other GGUF types such as Q5_0 / Q5_K, which have no kernel) comes from the
cached dequantized folder as before. With the embedding kept in float (``embedding=False``) a
tied LM head still reads the embedding's blocks when those are of a kept type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from tapllm.loader.gguf_convert import GGUF_ARCHS
from tapllm.loader.weights import weight_files
from tapllm.quant.embedding import quantize_embedding
from tapllm.quant.linear import QuantLinear, SplitQuantLinear
from tapllm.quant.pack import block_kind
from tapllm.quant.schemes import Quantization

logger = logging.getLogger("tapllm")

# GGUF type -> (inputs, bytes) per block
KEPT = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
EMBED = "model.embed_tokens.weight"


def gguf_source(model: str | Path | None) -> Path:
    """The GGUF file behind ``model`` (``None``: the default model's); ``ValueError`` otherwise."""
    from tapllm.loader.checkpoint import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got model={str(model)!r}")
    return path


Cut = Callable[[str, np.ndarray, int], "np.ndarray | None"]


def raw_tensors(path: Path, config: Any, cut: Cut | None = None) -> dict[str, torch.Tensor]:
    """``{Hugging Face name: uint8 [N, K/g, B]}`` for every tensor of a kept type, with the
    architecture's row fix-ups (Llama's q/k permutation acts on rows, so it applies to blocks).
    ``cut(name, blocks, K)``: the part of a tensor's blocks to keep (None: none of it), taken from the
    file's memory map before anything is copied (a tensor-parallel rank's slice)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    mapping = GGUF_ARCHS.get(arch)
    if mapping is None or (mapping.fix is not None and not mapping.fix_on_rows):
        return {}  # other fix-ups (e.g. GPT-2's transposes) do not act on rows
    out = {}
    for t in reader.tensors:
        name, kind = mapping.hf_name(t.name), t.tensor_type.name
        if name is None or kind not in KEPT or len(t.shape) != 2:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        inputs, nbytes = KEPT[kind]
        blocks = np.asarray(t.data).reshape(n, k // inputs, nbytes)
        if mapping.fix is not None:
            blocks = mapping.fix(name, blocks, config)
        if cut is not None:
            blocks = cut(name, blocks, k)
            if blocks is None:
                continue
        out[name] = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C", copy=True))
    return out


# What a kept linear becomes: (module it replaces, inputs, outputs, (rows, (blocks, bytes)) per part) -> the
# quantized layer, or None to keep the module in float
LayerFor = Callable[[nn.Module, int, int, list[tuple[int, tuple[int, int]]]], "nn.Module | None"]


def quant_layer(quant: Quantization, linear_type: type) -> LayerFor:
    """One process's kept linears: a :class:`QuantLinear` per ``linear_type`` module, a
    :class:`SplitQuantLinear` where the parts' layouts differ."""
    def make(module: nn.Module, k: int, n: int, parts: list[tuple[int, tuple[int, int]]]) -> nn.Module | None:
        if type(module) is not linear_type:
            return None
        bias, dtype = module.bias is not None, module.weight.dtype
        if len({shape for _, shape in parts}) == 1:
            return QuantLinear(k, n, bias, dtype, quant, shape=parts[0][1])
        # a fused weight whose parts differ in type (Q4_K_M's Q6_K attn_v beside Q4_K q and k)
        return SplitQuantLinear(k, parts, bias, dtype, quant)
    return make


def checkpoint_sources(model: nn.Module, folder: Path) -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    """The dequantized ``folder``'s tensors (name -> file), and each of ``model``'s parameters with the
    ``(first row, checkpoint name)`` of the tensors that fill it."""
    sources: dict[str, list[tuple[int, str]]] = {}
    names = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                names[name] = f
                shape = st.get_slice(name).get_shape()
                for target, offset, _ in model.checkpoint_names(name, torch.empty(shape, device="meta")):
                    sources.setdefault(target, []).append((offset or 0, name))
    return names, sources


def place_blocks(model: nn.Module, raw: dict[str, torch.Tensor], sources: dict[str, list[tuple[int, str]]],
                 layer_for: LayerFor) -> set[str]:
    """Swap each of ``model``'s linears whose checkpoint tensors are all in ``raw`` (and tile its rows) for
    ``layer_for``'s quantized layer; returns the checkpoint names those layers take as stored."""
    modules = dict(model.named_modules())
    kept: set[str] = set()
    for target, placed in sources.items():
        module = modules.get(target.removesuffix(".weight"))
        weight = getattr(module, "weight", None)
        if not target.endswith(".weight") or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        placed.sort()
        srcs = [name for _, name in placed]
        n, k = module.weight.shape
        if any(s not in raw or block_kind(k, *raw[s].shape[1:]) is None for s in srcs):
            continue  # some source is not kept as stored
        rows = [raw[s].shape[0] for s in srcs]
        if [off for off, _ in placed] != [sum(rows[:i]) for i in range(len(rows))] or sum(rows) != n:
            continue  # the parts do not tile the fused rows
        layer = layer_for(module, k, n, [(r, tuple(raw[s].shape[1:])) for r, s in zip(rows, srcs, strict=True)])
        if layer is None:
            continue
        parent, _, attr = target.removesuffix(".weight").rpartition(".")
        setattr(modules[parent] if parent else model, attr, layer)
        kept.update(srcs)
    return kept


def keep_gguf_blocks(model: nn.Module, gguf_path: Path, folder: Path, linear_type: type,
                     embedding: bool = True, quant: Quantization | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn ``model``'s linears whose GGUF tensors are all of one kept type into
    :class:`QuantLinear` layers of that layout (and, with ``embedding``, its embedding table
    into a :class:`~tapllm.quant.embedding.QuantEmbedding` when ``token_embd`` is of a kept
    type), and return the weights to load: those layers' blocks as stored, every other
    tensor from the dequantized ``folder``. ``quant``: the ``"gguf"`` choice (with its activation
    rounding), ``Quantization("gguf")`` when omitted."""
    raw = raw_tensors(gguf_path, model.cfg.hf_config)
    quant = quant or Quantization("gguf")
    names, sources = checkpoint_sources(model, folder)
    kept = place_blocks(model, raw, sources, quant_layer(quant, linear_type))
    embed_kept = (embedding and embed_blocks_kept(model, raw, names)
                  and quantize_embedding(model, quant, shape=tuple(raw[EMBED].shape[1:])))
    if embed_kept:
        kept.add(EMBED)
    tied = getattr(model, "lm_head", 0) is None and EMBED in raw
    model.quant = quant
    # CausalLM.prepare_for_inference builds a tied head: over the kept embedding's blocks, else from these
    model.head_blocks = raw[EMBED] if tied and not embed_kept else None
    logger.info("GGUF as stored: %d of %d checkpoint tensors kept in their blocks%s", len(kept), len(names),
                " (and the tied LM head)" if tied else "")
    return _weights(names, kept, raw)


def embed_blocks_kept(model: nn.Module, raw: dict[str, torch.Tensor], names: dict[str, Path]) -> bool:
    """Whether the file's embedding table is of a kept type ``model``'s width can take."""
    return EMBED in raw and EMBED in names and block_kind(model.cfg.hidden_size, *raw[EMBED].shape[1:]) is not None


def _weights(names: dict[str, Path], kept: set[str], raw: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, f in names.items():
        if name in kept:
            yield name, raw[name]
        else:
            with safe_open(str(f), framework="pt") as st:
                yield name, st.get_tensor(name)
