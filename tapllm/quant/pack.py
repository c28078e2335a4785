"""Quantize float weights into the packed layouts of tapllm's ``quant_linear`` kernel.

Layouts (see ``tapllm/kernels/csrc/quant.cpp``): 4 bits as ``uint8 [N, K/2]`` where, in
every run of 32 weights, byte j holds weight j in its low nibble and weight j + 16 in its
high nibble (GGUF's Q4_0/Q4_1 order, so those blocks run as stored), ``w = scale * q + min``
with ``q`` in 0..15; 8 bits as ``int8 [N, K]``, ``w = scale * q`` with ``q`` in -127..127.
Scales and mins are float32 ``[N, K / group]``. Quantization is row-local, so a fused
parameter (q/k/v stacked) can be quantized one checkpoint tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ROWS = 4096  # rows quantized at once: bounds the float32 temporaries of a large embedding


@dataclass(slots=True)
class Packed:
    """A packed weight: ``q``, float32 ``scales`` and ``mins`` (4 bits), ``bits``, ``group``."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values in 0..15 -> ``uint8 [N, K/2]`` in the kernel's order (K a multiple of 32)."""
    n, k = q.shape
    runs = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8 [N, K/2]`` -> ``uint8 [N, K]``."""
    n, half = b.shape
    runs = b.view(n, half // 16, 16)
    return torch.stack((runs & 15, runs >> 4), dim=2).reshape(n, half * 2)


def _int4_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, w = min
    q = torch.round((wg - lo[..., None]) / safe[..., None]).clamp_(0, 15)
    return pack_nibbles(q.view(n, k)), scale.contiguous(), lo.contiguous()


def fit_group(group: int, k: int) -> int | None:
    """The largest of ``group``, ``group/2``, ... (at least 32) dividing ``k``; None when none does
    (the default model's 576 inputs take 64 when 128 is asked)."""
    while group >= 32:
        if k % group == 0:
            return group
        group //= 2
    return None


def quantize_int4(w: torch.Tensor, group: int) -> Packed:
    """Asymmetric 4-bit, one (scale, min) per ``group`` input channels; ``K`` must divide by ``group``."""
    n, k = w.shape
    if group % 32 or k % group:
        raise ValueError(f"int4 group {group} must be a multiple of 32 dividing the input size {k}")
    parts = [_int4_rows(w[i : i + _ROWS], group) for i in range(0, n, _ROWS)]
    q, s, m = (torch.cat(t) for t in zip(*parts))
    return Packed(q, s, m, 4, group)


def quantize_int8(w: torch.Tensor) -> Packed:
    """Symmetric 8-bit, one scale per output channel (row)."""
    n, k = w.shape
    qs, ss = [], []
    for i in range(0, n, _ROWS):
        rows = w[i : i + _ROWS].float()
        scale = rows.abs().amax(-1, keepdim=True) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        qs.append(torch.round(rows / safe).clamp_(-127, 127).to(torch.int8))
        ss.append(scale)
    return Packed(torch.cat(qs), torch.cat(ss).contiguous(), None, 8, k)


def dequantize(p: Packed) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that ``p`` stands for (what every kernel must compute with)."""
    if p.bits == 4:
        q = unpack_nibbles(p.q).float()
        n, k = q.shape
        w = q.view(n, k // p.group, p.group) * p.scales[..., None] + p.mins[..., None]
        return w.view(n, k)
    n, k = p.q.shape
    return (p.q.float().view(n, k // p.group, p.group) * p.scales[..., None]).view(n, k)
