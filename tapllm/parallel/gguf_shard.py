"""A GGUF file's quantized tensors on tensor-parallel ranks and pipeline stages, kept as stored
(``quantization="gguf"``): each rank copies from the file's memory map only the blocks of its slice
(whole rows of column-parallel and vocabulary tensors; whole blocks of a row-parallel tensor's inputs)
and only its stage's tensors, then reads every other tensor's slice from the dequantized folder as a
float checkpoint (see :mod:`tapllm.loader.gguf_blocks` for one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.linear import Linear
from tapllm.loader.gguf_blocks import (EMBED, Cut, checkpoint_sources, embed_blocks_kept, place_blocks, quant_layer,
                                      raw_tensors)
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layers import GatheredHead, RowParallelLinear, VocabParallelEmbedding
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.quant_shard import (PendingHead, QuantGatheredHead, QuantRowParallelLinear,
                                         QuantVocabParallelEmbedding)
from tapllm.parallel.sharding import Stage, shard_weights, split_of
from tapllm.quant.schemes import Quantization


def _cutter(layout: ShardLayout, architecture: str, stage: Stage | None) -> Cut:
    def cut(name: str, blocks: np.ndarray, k: int) -> np.ndarray | None:
        if stage is not None and not stage.holds(name, architecture):
            return None
        split = split_of(name, layout, 2, architecture)
        if split is None:
            return blocks
        dim, runs = split
        if dim == 0:
            parts = [blocks[start : start + count] for start, count in runs]
        else:
            per = k // blocks.shape[1]
            for start, count in runs:
                if start % per or count % per:
                    raise ValueError(
                        f"GGUF tensor {name} packs its {k} inputs in blocks of {per}; tensor_parallel_size="
                        f"{layout.size} gives rank {layout.rank} inputs {start}..{start + count}, which do not "
                        "start and end on a block")
            parts = [blocks[:, start // per : (start + count) // per] for start, count in runs]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)
    return cut


def gguf_shard_weights(model: nn.Module, gguf_path: Path, cfg: ModelConfig, layout: ShardLayout, stage: Stage | None,
                       quant: Quantization, embedding: bool, group: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """Swap this rank's layers whose GGUF tensors are of a kept type for quantized ones over its slice of the
    blocks (as :func:`~tapllm.loader.gguf_blocks.keep_gguf_blocks` does in one process), and return the
    weights to load: those blocks, and this rank's slice of every other tensor of its stage from the folder."""
    raw = raw_tensors(gguf_path, cfg.hf_config, _cutter(layout, cfg.architecture, stage))
    names, sources = checkpoint_sources(model, cfg.path)
    one_process = quant_layer(quant, Linear)

    def layer_for(module: nn.Module, k: int, n: int, parts: list[tuple[int, tuple[int, int]]]) -> nn.Module | None:
        single = len({shape for _, shape in parts}) == 1
        if not isinstance(module, Linear):
            return None  # the embedding: below
        bias, dtype = module.bias is not None, module.weight.dtype
        if type(module) is RowParallelLinear and single:
            return QuantRowParallelLinear(k, n, bias, dtype, quant, parts[0][1], group)
        if type(module) is GatheredHead and single and not bias:
            return QuantGatheredHead(k, n, dtype, quant, group, module.sizes, shape=parts[0][1])
        return one_process(module, k, n, parts)

    kept = place_blocks(model, raw, sources, layer_for)
    model.quant = quant
    emb, head = model.embed_tokens, model.lm_head
    if isinstance(emb, VocabParallelEmbedding) and isinstance(head, GatheredHead | QuantGatheredHead):
        tied = isinstance(head, GatheredHead) and head.weight is emb.weight
        table_kept = embedding and embed_blocks_kept(model, raw, names)
        if tied and EMBED in raw:  # the head reads the table's blocks (also where the table stays in float)
            model.lm_head = PendingHead(head, quant, None if table_kept else raw[EMBED])
        if table_kept:
            model.embed_tokens = QuantVocabParallelEmbedding(emb.rows, emb.embedding_dim, emb.start, emb.weight.dtype,
                                                             quant, group, shape=tuple(raw[EMBED].shape[1:]))
            kept.add(EMBED)
    return _weights(cfg, layout, stage, kept, raw)


def _weights(cfg: ModelConfig, layout: ShardLayout, stage: Stage | None, kept: set[str], raw: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    yield from shard_weights(cfg.path, layout, cfg.architecture, stage, skip=kept)
    for name in kept:
        yield name, raw[name]
