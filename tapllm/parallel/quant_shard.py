"""Quantized weights on tensor-parallel ranks: each rank's packed blocks are exactly its slice of the
blocks one process would hold, so a quantized model split over ranks computes what it computes whole.

Column-parallel layers (q/k/v, gate/up), the vocabulary-parallel embedding and LM head hold whole
rows: their blocks are the one-process rows as they are. Row-parallel layers (o_proj, down_proj) hold
a slice of every row's inputs, which must start and end on a block boundary of the whole layer's
layout (:func:`slice_shape`; MLP neurons are split in runs of a block, see
:attr:`~tapllm.parallel.layout.ShardLayout.neuron_unit`; a head split that cuts a block is refused
at start-up, naming the field). int8's one scale per output row spans the whole row: each rank
quantizes its slice with the largest magnitude of every rank's (gathered at load), so its scale is
the one-process scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tapllm.config import ModelConfig
from tapllm.layers.linear import Linear
from tapllm.models.shapes import mlp_width
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layers import GatheredHead, RowParallelLinear, VocabParallelEmbedding
from tapllm.quant.embedding import QuantEmbedding
from tapllm.quant.linear import QuantLinear, block_shape, fill_rows, quantize_linears
from tapllm.quant.pack import SUPER
from tapllm.quant.schemes import Quantization


def input_block(quant: Quantization | None, k: int) -> int:
    """The inputs of one block of a ``k``-input weight under ``quant`` (a rank's slice of the inputs
    must start and end on a multiple of it); 1 where the layer stays in float (nothing to align)."""
    if quant is None or k % 32:
        return 1
    if quant.method == "int8":  # one scale per row (shared across the ranks at load): the kernel's 32
        return 32
    if quant.method == "gguf":  # the file's blocks: 32 inputs, or 256 for the K-quants (a multiple of 32)
        return SUPER if k % SUPER == 0 else 32
    shape = block_shape(quant, k)
    return 1 if shape is None else k // shape[0]


def slice_shape(quant: Quantization, k: int, k_local: int) -> tuple[int, int] | None:
    """``(blocks, bytes per block)`` of a rank's ``k_local`` inputs of a ``k``-input weight, in the whole
    weight's layout (None: one process keeps it in float)."""
    if quant.method == "int8":
        return (1, 2 + k_local) if k % 32 == 0 else None
    whole = block_shape(quant, k)
    return None if whole is None else (k_local // (k // whole[0]), whole[1])


def check_head_split(quant: Quantization | None, num_heads: int, head_dim: int, head_parts: list[tuple[int, int]],
                     size: int) -> None:
    """``ValueError`` when some rank's query heads cut a block of o_proj's inputs (``head_parts``: each
    rank's (first head, heads)), naming the fields and what would fit."""
    k = num_heads * head_dim
    unit = input_block(quant, k)

    def cuts(block: int) -> bool:
        return any((start * head_dim) % block or (count * head_dim) % block for start, count in head_parts)

    for rank, (start, count) in enumerate(head_parts):
        if (start * head_dim) % unit or (count * head_dim) % unit:
            hint = " (quantization_group_size=32 fits)" if quant.method == "int4" and not cuts(32) else ""
            raise ValueError(
                f"quantization={quant.describe()!r} packs o_proj's {k} inputs in blocks of {unit}; "
                f"tensor_parallel_size={size} gives rank {rank} query heads {start}..{start + count - 1} "
                f"(num_attention_heads={num_heads} of head_dim={head_dim}: inputs {start * head_dim}.."
                f"{(start + count) * head_dim}), which do not start and end on a block{hint}")


class QuantRowParallelLinear(QuantLinear):
    """A quantized linear over this rank's slice of the inputs: partial sums all-reduced, the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: Quantization,
                 shape: tuple[int, int], group: TPGroup) -> None:
        super().__init__(in_features, out_features, bias, dtype, quant, shape=shape)
        self.group = group

    def load_rows(self, offset: int | None, value: torch.Tensor) -> None:
        """As :meth:`QuantLinear.load_rows`; int8 float rows take the scale of the whole row (every rank's
        largest magnitude: a collective, so every rank of the group loads the same tensors in one order)."""
        if value.dtype != torch.uint8 and self.quant.method == "int8":
            amax = value.float().abs().amax(-1, keepdim=True).contiguous()
            fill_rows(self.blocks, self.in_features, self.quant, offset, value,
                      amax=self.group.all_gather(amax, dim=-1).amax(-1))
            return
        super().load_rows(offset, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.project(x, None).contiguous())
        return y if self.bias is None else y + self.bias.to(y.dtype)


class QuantGatheredHead(QuantLinear):
    """The quantized LM head over this rank's vocabulary rows, the logits gathered in vocabulary order."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, quant: Quantization,
                 group: TPGroup, sizes: list[int] | None, shape: tuple[int, int] | None = None) -> None:
        super().__init__(in_features, out_features, False, dtype, quant, shape=shape)
        self.group, self.sizes = group, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(super().forward(x), dim=-1, sizes=self.sizes)


