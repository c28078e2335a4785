"""A rank's part of a model: its config, its modules, and the slices of the checkpoint it reads.

The model of a rank is the family's own code built from a *local* config (its query heads, KV
heads, MLP neurons and vocabulary rows), so attention and MLP modules need no change; then the
layers that need the other ranks are swapped in (:mod:`tapllm.parallel.layers`): o_proj and
down_proj row-parallel, the embedding and LM head vocabulary-parallel. Each checkpoint tensor
is read as the slice this rank holds (safetensors ``get_slice``: no rank reads the whole
model), then goes through the family's own name mapping (fused q/k/v and gate/up offsets are
those of the local config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tapllm.config import ModelConfig
from tapllm.loader.weights import iter_weights, weight_files
from tapllm.models import build_model
from tapllm.models.base import MLP, Attention, CausalLM, GatedMLP
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layers import GatheredHead, RowParallelLinear, VocabParallelEmbedding
from tapllm.parallel.layout import ShardLayout
from tapllm.utils.hf_config import HFConfig

# The families whose blocks this module knows how to split (their checkpoint names below).
SHARDABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# A checkpoint module's name -> (what its rows or columns count, the dim split). Anything not
# named here (norms, rotary buffers) is replicated on every rank.
SPLITS: dict[str, tuple[str, int]] = {
    "q_proj": ("heads", 0), "k_proj": ("kv_heads", 0), "v_proj": ("kv_heads", 0), "o_proj": ("heads", 1),
    "gate_proj": ("neurons", 0), "up_proj": ("neurons", 0), "down_proj": ("neurons", 1),
    "embed_tokens": ("vocab", 0), "lm_head": ("vocab", 0),
}


def layout_for(cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
    """The split of ``cfg``'s model over ``size`` ranks (``ValueError`` names a field that does not divide)."""
    if cfg.architecture not in SHARDABLE:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {cfg.architecture} yet; "
                         f"supported: {', '.join(SHARDABLE)}")
    return ShardLayout(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       int(cfg.hf_config.intermediate_size), cfg.vocab_size)


def local_config(cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """``cfg`` with this rank's heads, KV heads, MLP neurons and vocabulary rows."""
    hf = cfg.hf_config
    values = hf.to_dict()
    aliases = dict(hf._aliases) if isinstance(hf, HFConfig) else dict(getattr(type(hf), "attribute_map", {}))
    for name, value in (("num_attention_heads", layout.heads), ("num_key_value_heads", layout.kv_heads),
                        ("intermediate_size", layout.neurons), ("head_dim", layout.head_dim),
                        ("vocab_size", layout.vocab)):
        values[aliases.get(name, name)] = value
    return dataclasses.replace(cfg, hf_config=HFConfig(values, aliases), num_heads=layout.heads,
                               num_kv_heads=layout.kv_heads, vocab_size=layout.vocab)


def build_shard(cfg: ModelConfig, layout: ShardLayout, group: TPGroup) -> CausalLM:
    """This rank's model, on the CPU, weights not yet loaded."""
    local = local_config(cfg, layout)
    model = build_model(local)
    for module in model.modules():
        if isinstance(module, Attention):
            old = module.o_proj
            module.o_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                              cfg.dtype, group)
        elif isinstance(module, GatedMLP | MLP):
            old = module.down_proj
            module.down_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                                 cfg.dtype, group)
    model.embed_tokens = VocabParallelEmbedding(layout.vocab, cfg.hidden_size, layout.vocab_start, cfg.dtype, group)
    head = GatheredHead(cfg.hidden_size, layout.vocab, False, cfg.dtype, group)
    if model.lm_head is None:  # tied: the head reads the embedding's rows of this rank
        head.weight = model.embed_tokens.weight
    model.lm_head = head
    return model


def _part(layout: ShardLayout, unit: str) -> tuple[int, int]:
    """(first index, count) along the split dim of a tensor counting ``unit``."""
    d = layout.head_dim
    return {
        "heads": (layout.head_start * d, layout.heads * d),
        "kv_heads": (layout.kv_head_start * d, layout.kv_heads * d),
        "neurons": (layout.neuron_start, layout.neurons),
        "vocab": (layout.vocab_start, layout.vocab),
    }[unit]


def split_of(name: str, layout: ShardLayout, ndim: int) -> tuple[int, int, int] | None:
    """``(dim, start, count)`` of checkpoint tensor ``name`` that this rank reads; None: all of it."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    rule = SPLITS.get(parts[-2])
    if rule is None:
        return None
    unit, dim = rule
    if dim >= ndim:  # the bias of a row-parallel layer: whole, added once after the all-reduce
        return None
    return (dim, *_part(layout, unit))


def shard_weights(folder: Path, layout: ShardLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of ``folder`` as this rank's slice of it (safetensors: only the slice is read)."""
    for file in weight_files(folder):
        if file.suffix != ".safetensors":  # PyTorch .bin files have no partial reads: read, then cut
            for name, tensor in iter_weights(folder):
                split = split_of(name, layout, tensor.dim())
                yield name, tensor if split is None else tensor.narrow(*split).clone()
            return
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                split = split_of(name, layout, len(piece.get_shape()))
                if split is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, count = split
                yield name, piece[start:start + count] if dim == 0 else piece[:, start:start + count]


def load_shard(cfg: ModelConfig, layout: ShardLayout, group: TPGroup, dummy_seed: int | None = None) -> CausalLM:
    """Build this rank's model and read its weights (``dummy_seed``: random weights, nothing read)."""
    model = build_shard(cfg, layout, group)
    if dummy_seed is not None:
        from tapllm.loader.dummy import fill_dummy_weights

        fill_dummy_weights(model, dummy_seed + layout.rank)
    else:
        model.load_weights(shard_weights(cfg.path, layout))
    model.eval()
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters (a tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
