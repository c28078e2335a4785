"""Triton kernels for attention over the paged KV cache (launched by :mod:`tapllm.kernels.triton_attention`).

This module imports triton at the top; :mod:`tapllm.kernels.triton_attention` imports it
only when a kernel is about to run. The cache is head-major, ``[Hkv, blocks, page, D]``
with contiguous rows; a key at position ``p`` of a sequence lives in block ``table[p // page]``
at row ``p % page``. Every kernel reads keys from the blocks in place (a tile of ``BLOCK_N``
keys may span several blocks: each key looks its block up), masks positions past the
sequence so nothing outside it is read, and accumulates in float32 with an online softmax in
base 2 (``qk_mul`` folds the score scale and log2(e) together; with a soft-cap, ``qk_mul`` is
``scale / cap`` and ``cap_mul`` is ``cap * log2(e)``, so ``tanh`` is applied to ``s / cap``).

The query heads that share a KV head are packed as rows of one tile, so their keys are
loaded once (GQA): decode rows are the group's heads, prefill rows are (token, head) pairs.
Key tiles that every row of a tile sees (before its first query, inside its last query's
window) skip the masks; only the tiles at the edges are masked (``_attend_keys``).
``UPCAST`` (set by the wrapper under Triton's interpreter only; the GPU keeps its ``tl.dot``) turns
the dot operands to float32 after they are loaded and rounded as on the GPU (exact for halves) and
sums the products with ``tl.sum``: the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns
(triton-lang/triton#11584) and is numpy's BLAS matmul, which may sum a row in another order at
another place of the tile (OpenBLAS on AMD EPYC does), where a GPU's row depends on its own values.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def _tile(q, qpos, acc, m_i, l_i, k_head, v_head, table_row, kstart, hi, window, qk_mul, cap_mul,
          stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt,
          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
          SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr):
    """Fold keys ``kstart .. kstart + BLOCK_N - 1`` into the online softmax of ``q``'s rows.

    ``MASKED``: the tile may hold keys at or past ``hi`` (never read), past a row's position
    ``qpos`` or out of its window; without it every key of the tile is visible to every row.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pos = kstart + offs_n
    inside = pos < hi
    if MASKED:
        blk = tl.load(table_row + (pos // PAGE) * stride_tw, mask=inside, other=0).to(tl.int64)
        k_ok = inside[None, :] & d_ok[:, None]
        v_ok = inside[:, None] & d_ok[None, :]
    else:
        blk = tl.load(table_row + (pos // PAGE) * stride_tw).to(tl.int64)
        k_ok = d_ok[:, None] & (offs_n >= 0)[None, :]
        v_ok = (offs_n >= 0)[:, None] & d_ok[None, :]
    row = pos % PAGE
    kt = tl.load(k_head + (blk * stride_kblk + row * stride_kt)[None, :] + offs_d[:, None],
                 mask=k_ok, other=0.0)  # [BLOCK_D, BLOCK_N]
    if UPCAST:
        kt = kt.to(tl.float32)
    if UPCAST:
        s = tl.sum(q[:, :, None] * kt[None, :, :], axis=1) * qk_mul
    else:
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_mul
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^2x + 1); e^2x is capped where tanh is 1 in float32 (no inf)
        s = (1.0 - 2.0 / (tl.exp2(tl.minimum(s * 2.8853900817779268, 64.0)) + 1.0)) * cap_mul
    if MASKED:
        seen = inside[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            seen = seen & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    vt = tl.load(v_head + (blk * stride_vblk + row * stride_vt)[:, None] + offs_d[None, :],
                 mask=v_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(vt.dtype)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.sum(pv.to(tl.float32)[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(q, qpos, k_head, v_head, table_row, lo, full_lo, full_hi, hi, window, qk_mul, cap_mul,
                 stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt,
                 ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The online softmax of ``q``'s rows over keys ``lo .. hi - 1``: (unnormalised sum, running max,
    denominator). Keys ``full_lo .. full_hi - 1`` (tile-aligned, ``lo <= full_lo <= full_hi``) are
    visible to every row and skip the masks; the tiles either side are masked."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for kstart in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _tile(q, qpos, acc, m_i, l_i, k_head, v_head, table_row, kstart, hi, window, qk_mul,
                              cap_mul, stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt, HEAD_DIM, PAGE,
                              BLOCK_D, BLOCK_N, SOFTCAP, WINDOW, True, PRECISION, UPCAST)
    for kstart in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _tile(q, qpos, acc, m_i, l_i, k_head, v_head, table_row, kstart, hi, window, qk_mul,
                              cap_mul, stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt, HEAD_DIM, PAGE,
                              BLOCK_D, BLOCK_N, SOFTCAP, WINDOW, False, PRECISION, UPCAST)
    for kstart in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _tile(q, qpos, acc, m_i, l_i, k_head, v_head, table_row, kstart, hi, window, qk_mul,
                              cap_mul, stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt, HEAD_DIM, PAGE,
                              BLOCK_D, BLOCK_N, SOFTCAP, WINDOW, True, PRECISION, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _split_plan(seq_len, window, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                WINDOW: tl.constexpr):
    """How a decode row of ``seq_len`` keys splits: (first visible key, first key of split 0,
    splits it needs, keys per split). Its keys from the tile holding the first visible one are
    shared evenly, in whole tiles, by as many splits as give each ``MIN_TILES`` tiles (at least
    one, at most ``num_splits``); the split and reduce kernels agree through this alone."""
    if WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    base = first // BLOCK_N * BLOCK_N
    span = seq_len - base
    needed = tl.minimum(tl.maximum((span + MIN_TILES * BLOCK_N - 1) // (MIN_TILES * BLOCK_N), 1), num_splits)
    split_keys = ((span + needed - 1) // needed + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return first, base, needed, split_keys


@triton.jit
def decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_mul, cap_mul, window, num_splits, table_width,
    stride_qb, stride_qh, stride_kh, stride_kblk, stride_kt, stride_vh, stride_vblk, stride_vt,
    stride_tb, stride_tw, stride_lb, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One (sequence, KV head, split): the split's share of the row's keys against the group's query heads.

    A row that needs one split (see ``_split_plan``) stores its normalised output here; one that
    needs more stores each split's unnormalised sum, running max and denominator in the partial
    buffers (``SPLIT``) for the reduction. Programs past the splits a row needs do nothing.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # A length past the table (bad input) is clamped so that no table entry past the row is read.
    seq_len = tl.minimum(tl.load(lens_ptr + b.to(tl.int64) * stride_lb).to(tl.int32), table_width * PAGE)
    first, base, needed, split_keys = _split_plan(seq_len, window, num_splits, BLOCK_N, MIN_TILES, WINDOW)
    if split < needed:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        lo = base + split * split_keys
        hi = tl.minimum(lo + split_keys, seq_len)
        full_hi = tl.maximum(hi // BLOCK_N * BLOCK_N, lo)
        full_lo = tl.minimum(tl.maximum((first + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), full_hi)
        qpos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)
        acc, m_i, l_i = _attend_keys(
            q, qpos, k_ptr + kvh.to(tl.int64) * stride_kh, v_ptr + kvh.to(tl.int64) * stride_vh,
            tables_ptr + b.to(tl.int64) * stride_tb, lo, full_lo, full_hi, hi, window, qk_mul, cap_mul,
            stride_tw, stride_kblk, stride_kt, stride_vblk, stride_vt,
            BLOCK_G, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, SOFTCAP, WINDOW, PRECISION, UPCAST)
        ok = g_ok[:, None] & d_ok[None, :]
        if needed == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=ok)
        if SPLIT:
            if needed > 1:
                # partials are [B, H, splits(, HEAD_DIM)] float32, contiguous
                slot = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
                tl.store(part_m_ptr + slot, m_i, mask=g_ok)
                tl.store(part_l_ptr + slot, l_i, mask=g_ok)
                tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=ok)


@triton.jit
def decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, lens_ptr, out_ptr, window, num_splits, table_width,
    stride_lb, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, WINDOW: tl.constexpr,
):
    """One (sequence, query head): merge the partial softmaxes of the splits its row needed into the
    output row (a row that needed one split was stored by it)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.minimum(tl.load(lens_ptr + b.to(tl.int64) * stride_lb).to(tl.int32), table_width * PAGE)
    _, _, needed, _ = _split_plan(seq_len, window, num_splits, BLOCK_N, MIN_TILES, WINDOW)
    if needed > 1:
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < needed
        d_ok = offs_d < HEAD_DIM
        base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
        m = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
        l = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))  # 0 for splits that saw no key
        total = tl.sum(l * w, 0)
        acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=d_ok)


@triton.jit
def _query_block(q_ptr, k_ptr, v_ptr, out_ptr, table_row, start, n, ctx, t0, kvh, num_rows, key_limit,
                 window, qk_mul, cap_mul, stride_qt, stride_qh, stride_kh, stride_kblk, stride_kt,
                 stride_vh, stride_vblk, stride_vt, stride_tw, stride_ot, stride_oh,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                 WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INVARIANT: tl.constexpr):
    """Tokens ``t0 .. t0 + BLOCK_Q - 1`` of a chunk of ``n`` (batch rows from ``start``, positions from
    ``ctx``) times KV head ``kvh``'s query heads, as ``BLOCK_M`` rows: causal attention over the
    chunk's keys in the cache (context and itself), stored to ``out``.

    ``INVARIANT`` (batch_invariant): every key tile takes the masked path, so a row's arithmetic does
    not depend on the rows it shares a tile with (which tiles skip the masks does). Its tiles start
    at multiples of ``BLOCK_N``; a tile before its window or after its position only adds exact zeros
    (the running max and sums unchanged), so the row's result is the same bits in any block, alone
    as a decode row or inside a chunk of any size."""
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < n) & (start + tok < num_rows)
    d_ok = offs_d < HEAD_DIM
    q_rows = (start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = ctx + tok

    # Keys up to the block's last query (never past the table). Those up to its first query (and,
    # with a window, in its last query's window) are seen by every row: no masks there.
    t_last = tl.minimum(t0 + BLOCK_Q, n) - 1
    hi = tl.minimum(ctx + t_last + 1, key_limit)
    full_hi = tl.minimum(ctx + t0 + 1, hi) // BLOCK_N * BLOCK_N
    if WINDOW:
        lo = tl.maximum(ctx + t0 - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(ctx + t_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_hi = tl.maximum(full_hi, lo)
        full_lo = tl.maximum(tl.minimum(full_lo, full_hi), lo)
    else:
        lo = full_hi * 0
        full_lo = lo
    if INVARIANT:
        full_lo = lo
        full_hi = lo
    acc, m_i, l_i = _attend_keys(
        q, qpos, k_ptr + kvh.to(tl.int64) * stride_kh, v_ptr + kvh.to(tl.int64) * stride_vh, table_row,
        lo, full_lo, full_hi, hi, window, qk_mul, cap_mul, stride_tw, stride_kblk, stride_kt, stride_vblk,
        stride_vt, BLOCK_M, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, SOFTCAP, WINDOW, PRECISION, UPCAST)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lens_ptr, contexts_ptr, tables_ptr,
    qk_mul, cap_mul, window, table_width, num_rows,
    stride_qt, stride_qh, stride_kh, stride_kblk, stride_kt, stride_vh, stride_vblk, stride_vt,
    stride_tc, stride_tw, stride_sc, stride_lc, stride_cc, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INVARIANT: tl.constexpr,
):
    """One (query tile, chunk, KV head): ``BLOCK_Q`` of the chunk's tokens times the group's heads
    as ``BLOCK_M`` rows, causal over the chunk's cached context and itself."""
    tile = tl.program_id(0)
    c = tl.program_id(1)
    kvh = tl.program_id(2)
    n = tl.load(lens_ptr + c * stride_lc).to(tl.int32)
    if tile * BLOCK_Q >= n:
        return
    start = tl.load(starts_ptr + c * stride_sc).to(tl.int32)
    ctx = tl.load(contexts_ptr + c * stride_cc).to(tl.int32)
    _query_block(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr + c.to(tl.int64) * stride_tc, start, n, ctx,
                 tile * BLOCK_Q, kvh, num_rows, table_width * PAGE, window, qk_mul, cap_mul,
                 stride_qt, stride_qh, stride_kh, stride_kblk, stride_kt, stride_vh, stride_vblk, stride_vt,
                 stride_tw, stride_ot, stride_oh, GROUP, HEAD_DIM, PAGE, BLOCK_M, BLOCK_Q, BLOCK_D, BLOCK_N,
                 SOFTCAP, WINDOW, PRECISION, UPCAST, INVARIANT)


@triton.jit
def unified_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_rows_ptr, cu_ptr, ctx_ptr,
    qk_mul, cap_mul, window, table_width, num_rows, num_seqs,
    stride_qt, stride_qh, stride_kh, stride_kblk, stride_kt, stride_vh, stride_vblk, stride_vt,
    stride_tr, stride_tw, stride_sr, stride_cu, stride_ctx, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    INVARIANT: tl.constexpr,
):
    """One (program, KV head) of a ragged step: program ``p`` zeroes the padding rows among batch rows
    ``p * BLOCK_Q ..`` and attends one query block of one sequence, or nothing.

    Sequence ``s``'s query blocks are programs ``cu[s] // BLOCK_Q + s ..``: these starts grow by at
    least the blocks of the sequence before, and the last ends by ``num_rows // BLOCK_Q + num_seqs``,
    so a grid of ``cdiv(num_rows, BLOCK_Q) + num_seqs`` programs covers every block of any split
    of the rows; a program finds its sequence by counting the starts at or before it.
    """
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    used = tl.minimum(tl.load(cu_ptr + num_seqs * stride_cu).to(tl.int32), num_rows)
    if p * BLOCK_Q + BLOCK_Q > used:
        rows = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        tok = p * BLOCK_Q + rows // GROUP
        pad = (rows < BLOCK_Q * GROUP) & (tok >= used) & (tok < num_rows)
        o_rows = tok.to(tl.int64) * stride_ot + (kvh * GROUP + rows % GROUP) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=pad[:, None] & (offs_d < HEAD_DIM)[None, :])

    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_seqs
    firsts = tl.load(cu_ptr + offs_s * stride_cu, mask=s_ok, other=0).to(tl.int32) // BLOCK_Q + offs_s
    s = tl.sum((s_ok & (firsts <= p)).to(tl.int32), 0) - 1
    start = tl.load(cu_ptr + s * stride_cu).to(tl.int32)
    n = tl.load(cu_ptr + (s + 1) * stride_cu).to(tl.int32) - start
    t0 = (p - (start // BLOCK_Q + s)) * BLOCK_Q
    if t0 < n:
        row = tl.load(seq_rows_ptr + s * stride_sr).to(tl.int64)
        ctx = tl.load(ctx_ptr + s * stride_ctx).to(tl.int32)
        _query_block(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr + row * stride_tr, start, n, ctx, t0, kvh,
                     num_rows, table_width * PAGE, window, qk_mul, cap_mul,
                     stride_qt, stride_qh, stride_kh, stride_kblk, stride_kt, stride_vh, stride_vblk, stride_vt,
                     stride_tw, stride_ot, stride_oh, GROUP, HEAD_DIM, PAGE, BLOCK_M, BLOCK_Q, BLOCK_D, BLOCK_N,
                     SOFTCAP, WINDOW, PRECISION, UPCAST, INVARIANT)


@triton.jit
def kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cblk, stride_ct, stride_slot,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token: its keys and values, every KV head, to flat slot ``block * PAGE + row``
    (skipped when the slot is negative); values that are not finite are stored as 0."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t.to(tl.int64) * stride_slot).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    row = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ct
    dest = offs_h.to(tl.int64)[:, None] * stride_ch + row + offs_d[None, :]
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=ok)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
    v = v.to(tl.float32)  # exact; and the interpreter compares bfloat16 as bit patterns
    finite = (v == v) & (tl.abs(v) != float("inf"))
    tl.store(v_cache_ptr + dest, tl.where(finite, v, 0.0).to(v_cache_ptr.dtype.element_ty), mask=ok)


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when triton was imported): they run on CPU tensors.
INTERPRETED = not isinstance(decode_split_kernel, JITFunction)