class QuantVocabParallelEmbedding(QuantEmbedding):
    """This rank's rows ``[start, start + rows)`` of a quantized embedding table (as
    :class:`~tapllm.parallel.layers.VocabParallelEmbedding`)."""

    def __init__(self, rows: int, dim: int, start: int, dtype: torch.dtype, quant: Quantization, group: TPGroup,
                 shape: tuple[int, int] | None = None) -> None:
        super().__init__(rows, dim, dtype, quant, shape=shape)
        self.start, self.rows, self.group = start, rows, group

    def head(self, sizes: list[int] | None = None) -> QuantGatheredHead:  # type: ignore[override]
        """The tied LM head over this table's blocks (shared storage)."""
        layer = QuantGatheredHead(self.embedding_dim, self.num_embeddings, self.dtype, self.quant, self.group, sizes,
                                  shape=(1, 1))  # placeholder blocks, replaced by the shared ones below
        layer.blocks = self.blocks
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = super().forward(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x.contiguous())


def _replace(model: nn.Module, kind: type, make: Callable[[str, nn.Module], nn.Module | None]) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                new = make(name, child)
                if new is not None:
                    setattr(parent, name, new)


class PendingHead(nn.Module):
    """Where a tied LM head goes until the table it reads is loaded (it is not a checkpoint tensor of
    its own): :func:`finish_tied_head` builds it, over the quantized table's blocks, over ``blocks`` (a GGUF
    file's table, the table itself kept in float), or quantized from the float table."""

    def __init__(self, head: GatheredHead, quant: Quantization, blocks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.sizes, self.group, self.quant, self.blocks = head.sizes, head.group, quant, blocks
        self.dtype = head.weight.dtype

    def build(self, emb: nn.Module) -> nn.Module:
        if isinstance(emb, QuantVocabParallelEmbedding):
            return emb.head(self.sizes)
        rows, dim = emb.weight.shape
        if self.blocks is not None:
            head = QuantGatheredHead(dim, rows, self.dtype, self.quant, self.group, self.sizes,
                                     shape=tuple(self.blocks.shape[1:]))
            head.load_rows(None, self.blocks)
            return head
        if block_shape(self.quant, dim) is None:  # one process keeps it in float too
            head = GatheredHead(dim, rows, False, self.dtype, self.group, self.sizes)
            head.weight = emb.weight
            return head
        head = QuantGatheredHead(dim, rows, self.dtype, self.quant, self.group, self.sizes)
        head.load_rows(None, emb.weight.data)
        return head


def finish_tied_head(model: nn.Module) -> None:
    """After loading: build a :class:`PendingHead`."""
    if isinstance(model.lm_head, PendingHead):
        model.lm_head = model.lm_head.build(model.embed_tokens)


def row_inputs(cfg: ModelConfig) -> dict[str, int]:
    """The whole model's inputs of each row-parallel layer, by its name."""
    return {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": mlp_width(cfg)}


def quantize_shard(model: nn.Module, quant: Quantization, group: TPGroup | None, embedding: bool,
                   cfg: ModelConfig) -> None:
    """Swap a rank's built (not yet loaded) layers for quantized ones with empty storage, as
    ``quantize_linears`` / ``quantize_embedding`` do in one process (``cfg``: the whole model's config;
    ``group`` None: a shard only measured, never run)."""
    inputs = row_inputs(cfg)
    model.quant = quant
    quantize_linears(model, quant, Linear)  # column-parallel: whole rows

    def row(name: str, layer: nn.Module) -> QuantRowParallelLinear | None:
        n, k_local = layer.weight.shape
        shape = slice_shape(quant, inputs[name], k_local)
        if shape is None:
            return None
        return QuantRowParallelLinear(k_local, n, layer.bias is not None, layer.weight.dtype, quant, shape, group)

    _replace(model, RowParallelLinear, row)
    emb, head = model.embed_tokens, model.lm_head
    if not isinstance(emb, VocabParallelEmbedding) or not isinstance(head, GatheredHead):
        return  # a later pipeline stage: neither is held here
    rows, dim = emb.weight.shape
    if block_shape(quant, dim) is None:
        return
    if head.weight is emb.weight:  # tied: built once the table is loaded
        model.lm_head = PendingHead(head, quant)
    else:
        model.lm_head = QuantGatheredHead(dim, head.weight.shape[0], head.weight.dtype, quant, group, head.sizes)
    if embedding:
        model.embed_tokens = QuantVocabParallelEmbedding(rows, dim, emb.start, emb.weight.dtype, quant, group)
