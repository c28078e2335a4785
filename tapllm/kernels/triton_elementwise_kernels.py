"""Triton kernels for the elementwise ops of a block (launched by :mod:`tapllm.kernels.triton_elementwise`).

This module imports triton at the top; :mod:`tapllm.kernels.triton_elementwise` imports it
only when a kernel is about to run. Every kernel loads its inputs, computes in float32 and
rounds to the tensor dtype exactly where the eager PyTorch code rounds
(:mod:`tapllm.kernels.reference`), so that a result differs from eager only by the order of a
sum (an RMS) or by the last bit of a transcendental.

``EMULATE_RNE``: see :mod:`tapllm.kernels.triton_rounding`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tapllm.kernels import constants
from tapllm.kernels.triton_rounding import cast_rne as _cast
from tapllm.kernels.triton_rounding import round_rne as _round

# The modes of tapllm.kernels.constants, as the kernels compare them (a kernel reads only constexpr globals).
_RMS_LLAMA: tl.constexpr = tl.constexpr(constants.RMS_LLAMA)
_RMS_FLOAT_SCALE: tl.constexpr = tl.constexpr(constants.RMS_FLOAT_SCALE)
_ACT_SILU: tl.constexpr = tl.constexpr(constants.ACT_SILU)


@triton.jit
def scaled_norm(h, w, MODE: tl.constexpr, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """The normalised float32 row ``h`` times its weight ``w`` in the mode's order, in ``DTYPE``."""
    if MODE == _RMS_LLAMA:  # round, then scale in the dtype
        y = _round(h, DTYPE, EMULATE_RNE) * w
    elif MODE == _RMS_FLOAT_SCALE:
        y = h * w
    else:  # Gemma: 1 + w
        y = h * (1.0 + w)
    return _cast(y, DTYPE, EMULATE_RNE)


@triton.jit
def rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
    MODE: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One row: ``out = norm(x)``; with ``ADD`` first ``x += r`` (rounded, stored in place) and the
    norm of the new ``x``. ``ONE_PASS`` holds the row in one tile of ``BLOCK``; otherwise the row
    is read in tiles twice (squares, then the scaled output)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        ok = offs < n_cols
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            x = _round(x + tl.load(r_row + offs, mask=ok, other=0.0).to(tl.float32), dtype, EMULATE_RNE)
            tl.store(x_row + offs, x.to(dtype), mask=ok)  # exact: x is already rounded
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + offs, scaled_norm(x * rstd, w, MODE, dtype, EMULATE_RNE), mask=ok)
    else:
        squares = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            ok = start + offs < n_cols
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            if ADD:
                x = _round(x + tl.load(r_row + start + offs, mask=ok, other=0.0).to(tl.float32), dtype,
                           EMULATE_RNE)
                tl.store(x_row + start + offs, x.to(dtype), mask=ok)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            ok = start + offs < n_cols
            # the same thread stored these elements of x above (same tile layout): it reads its own writes
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_row + start + offs, scaled_norm(x * rstd, w, MODE, dtype, EMULATE_RNE), mask=ok)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    num_heads, num_kv_heads, q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_cr, stride_st, stride_sr, stride_ch, stride_cblk, stride_crow, stride_slot,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, ROUND: tl.constexpr, WRITE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """One (token, block of heads): rotate-half on the first ``ROT`` dims of ``BLOCK_H`` query heads
    (programs ``< q_blocks``) or key heads (the others), in place. With ``WRITE`` the key programs
    also store their rotated keys and the token's values (not finite: 0) at the token's cache slot
    (``block * PAGE + row``; negative: not stored).

    Dim ``d < ROT / 2`` becomes ``x[d] cos[d] - x[d + ROT/2] sin[d]``, dim ``ROT/2 <= d < ROT``
    ``x[d] cos[d] + x[d - ROT/2] sin[d]``: each element reads its partner with a second load
    instead of a shuffle. ``ROUND`` rounds both products and their sum to the dtype, as eager
    PyTorch does when cos/sin have the dtype of q; without it (float32 cos/sin, or float32 q) they
    stay in float32 and the sum is rounded once.
    """
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    rows, heads, ok, y = rotated_heads(q_ptr, k_ptr, cos_ptr, sin_ptr, t, block, num_heads, num_kv_heads, q_blocks,
                                       stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_cr, stride_st,
                                       stride_sr, HEAD_DIM, ROT, BLOCK_H, BLOCK_D, ROUND, EMULATE_RNE)
    tl.store(rows + offs_d[None, :], y, mask=ok)
    if WRITE:
        if block >= q_blocks:
            v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=ok,
                        other=0.0).to(tl.float32)  # exact; and the interpreter compares bfloat16 as bit patterns
            store_kv(k_cache_ptr, v_cache_ptr, slots_ptr, t, heads, y, v, ok, stride_slot, stride_ch, stride_cblk,
                     stride_crow, PAGE, BLOCK_D)


