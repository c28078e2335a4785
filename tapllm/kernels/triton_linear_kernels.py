"""The Triton kernel of the batch-invariant linear (launched by :mod:`tapllm.kernels.triton_linear`).

This module imports triton at the top. Every output element ``y[m, n]`` is one program's
``BLOCK_M x BLOCK_N`` tile: its products over the inputs are summed by ``tl.dot`` in tiles of
``BLOCK_K`` inputs, from input 0 up, into one float32 accumulator, whatever the number of rows;
the tile sizes are constants of the launcher, never chosen from the rows, and nothing is split
over the inputs. The row count is not specialised on (``do_not_specialize``), so a step of one
row runs the very code a step of 500 runs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tapllm.kernels.triton_rounding import cast_rne


@triton.jit(do_not_specialize=["rows"])
def linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, rows, n_out, k_in, stride_xm, stride_wn, stride_om,
    BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, ROWWISE: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of ``out = x @ w.T (+ b)``: ``x`` [rows, k_in], ``w`` [n_out, k_in]
    (inputs contiguous), the sum over the inputs tile by tile in order, the bias added in float32,
    one rounding to the output's dtype. Rows and outputs past the ends read zeros and store nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    n_ok = offs_n < n_out
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = k0 + offs_k < k_in
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (exact in float32)
            x, w = x.to(tl.float32), w.to(tl.float32)
        if ROWWISE:  # the interpreter's tl.dot is numpy's BLAS, whose sums may change with a row's place
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = cast_rne(acc, out_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out,
             mask=m_ok[:, None] & n_ok[None, :])


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = not isinstance(linear_kernel, JITFunction)
