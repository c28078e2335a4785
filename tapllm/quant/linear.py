"""A linear layer whose weight stays packed in 4- or 8-bit blocks (see :mod:`tapllm.quant.pack`).

``forward`` runs tapllm's ``quant_linear`` kernel (dequantization in registers for decode
row counts, a column chunk at a time into a GEMM for prefill sizes) when the fused kernels
passed their probe, else the reference: dequantize to float32 and ``F.linear`` (the numbers
the kernel must reproduce). Rows are filled one checkpoint tensor at a time
(:meth:`load_rows`): float rows are quantized as they arrive, GGUF blocks are copied as
stored, so a float copy of the whole weight never exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.backends.ops import QuantOps
from tapllm.quant.pack import (SUPER, block_kind, dequantize, fit_group, quantize_int4, quantize_int8, quantize_q4_k,
                               round_activations)
from tapllm.quant.schemes import Quantization

_FILL_ROWS = 256  # rows quantized per step while loading


def block_shape(quant: Quantization, in_features: int) -> tuple[int, int] | None:
    """``(blocks per row, bytes per block)`` of a weight with ``in_features`` inputs under ``quant``,
    or None when it cannot take it (inputs not a multiple of 32; GGUF layouts come from the file).
    ``q4_k`` on inputs that are not a multiple of 256 takes int4 groups of 32 (Q4_1's blocks)."""
    if quant.method == "int8" and in_features % 32 == 0:
        return 1, 2 + in_features
    if quant.method == "q4_k" and in_features % SUPER == 0:
        return in_features // SUPER, 144
    if quant.method == "q4_k":
        return (in_features // 32, 20) if in_features % 32 == 0 else None
    group = fit_group(quant.group or 128, in_features) if quant.method == "int4" else None
    return None if group is None else (in_features // group, 4 + group // 2)


def fill_rows(blocks: torch.Tensor, k: int, quant: Quantization, offset: int | None, value: torch.Tensor,
              amax: torch.Tensor | None = None) -> None:
    """Write rows ``offset..`` (``None``: from 0) of packed ``blocks`` ``uint8 [N, G, B]`` of a
    ``k``-input weight: float rows ``[n, K]`` are quantized into its layout, packed rows
    ``uint8 [n, G, B]`` of that layout are copied as they are. ``amax`` (int8 rows only): each row's
    largest magnitude to scale by, where the rows are a slice of longer ones (a tensor-parallel rank's)."""
    start = 0 if offset is None else offset
    rows, groups, nbytes = blocks.shape
    if value.dtype == torch.uint8:
        if value.dim() != 3 or tuple(value.shape[1:]) != (groups, nbytes):
            raise ValueError(f"packed rows of shape {tuple(value.shape)} do not match the blocks "
                             f"[{groups}, {nbytes}] ({quant.describe()})")
    elif value.dim() != 2 or value.shape[1] != k:
        raise ValueError(f"weight rows of shape {tuple(value.shape)} do not fit {k} inputs")
    if start + value.shape[0] > rows:
        raise ValueError(f"rows {start}..{start + value.shape[0]} exceed the {rows} rows")
    if value.dtype == torch.uint8:
        blocks[start : start + value.shape[0]] = value
        return
    group, kind = k // groups, block_kind(k, groups, nbytes)
    quantizers = {"int8": quantize_int8, "int4": quantize_int4}
    if quant.method == "q4_k":
        quantizers["q4_k"] = lambda w, _: quantize_q4_k(w)
    if kind not in quantizers:
        raise ValueError(f"{kind} blocks come from a GGUF file as stored; float rows cannot be packed into them")
    quantize = quantizers[kind]
    if amax is not None and (kind != "int8" or groups != 1 or amax.shape != (value.shape[0],)):
        raise ValueError(f"a row scale (amax) of shape {tuple(amax.shape)} applies to {value.shape[0]} int8 rows "
                         f"of one block each, not {kind} in {groups} blocks")
    # small chunks straight into place: no packed copy of the whole tensor is held, and the float
    # temporaries stay a few MB (the heap keeps its high-water mark, see tapllm.utils.platform)
    for i in range(0, value.shape[0], _FILL_ROWS):
        chunk = value[i : i + _FILL_ROWS]
        rows = slice(start + i, start + i + chunk.shape[0])
        if amax is None:
            blocks[rows] = quantize(chunk, group)
        else:
            blocks[rows] = quantize_int8(chunk, None, amax=amax[i : i + chunk.shape[0]])


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` as packed blocks ``uint8 [N, G, B]`` (``blocks``)."""

    ops: QuantOps | None = None  # the backend's quantized-linear kernels (set by CausalLM.use_backend)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant: Quantization, shape: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        shape = shape or block_shape(quant, in_features)
        if shape is None:
            raise ValueError(f"{quant.describe()} cannot pack a weight with {in_features} inputs")
        # left untouched until rows are loaded (load_weights checks every row is): its pages become
        # resident as the load fills them, not all before the load's largest checkpoint read
        self.register_buffer("blocks", torch.empty(out_features, *shape, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant: Quantization) -> QuantLinear:
        """A layer quantizing ``weight`` ``[N, K]`` (e.g. a tied embedding used as the LM head)."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, quant)
        layer.load_rows(None, weight)
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    def load_rows(self, offset: int | None, value: torch.Tensor) -> None:
        """Fill rows ``offset..`` (``None``: all) from float rows ``[n, K]`` (quantized here) or from
        packed blocks ``uint8 [n, G, B]`` of this layer's layout (copied as they are)."""
        fill_rows(self.blocks, self.in_features, self.quant, offset, value)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return dequantize(self.blocks, self.in_features)

    @property
    def act_bits(self) -> int:
        """8 when the inputs are rounded to int8 per 32 values first (``quantize_activations``), else 0."""
        return self.quant.act_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:  # the hot path, spelled out (project() is one call more)
            return self.ops.quant_linear(x, self.blocks, self.bias, self.act_bits)
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` (a row-parallel layer passes None, adding its bias after the all-reduce)."""
        if self.ops is not None:
            return self.ops.quant_linear(x, self.blocks, bias, self.act_bits)
        bias = None if bias is None else bias.float()
        xf = round_activations(x) if self.act_bits else x.float()
        return F.linear(xf, self.dequantized(), bias).to(x.dtype)

    def extra_repr(self) -> str:
        _, groups, nbytes = self.blocks.shape
        return f"in={self.in_features}, out={self.out_features}, {self.quant.describe()}, blocks={groups}x{nbytes}B"


class SplitQuantLinear(nn.Module):
    """A fused linear (e.g. q/k/v stacked) whose parts' rows are packed in different layouts, as
    a GGUF file's parts may be (llama.cpp's Q4_K_M keeps ``attn_v`` in Q6_K in some blocks, q and k
    in Q4_K): one :class:`QuantLinear` per part, outputs concatenated, then the fused bias."""

    def __init__(self, in_features: int, parts: list[tuple[int, tuple[int, int]]], bias: bool, dtype: torch.dtype,
                 quant: Quantization) -> None:
        """``parts``: ``(rows, (blocks per row, bytes per block))`` of each part, in row order."""
        super().__init__()
        self.in_features, self.quant = in_features, quant
        self.out_features = sum(rows for rows, _ in parts)
        self.parts = nn.ModuleList(QuantLinear(in_features, rows, False, dtype, quant, shape=shape)
                                   for rows, shape in parts)
        self.starts = [sum(rows for rows, _ in parts[:i]) for i in range(len(parts))]
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_rows(self, offset: int | None, value: torch.Tensor) -> None:
        """Fill rows ``offset..`` of the fused weight: they must lie within one part."""
        start = 0 if offset is None else offset
        for first, part in zip(self.starts, self.parts, strict=True):
            if first <= start and start + value.shape[0] <= first + part.out_features:
                part.load_rows(start - first, value)
                return
        raise ValueError(f"rows {start}..{start + value.shape[0]} span parts of a split quantized linear "
                         f"(parts start at rows {self.starts})")

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return torch.cat([part.dequantized() for part in self.parts])

    @property
    def act_bits(self) -> int:
        """As :attr:`QuantLinear.act_bits`."""
        return self.quant.act_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.quant.describe()}, parts at rows {self.starts}"


def quantize_linears(model: nn.Module, quant: Quantization, linear_type: type) -> int:
    """Replace every ``linear_type`` module of ``model`` (before loading) by a :class:`QuantLinear`
    with empty storage; returns how many. Layers whose inputs ``quant`` cannot pack stay as they are."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not linear_type:
                continue
            n, k = child.weight.shape
            if block_shape(quant, k) is None:
                continue
            setattr(parent, name, QuantLinear(k, n, child.bias is not None, child.weight.dtype, quant))
            count += 1
    return count
