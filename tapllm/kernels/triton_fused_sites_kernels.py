"""Triton kernels of a block's norms, rotary and gated activation that apply a graph step's tap
sites to the rows they hold (launched by :mod:`tapllm.kernels.triton_fused_sites`).

This module imports triton at the top. Each kernel computes what its plain counterpart in
:mod:`tapllm.kernels.triton_elementwise_kernels` computes and, at the points where the eager
block calls its tap, runs :func:`~tapllm.kernels.triton_tap_kernels.tap_tile` on the float32
tile it holds (the slot's steering operations, each rounded to the dtype, then the capture), so
what the tap sees and what the block goes on with are what the eager step's would be. A row whose
slot taps nothing at a site loads three numbers there. Site numbers are runtime arguments (one
compiled kernel serves every block); how many sites each place has is a constexpr.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tapllm.kernels.triton_elementwise_kernels import gated, rotated_heads, scaled_norm, store_kv
from tapllm.kernels.triton_rounding import round_rne as _round
from tapllm.kernels.triton_tap_kernels import tap_tile


@triton.jit
def rms_norm_sites_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
    r_site, x_site0, x_site1, x_site2, out_site,
    num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr,
    op_ptr, op_value_ptr, pool_ptr, stride_pool,
    MODE: tl.constexpr, ADD: tl.constexpr, ON_R: tl.constexpr, ON_X: tl.constexpr, ON_OUT: tl.constexpr,
    STORE_X: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """One row, held in one ``[1, BLOCK]`` tile: with ``ADD``, site ``r_site`` on ``r`` (``ON_R``) and
    ``x = round(x + r)``; then the ``ON_X`` sites ``x_site*`` on ``x``, ``x`` stored (``STORE_X``); ``out``
    the norm of ``x`` in ``MODE``'s order, and site ``out_site`` on it (``ON_OUT``)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    lane = tl.arange(0, BLOCK)[None, :]
    ok = lane < n_cols
    x_row = x_ptr + row * stride_x
    x = tl.load(x_row + lane, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + lane, mask=ok, other=0.0).to(tl.float32)
        if ON_R > 0:
            r = tap_tile(r, lane, ok, row, r_site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr,
                         cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, dtype,
                         EMULATE_RNE)
        x = _round(x + r, dtype, EMULATE_RNE)
    if ON_X > 0:
        x = tap_tile(x, lane, ok, row, x_site0, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr,
                     cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, dtype,
                     EMULATE_RNE)
    if ON_X > 1:
        x = tap_tile(x, lane, ok, row, x_site1, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr,
                     cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, dtype,
                     EMULATE_RNE)
    if ON_X > 2:
        x = tap_tile(x, lane, ok, row, x_site2, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr,
                     cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, dtype,
                     EMULATE_RNE)
    if STORE_X:
        tl.store(x_row + lane, x.to(dtype), mask=ok)  # exact: x holds dtype values
    rstd = tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / n_cols + eps)
    w = tl.load(w_ptr + lane, mask=ok, other=0.0).to(tl.float32)
    y = scaled_norm(x * rstd, w, MODE, dtype, EMULATE_RNE)
    if ON_OUT > 0:
        y = tap_tile(y.to(tl.float32), lane, ok, row, out_site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr,
                     cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr,
                     stride_pool, dtype, EMULATE_RNE).to(dtype)
    tl.store(out_ptr + row * stride_o + lane, y, mask=ok)


@triton.jit
def rotary_sites_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    num_heads, num_kv_heads, q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_cr, stride_st, stride_sr, stride_ch, stride_cblk, stride_crow, stride_slot,
    q_site, k_site, v_site,
    num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr,
    op_ptr, op_value_ptr, pool_ptr, stride_pool,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, ROUND: tl.constexpr, WRITE: tl.constexpr, ON_Q: tl.constexpr, ON_K: tl.constexpr,
    ON_V: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """``rotary_kernel``'s program ``(token, block of heads)`` with the sites: site ``q_site`` on the
    rotated query heads, ``k_site`` on the rotated key heads and ``v_site`` on the values (the key
    programs load them; stored back in place), each where its ``ON_*`` says, before ``WRITE`` stores
    keys and values at the token's cache slot. A site's number of a head's dim is
    ``head * HEAD_DIM + dim`` (a direction is taken per head)."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    rows, heads, ok, y = rotated_heads(q_ptr, k_ptr, cos_ptr, sin_ptr, t, block, num_heads, num_kv_heads, q_blocks,
                                       stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_cr, stride_st,
                                       stride_sr, HEAD_DIM, ROT, BLOCK_H, BLOCK_D, ROUND, EMULATE_RNE)
    lane = heads[:, None] * HEAD_DIM + offs_d[None, :]
    if block < q_blocks:
        if ON_Q:
            y = tap_tile(y.to(tl.float32), lane, ok, t, q_site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr,
                         cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr,
                         stride_pool, dtype, EMULATE_RNE).to(dtype)
        tl.store(rows + offs_d[None, :], y, mask=ok)
    else:
        if ON_K:
            y = tap_tile(y.to(tl.float32), lane, ok, t, k_site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr,
                         cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr,
                         stride_pool, dtype, EMULATE_RNE).to(dtype)
        tl.store(rows + offs_d[None, :], y, mask=ok)
        v_rows = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
        v = tl.load(v_rows, mask=ok, other=0.0).to(tl.float32)
        if ON_V:
            v = tap_tile(v, lane, ok, t, v_site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr,
                         cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool,
                         dtype, EMULATE_RNE)
            tl.store(v_rows, v.to(dtype), mask=ok)  # exact: v holds dtype values
        if WRITE:
            store_kv(k_cache_ptr, v_cache_ptr, slots_ptr, t, heads, y, v, ok, stride_slot, stride_ch, stride_cblk,
                     stride_crow, PAGE, BLOCK_D)


@triton.jit
def gated_act_sites_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o, site,
    num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr,
    op_ptr, op_value_ptr, pool_ptr, stride_pool,
    ACT: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """One row, held in one ``[1, BLOCK]`` tile (a direction needs the whole row): ``gated_act_kernel``'s
    ``act(gate) * up``, then ``site`` on it."""
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    lane = tl.arange(0, BLOCK)[None, :]
    ok = lane < inter
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + lane, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_row + inter + lane, mask=ok, other=0.0).to(tl.float32)
    y = tap_tile(gated(g, u, ACT, dtype, EMULATE_RNE).to(tl.float32), lane, ok, row, site, num_sites, row_slot_ptr,
                 pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr, op_ptr, op_value_ptr,
                 pool_ptr, stride_pool, dtype, EMULATE_RNE)
    tl.store(out_ptr + row * stride_o + lane, y.to(dtype), mask=ok)


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when triton was imported): they run on CPU tensors.
INTERPRETED = not isinstance(rms_norm_sites_kernel, JITFunction)
