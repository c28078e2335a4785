"""Quantize float weights into the block layouts of tapllm's ``quant_linear`` kernel, and back.

A packed weight is one ``uint8 [N, G, B]`` tensor: per output row, ``G`` blocks of
``g = K / G`` inputs, each ``B`` bytes, laid out as GGUF lays out its blocks (so GGUF files'
Q8_0 / Q4_1 / Q4_0 / Q4_K / Q6_K tensors are packed weights as stored):

- int8: float16 ``d``, then ``g`` int8 ``q``; ``w = d * q`` (``B = 2 + g``; Q8_0 when g = 32);
- int4: float16 ``d``, float16 ``m``, then ``g/2`` bytes; ``w = d * q + m``, ``q`` in 0..15
  (``B = 4 + g/2``; Q4_1 when g = 32);
- Q4_0: float16 ``d``, then 16 bytes; ``w = d * (q - 8)`` (``B = 18``, g = 32);
- Q4_K and Q6_K, GGUF's K-quant super-blocks of 256 inputs (``B = 144`` and ``210``), read from
  GGUF files only (:func:`dequantize` spells out their layout).

In 4-bit blocks each run of 32 weights takes 16 bytes: byte j holds weight j in its low
nibble and weight j + 16 in its high nibble. Quantization is row-local, so a fused parameter
(q/k/v stacked) can be quantized one checkpoint tensor at a time. The scales are rounded to
float16 before the integers are chosen, so the stored block is the best one for its scale.
"""

from __future__ import annotations

import torch

_ROWS = 4096  # rows quantized at once: bounds the float32 temporaries of a large embedding
INT8, INT4, Q4_0, Q4_K, Q6_K = "int8", "int4", "q4_0", "q4_k", "q6_k"
SUPER = 256  # inputs per K-quant super-block


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
    if g == SUPER and nbytes in (144, 210):
        return Q4_K if nbytes == 144 else Q6_K
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


def _int8_rows(w: torch.Tensor, group: int, amax: torch.Tensor | None = None) -> torch.Tensor:
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    d16 = ((wg.abs().amax(-1) if amax is None else amax.float().reshape(n, 1)) / 127).to(torch.float16)
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


def quantize_int8(w: torch.Tensor, group: int | None = None, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric 8-bit blocks: one scale per output channel (``group=None``) or per ``group`` inputs.
    ``amax`` ``[N]`` (per output channel only): each row's largest magnitude to scale by, where ``w`` holds
    a slice of longer rows (a tensor-parallel rank's); by default its own."""
    k = w.shape[1]
    group = k if group is None else group
    if group % 32 or k % group:
        raise ValueError(f"int8 blocks need a multiple of 32 inputs dividing the input size {k}, got {group}")
    if amax is not None and group != k:
        raise ValueError("a row scale (amax) applies to one scale per output channel (group=None)")
    return torch.cat([_int8_rows(w[i : i + _ROWS], group, None if amax is None else amax[i : i + _ROWS])
                      for i in range(0, w.shape[0], _ROWS)])


def _q4_k_rows(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    wg = w.float().reshape(n, k // SUPER, 8, 32)
    lo = wg.amin(-1).clamp(max=0)  # Q4_K's mins are subtracted and non-negative: a positive run starts at 0
    scale, mn = (wg.amax(-1) - lo) / 15, -lo  # [n, G, 8] per run
    d16, dmin16 = (scale.amax(-1) / 63).to(torch.float16), (mn.amax(-1) / 63).to(torch.float16)
    d, dmin = d16.float()[..., None], dmin16.float()[..., None]
    sc = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))).clamp_(0, 63)
    m = torch.round(mn / torch.where(dmin > 0, dmin, torch.ones_like(dmin))).clamp_(0, 63)
    step, offset = d * sc, dmin * m
    q = torch.round((wg + offset[..., None]) / torch.where(step > 0, step, torch.ones_like(step))[..., None])
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, k // SUPER, 4, 2, 32)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    packed = torch.cat((sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)), dim=-1)  # 12 bytes
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // SUPER, 128)
    return torch.cat((_halves(d16), _halves(dmin16), packed, qs), dim=-1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_K super-blocks of ``w`` (``K`` a multiple of 256): per run of 32 inputs a 6-bit
    scale and min, times a float16 ``d`` / ``dmin`` per 256 (one rounding pass, none of
    llama.cpp's iterative search for the scales)."""
    k = w.shape[1]
    if k % SUPER:
        raise ValueError(f"Q4_K needs an input size that is a multiple of {SUPER}, got {k}")
    return torch.cat([_q4_k_rows(w[i : i + _ROWS]) for i in range(0, w.shape[0], _ROWS)])


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
    if kind == Q4_0:
        q = unpack_nibbles(blocks[..., 2:]).float()
        return (d * (q - 8)).reshape(n, k)
    return (_q4_k(blocks) if kind == Q4_K else _q6_k(blocks)).reshape(n, k)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: float16 d, float16 dmin, 12 bytes packing 8 six-bit scales and mins, 128 bytes of
    nibbles (byte 32c + i: input i of run 2c low, of run 2c + 1 high); run t is
    ``d * sc[t] * q - dmin * m[t]``."""
    n, groups, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    s = blocks[..., 4:16].long()
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), dim=-1).float()
    mn = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), dim=-1).float()
    qs = blocks[..., 16:].reshape(n, groups, 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(n, groups, 8, 32).float()
    return (d * sc)[..., None] * q - (dmin * mn)[..., None]


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 inputs),
    float16 d; ``w = d * sc[i / 16] * (q - 32)``. Each half of 128 inputs takes 64 low bytes
    (nibbles: inputs 0-31 and 32-63 low, 64-95 and 96-127 high) and 32 high bytes (2 bits each
    of inputs l, l + 32, l + 64, l + 96)."""
    n, groups, _ = blocks.shape
    ql = blocks[..., :128].reshape(n, groups, 2, 1, 2, 32)
    qh = blocks[..., 128:192].reshape(n, groups, 2, 1, 1, 32).long()
    low = torch.cat((ql & 15, ql >> 4), dim=-3).long()  # [n, G, half, 2, 2, 32]: run 2 * (nibble) + (ql half)
    high = torch.stack([(qh[..., 0, 0, :] >> (2 * i)) & 3 for i in range(4)], dim=-2).view(n, groups, 2, 2, 2, 32)
    q = ((low | (high << 4)) - 32).reshape(n, groups, 8, 32).float()
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(n, groups, 8, 2)
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()[..., None]  # [n, G, 1, 1]
    return ((d * sc).repeat_interleave(16, dim=-1) * q)


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