@triton.jit
def rotated_heads(q_ptr, k_ptr, cos_ptr, sin_ptr, t, block, num_heads, num_kv_heads, q_blocks,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_cr, stride_st, stride_sr,
                  HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  ROUND: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """What program ``(t, block)`` of :func:`rotary_kernel` rotates: ``(rows, heads, ok, y)``, its heads'
    addresses ``[BLOCK_H, 1]`` (in q or k), their numbers ``[BLOCK_H]``, the mask ``[BLOCK_H, BLOCK_D]``
    of the numbers that exist and the rotated heads in q's dtype (not stored)."""
    dtype = q_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    turned = offs_d < ROT
    first = offs_d < ROT // 2
    partner = tl.where(first, offs_d + ROT // 2, offs_d - ROT // 2)
    sign = tl.where(first, -1.0, 1.0)
    # past ROT: y = x * 1 + 0 (then x itself is stored), so an infinite x there makes no NaN on the way
    c = tl.load(cos_ptr + t * stride_ct + offs_d * stride_cr, mask=turned, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + offs_d * stride_sr, mask=turned, other=0.0).to(tl.float32)

    if block < q_blocks:
        heads = block * BLOCK_H + offs_h
        rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        ok = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        heads = (block - q_blocks) * BLOCK_H + offs_h
        rows = k_ptr + t * stride_kt + heads[:, None] * stride_kh
        ok = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(rows + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=ok & turned[None, :], other=0.0).to(tl.float32)
    straight = x * c[None, :]
    turned_in = sign[None, :] * xp * s[None, :]
    if ROUND:
        straight = _round(straight, dtype, EMULATE_RNE)
        turned_in = _round(turned_in, dtype, EMULATE_RNE)
        y = _round(straight + turned_in, dtype, EMULATE_RNE)
    else:
        y = straight + turned_in
    y = _cast(tl.where(turned[None, :], y, x), dtype, EMULATE_RNE)  # dims past ROT: as loaded (exact)
    return rows, heads, ok, y


@triton.jit
def store_kv(k_cache_ptr, v_cache_ptr, slots_ptr, t, heads, k, v, ok, stride_slot, stride_ch, stride_cblk,
             stride_crow, PAGE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``t``'s keys ``k`` (in the cache's dtype) and values ``v`` (float32; not finite: 0) of ``heads``
    at its cache slot (``block * PAGE + row``; negative: not stored)."""
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        dest = heads.to(tl.int64)[:, None] * stride_ch + (slot // PAGE) * stride_cblk \
            + (slot % PAGE) * stride_crow + offs_d[None, :]
        tl.store(k_cache_ptr + dest, k, mask=ok)
        finite = (v == v) & (tl.abs(v) != float("inf"))
        tl.store(v_cache_ptr + dest, tl.where(finite, v, 0.0).to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gated_act_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o,
    ACT: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """One (row, tile of ``BLOCK`` columns): ``act(gate) * up`` of a ``[gate | up]`` row, the
    activation rounded to the dtype before the product (as ``act(gate)`` is a tensor in eager)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_row + inter + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, gated(g, u, ACT, dtype, EMULATE_RNE), mask=ok)


@triton.jit
def gated(g, u, ACT: tl.constexpr, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``act(g) * u`` in ``DTYPE`` from float32 ``g`` and ``u``, the activation rounded before the product."""
    # exp's argument is capped below float32's overflow: past it the quotient is 0 or -0 either way
    if ACT == _ACT_SILU:
        a = g / (1.0 + tl.exp(tl.minimum(-g, 88.0)))
    else:  # GELU's tanh form; 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)), without tanh's cancellation near -1
        a = g / (1.0 + tl.exp(tl.minimum(-1.5957691216057308 * (g + 0.044715 * g * g * g), 88.0)))  # 2 sqrt(2/pi)
    return _cast(_round(a, DTYPE, EMULATE_RNE) * u, DTYPE, EMULATE_RNE)


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when this module was imported):
# they run on CPU tensors.
INTERPRETED = not isinstance(rms_norm_kernel, JITFunction)
