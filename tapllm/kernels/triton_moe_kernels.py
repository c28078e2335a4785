"""The Triton kernels of the fused mixture-of-experts experts (launched by :mod:`tapllm.kernels.triton_moe`).

This module imports triton at the top. Both kernels run one program per (block of ``BLOCK_M``
sorted slots, tile of ``BLOCK_N`` outputs): a block's slots belong to one expert
(:mod:`tapllm.kernels.moe_blocks`), so its program reads that expert's weight tile once for all its
rows; a block of no expert returns at once. Products are summed over the inputs tile by tile in
order into float32 and rounded where the eager path rounds (``F.linear``'s output, the activation,
the product with the routing weight).

``ROWWISE``: the interpreter's ``tl.dot`` is numpy's BLAS, whose sums may change with a row's place in
the tile (OpenBLAS on AMD EPYC), so interpreted tiles sum with ``tl.sum`` (as
:mod:`tapllm.kernels.triton_linear_kernels`); ``UPCAST``: the interpreter multiplies bfloat16 bit
patterns in ``tl.dot``, so its operands go to float32 first (exact). ``EMULATE_RNE``: see
:mod:`tapllm.kernels.triton_rounding`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tapllm.kernels.triton_elementwise_kernels import gated
from tapllm.kernels.triton_rounding import cast_rne, round_rne


@triton.jit
def _tile_product(acc, x, w, UPCAST: tl.constexpr, ROWWISE: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + x @ w`` for ``x`` [M, K] and ``w`` [K, N], in float32."""
    if UPCAST:
        x, w = x.to(tl.float32), w.to(tl.float32)
    if ROWWISE:
        acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
    else:
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(
    x_ptr, w_ptr, pairs_ptr, block_expert_ptr, out_ptr, num_pairs, top_k, hidden, inter,
    stride_x, stride_we, stride_wn, stride_o,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, ROWWISE: tl.constexpr,
):
    """``out[s, n] = act(gate) * up`` for the block's slots ``s``: ``gate``/``up`` its pair's token row of
    ``x`` [T, hidden] through rows ``n`` and ``inter + n`` of its expert's ``w`` [E, 2 * inter, hidden],
    each rounded to the dtype (``F.linear``'s output), then the gated activation (padding slots: zeros)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // top_k, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_x
    gate_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    up_cols = gate_cols + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + offs_k < hidden
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(gate_cols + (k0 + offs_k)[:, None], mask=w_ok, other=0.0)
        wu = tl.load(up_cols + (k0 + offs_k)[:, None], mask=w_ok, other=0.0)
        acc_gate = _tile_product(acc_gate, x, wg, UPCAST, ROWWISE, PRECISION)
        acc_up = _tile_product(acc_up, x, wu, UPCAST, ROWWISE, PRECISION)
    dtype = out_ptr.dtype.element_ty
    out = gated(round_rne(acc_gate, dtype, EMULATE_RNE), round_rne(acc_up, dtype, EMULATE_RNE), ACT, dtype,
                EMULATE_RNE)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :], out, mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(
    a_ptr, w_ptr, pairs_ptr, block_expert_ptr, weights_ptr, out_ptr, num_pairs, inter, hidden,
    stride_a, stride_we, stride_wn, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, ROWWISE: tl.constexpr,
):
    """``out[p, n] = (y * weights[p])`` in the dtype for each real pair ``p`` of the block: ``y`` its slot's
    row of ``a`` [slots, inter] through row ``n`` of its expert's ``w`` [E, hidden, inter], rounded to the
    dtype first (``F.linear``'s output), the product in float32 rounded once (``(y * weight).to(dtype)``)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    row_ok = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + offs_k < inter
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _tile_product(acc, a, w, UPCAST, ROWWISE, PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    out = cast_rne(round_rne(acc, dtype, EMULATE_RNE) * weight[:, None], dtype, EMULATE_RNE)
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_o + offs_n[None, :], out,
             mask=row_ok[:, None] & n_ok[None, :])


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = not isinstance(moe_down_kernel, JITFunction)
