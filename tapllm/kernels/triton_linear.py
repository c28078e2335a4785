"""A linear whose every row's result is independent of the rows around it: the CUDA backend's
linears under ``batch_invariant`` (:mod:`tapllm.kernels.triton_linear_kernels`).

A library GEMM (cuBLAS, through ``F.linear``) picks its tiles, its split of the inputs over
thread blocks (split-K) and its kernel from the problem's shape, the row count included, so a
row's sums run in another order when other rows join its step. Here the tile sizes are fixed per
dtype (:data:`TILES`), the inputs are summed tile by tile in one order, nothing is split over the
inputs, and the launch's only dependence on the row count is its number of row tiles: a row gets
the same bits alone or among any others, wherever it sits. That costs some speed against cuBLAS on
large steps (fixed 64-row tiles, no split-K for the few-row steps of decoding).

Launches depend on shapes only (graph-safe). Triton is imported only when the op runs or
:func:`available` is asked; with ``TRITON_INTERPRET=1`` set before triton is imported the kernel
runs in Triton's interpreter on CPU tensors (the tests), bfloat16 products upcast to float32 (exact)
and the rounding to bfloat16 emulated as the GPU does it. The interpreter's ``tl.dot`` is numpy's
matmul, whose BLAS may sum a row in another order at another place of the tile (OpenBLAS on AMD
EPYC does), so interpreted tiles sum their products with ``tl.sum`` instead: a row's sums then
depend on its own values alone, as a GPU's ``tl.dot`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.triton_modules import kernels_module, runs_on

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per dtype: never chosen from the row count.
TILES = {torch.float16: (64, 64, 64, 4, 3), torch.bfloat16: (64, 64, 64, 4, 3), torch.float32: (64, 64, 32, 4, 2)}


def _kernels() -> Any | None:
    """The kernel's module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_linear_kernels")


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: CUDA, or the CPU under Triton's interpreter."""
    return runs_on(_kernels(), device)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [..., K] and ``weight`` [N, K] (``F.linear``'s contract) in x's dtype,
    each row's result the same bits whatever rows come with it.

    Float32 products are not rounded to TF32; halves multiply in their dtype and sum in float32.
    """
    op = "invariant_linear"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x [..., K] and weight [N, K] must agree on K; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{op}: x, weight and bias must share one dtype of float16/bfloat16/float32; got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}]; got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(f"{op}: triton cannot be imported (pip install triton)")
    if not available(x.device):
        raise ValueError(f"{op}: tensors must be on a CUDA device, or on the CPU with Triton's interpreter on "
                         f"(TRITON_INTERPRET=1 before triton is imported); got {x.device}")
    n_out, k_in = weight.shape
    rows = x.reshape(-1, k_in)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=x.dtype, device=x.device)
    if rows.shape[0] and n_out:
        block_m, block_n, block_k, warps, stages = TILES[x.dtype]
        interpreted = kernels.INTERPRETED
        grid = (-(-rows.shape[0] // block_m), -(-n_out // block_n))
        kernels.linear_kernel[grid](
            rows, weight, weight if bias is None else bias, out, rows.shape[0], n_out, k_in,
            rows.stride(0), weight.stride(0), out.stride(0),
            BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            UPCAST=interpreted and x.dtype == torch.bfloat16, EMULATE_RNE=interpreted and x.dtype == torch.bfloat16,
            ROWWISE=interpreted, num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n_out)
