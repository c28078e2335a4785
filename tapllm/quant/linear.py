"""A linear layer whose weight stays packed in 4 or 8 bits (see :mod:`tapllm.quant.pack`).

``forward`` runs tapllm's ``quant_linear`` kernel (dequantization in registers for decode
row counts, a column chunk at a time into a GEMM for prefill sizes) when the fused kernels
passed their probe, else the reference: dequantize to float32 and ``F.linear`` (the
numbers the kernel must reproduce). Rows are filled one checkpoint tensor at a time
(:meth:`load_rows`), so a float copy of the whole weight never exists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.quant.pack import Packed, dequantize, fit_group, quantize_int4, quantize_int8
from tapllm.quant.schemes import Quantization


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` quantized by ``quant``; ``bits`` and ``group`` follow from it and ``K``."""

    kernels: Any = None  # tapllm's fused kernel ops when they run (set by CausalLM.use_kernels)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: Quantization
                 ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        if quant.method == "int4":
            group = fit_group(quant.group or 128, in_features)
            if group is None:
                raise ValueError(f"int4 needs input sizes divisible by 32, got {in_features}")
            self.bits, self.group = 4, group
            self.register_buffer("q", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("mins", torch.zeros(out_features, in_features // group))
        else:
            self.bits, self.group = 8, in_features
            self.register_buffer("q", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.mins = None
        self.register_buffer("scales", torch.zeros(out_features, in_features // self.group))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @staticmethod
    def supports(quant: Quantization, in_features: int) -> bool:
        """Whether a weight with ``in_features`` inputs can take ``quant`` (int4 groups need multiples of 32)."""
        return quant.method == "int8" or fit_group(quant.group or 128, in_features) is not None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant: Quantization) -> QuantLinear:
        """A layer quantizing ``weight`` ``[N, K]`` (e.g. a tied embedding used as the LM head)."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, quant)
        layer.load_rows(None, weight)
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    def load_rows(self, offset: int | None, value: torch.Tensor) -> None:
        """Quantize checkpoint rows ``value`` into rows ``offset..`` (``None``: the whole weight)."""
        start = 0 if offset is None else offset
        if value.dim() != 2 or value.shape[1] != self.in_features or start + value.shape[0] > self.out_features:
            raise ValueError(f"quantized weight rows of shape {tuple(value.shape)} do not fit "
                             f"[{self.out_features}, {self.in_features}] at row {start}")
        p = quantize_int4(value, self.group) if self.bits == 4 else quantize_int8(value)
        rows = slice(start, start + value.shape[0])
        self.q[rows] = p.q
        self.scales[rows] = p.scales
        if p.mins is not None:
            self.mins[rows] = p.mins

    def as_packed(self) -> Packed:
        """The packed weight as a :class:`Packed`."""
        return Packed(self.q, self.scales, self.mins, self.bits, self.group)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return dequantize(self.as_packed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.quant_linear(x, self.q, self.scales, self.mins, self.bias, self.bits, self.group)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantized(), bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.quant.describe()}, group={self.group}"


def quantize_linears(model: nn.Module, quant: Quantization, linear_type: type) -> int:
    """Replace every ``linear_type`` module of ``model`` (before loading) by a :class:`QuantLinear`
    with empty storage; returns how many. Layers whose input size int4 cannot group stay as they are."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not linear_type:
                continue
            n, k = child.weight.shape
            if not QuantLinear.supports(quant, k):
                continue
            setattr(parent, name, QuantLinear(k, n, child.bias is not None, child.weight.dtype, quant))
            count += 1
    return count
