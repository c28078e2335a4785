"""Quantize float weights into the block layouts of tapllm's ``quant_linear`` kernel, and back.

A packed weight is one ``uint8 [N, G, B]`` tensor: per output row, ``G`` blocks of
``g = K / G`` inputs, each ``B`` bytes, laid out as GGUF lays out its blocks (so GGUF files'
Q8_0 / Q4_1 / Q4_0 tensors are packed weights as stored):

- int8: float16 ``d``, then ``g`` int8 ``q``; ``w = d * q`` (``B = 2 + g``; Q8_0 when g = 32);
- int4: float16 ``d``, float16 ``m``, then ``g/2`` bytes; ``w = d * q + m``, ``q`` in 0..15
  (``B = 4 + g/2``; Q4_1 when g = 32);
- Q4_0: float16 ``d``, then 16 bytes; ``w = d * (q - 8)`` (``B = 18``, g = 32).

In 4-bit blocks each run of 32 weights takes 16 bytes: byte j holds weight j in its low
nibble and weight j + 16 in its high nibble. Quantization is row-local, so a fused parameter
(q/k/v stacked) can be quantized one checkpoint tensor at a time. The scales are rounded to
float16 before the integers are chosen, so the stored block is the best one for its scale.
"""

from __future__ import annotations

import torch

_ROWS = 4096  # rows quantized at once: bounds the float32 temporaries of a large embedding
INT8, INT4, Q4_0 = "int8", "int4", "q4_0"


def block_kind(k: int, groups: int, nbytes: int) -> str | None:
    """Which layout ``[N, groups, nbytes]`` blocks of a ``k``-input weight have, or None."""
    if groups <= 0 or k % groups:
        return None
    g = k // groups
    if g % 32 == 0 and nbytes == 2 + g:
        return INT8
    if g % 32 == 0 and nbytes == 4 + g // 2:
        return INT4
    if g == 32 and nbytes == 18:
        return Q4_0
    return None


def fit_group(group: int, k: int) -> int | None:
    """The largest of ``group``, ``group/2``, ... (at least 32) dividing ``k``; None when none does
    (the default model's 576 inputs take 64 when 128 is asked)."""
    while group >= 32:
        if k % group == 0:
            return group
        group //= 2
    return None


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[..., g]`` values in 0..15 (g a multiple of 32) -> ``uint8 [..., g/2]`` in GGUF's order."""
    *lead, g = q.shape
    runs = q.to(torch.uint8).reshape(*lead, g // 32, 2, 16)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*lead, g // 2)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    *lead, half = b.shape
    runs = b.reshape(*lead, half // 16, 16)
    return torch.stack((runs & 15, runs >> 4), dim=-2).reshape(*lead, half * 2)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """float16 ``[N, G]`` as its bytes ``uint8 [N, G, 2]``."""
    return t.contiguous().view(torch.uint8).view(*t.shape, 2)


def _int4_rows(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d16, m16 = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    d, m = d16.float(), m16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))  # a constant group: q = 0, w = m
    q = torch.round((wg - m[..., None]) / safe[..., None]).clamp_(0, 15)
    return torch.cat((_halves(d16), _halves(m16), pack_nibbles(q)), dim=-1)


def _int8_rows(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    d16 = (wg.abs().amax(-1) / 127).to(torch.float16)
    d = d16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(wg / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat((_halves(d16), q.view(torch.uint8)), dim=-1)


def quantize_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Asymmetric 4-bit blocks of ``group`` inputs (a multiple of 32 dividing ``K``)."""
    k = w.shape[1]
    if group % 32 or k % group:
        raise ValueError(f"int4 group {group} must be a multiple of 32 dividing the input size {k}")
    return torch.cat([_int4_rows(w[i : i + _ROWS], group) for i in range(0, w.shape[0], _ROWS)])


def quantize_int8(w: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Symmetric 8-bit blocks: one scale per output channel (``group=None``) or per ``group`` inputs."""
    k = w.shape[1]
    group = k if group is None else group
    if group % 32 or k % group:
        raise ValueError(f"int8 blocks need a multiple of 32 inputs dividing the input size {k}, got {group}")
    return torch.cat([_int8_rows(w[i : i + _ROWS], group) for i in range(0, w.shape[0], _ROWS)])


def dequantize(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that packed ``blocks`` stand for (what every kernel computes with)."""
    n, groups, nbytes = blocks.shape
    kind = block_kind(k, groups, nbytes)
    if kind is None:
        raise ValueError(f"blocks of {nbytes} bytes for {k // max(groups, 1)} inputs match no known layout")
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, G, 1]
    if kind == INT8:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    if kind == INT4:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        q = unpack_nibbles(blocks[..., 4:]).float()
        return (d * q + m).reshape(n, k)
    q = unpack_nibbles(blocks[..., 2:]).float()
    return (d * (q - 8)).reshape(n, k)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last dimension a multiple of 32) rounded to int8 per run of 32 values, as float32:
    ``rint(x * 127 / amax) * amax / 127`` (ties to even), what ``quantize_activations`` feeds the
    quantized linears (tapllm's ``quant_linear`` with ``act_bits=8`` rounds the same way, bit for
    bit). A run of zeros stays zero; a run holding a NaN or an infinity becomes NaN."""
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"activation rounding needs a multiple of 32 inputs, got {k}")
    runs = x.float().reshape(*x.shape[:-1], k // 32, 32)
    amax = runs.abs().amax(-1, keepdim=True)
    ok = (amax > 0) & amax.isfinite()
    inv = torch.where(ok, 127.0 / torch.where(ok, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.round(runs * inv).clamp_(-127, 127)
    return (q * (amax / 127)).reshape(x.shape)
