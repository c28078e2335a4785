"""Decode-sized linears on oneDNN-prepacked bfloat16 or float32 weights, read in place (packed_gemv.cpp).

oneDNN's call on a prepacked weight costs 20-40 us at a small model's decode shapes, so the
121 linears of a batch-1 step ran at about half the memory bandwidth. tapllm's kernel reads the
very buffer oneDNN packed (no second copy), for steps of at most :data:`MAX_ROWS` rows; larger
ones keep oneDNN's call. It assumes oneDNN's AVX512 layouts (bf16: blocks of 64 outputs x input
pairs; float32: 64 outputs x inputs), so it is used only after this module's probe ran it, per
dtype, against oneDNN on shapes that pad both dimensions; a CPU without AVX512-BF16 (bf16) or AVX512
(float32), or a layout it cannot read, keeps oneDNN, and the log says so. A passing probe is
remembered beside the kernel build (:mod:`tapllm.kernels.trials`). ``TAPLLM_PACKED_GEMV=0`` turns it off.

oneDNN packs a weight for the row count it is told (:data:`PACK_ROWS`); where it runs AMX it packs
for 16 rows a tile layout (outputs in blocks of 32) that the kernel does not read, and for one row
the AVX512 layout it does, so the probe tries that next (:func:`pack_rows`): the GEMV then reads the
one-row packing and larger steps' oneDNN calls run on it too (still on AMX tiles, measured ~15% below
the 16-row layout's GEMM at 512 rows on one core).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tapllm.kernels import build_folder
from tapllm.kernels.constants import GEMV_MAX_ROWS
from tapllm.kernels.trials import recall, remember

logger = logging.getLogger("tapllm")

MAX_ROWS = GEMV_MAX_ROWS  # the C++ kernel and the decoder runner read the same number (constants.py)

_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the dtypes the kernel reads

PACK_ROWS = 16  # the row count oneDNN packs linear weights for by default (its layout for larger steps)

_state: dict[tuple[int, torch.dtype], tuple[bool, str, int]] = {}
_ON = "on (oneDNN's packed layout read in place)"
_ON_ONE_ROW = ("on (weights packed for one row, the layout the kernel reads: this CPU's oneDNN packs another "
               "for more rows, an AMX tile layout)")


def packed_gemv_ops(ops: Any, dtype: torch.dtype = torch.bfloat16) -> Any | None:
    """``ops`` when its packed GEMV runs correctly on this CPU's packed ``dtype`` weights, else None."""
    if ops is None or dtype not in _NAMES:
        return None
    key = (id(ops), dtype)
    if key not in _state:
        _state[key] = _probe(ops, dtype)
        ok, reason, _ = _state[key]
        (logger.info if ok else logger.warning)("packed %s GEMV for <= %d rows: %s", _NAMES[dtype], MAX_ROWS, reason)
    return ops if _state[key][0] else None


def packed_gemv_status(ops: Any, dtype: torch.dtype) -> str:
    """Why the packed GEMV is on or off for ``dtype`` weights (probing it first if needed)."""
    if dtype not in _NAMES:
        return f"off (the kernel reads {', '.join(_NAMES.values())} weights, not {dtype})"
    packed_gemv_ops(ops, dtype)
    return _state[(id(ops), dtype)][1]


# Where weights are packed for one row (an AMX CPU), oneDNN's calls run on AMX tiles and beat the kernel
# from 4 rows (measured on a 2-core Xeon, one linear of the default model: 1 row 11-16 us against 26-32, 2
# rows 16-23 against 26-33, 4 rows even, 16 rows 90-284 against 30-78): the kernel takes steps of 2 rows.
ONE_ROW_PACKING_MAX_ROWS = 2


def gemv_rows(ops: Any, dtype: torch.dtype) -> int:
    """The most rows a step's linears take the GEMV for (:data:`MAX_ROWS`, fewer where weights are packed
    for one row: :data:`ONE_ROW_PACKING_MAX_ROWS`); 0 when it is off."""
    if packed_gemv_ops(ops, dtype) is None:
        return 0
    return MAX_ROWS if pack_rows(ops, dtype) == PACK_ROWS else ONE_ROW_PACKING_MAX_ROWS


def pack_rows(ops: Any, dtype: torch.dtype) -> int:
    """The row count to pack ``dtype`` linear weights for (``torch.ops.mkldnn._reorder_linear_weight``):
    :data:`PACK_ROWS`, or 1 where only that layout is one the GEMV reads (module docstring)."""
    if ops is None or dtype not in _NAMES:
        return PACK_ROWS
    packed_gemv_ops(ops, dtype)
    return _state[(id(ops), dtype)][2]


def _probe(ops: Any, dtype: torch.dtype) -> tuple[bool, str, int]:
    ok, reason = _why_off(ops, dtype)
    if not ok:
        return False, reason, PACK_ROWS
    folder = build_folder(ops)
    problem = None
    for rows, on in ((PACK_ROWS, _ON), (1, _ON_ONE_ROW)):
        trial = f"packed_gemv_{_NAMES[dtype]}" + ("" if rows == PACK_ROWS else f"_rows{rows}")
        if recall(folder, trial):
            return True, on, rows
        problem = _compare_with_onednn(ops, dtype, rows)
        if problem is None:
            remember(folder, trial, True)
            return True, on, rows
        if "blocked layout" not in problem:  # the kernel read the layout and disagreed: not a layout to skip
            break
    return False, problem, PACK_ROWS


def _why_off(ops: Any, dtype: torch.dtype) -> tuple[bool, str]:
    from tapllm.utils.platform import cpu_support

    if os.environ.get("TAPLLM_PACKED_GEMV", "1") == "0":
        return False, "off (TAPLLM_PACKED_GEMV=0): oneDNN's call"
    if dtype == torch.bfloat16:
        if not hasattr(ops, "packed_gemv_supported") or not ops.packed_gemv_supported():
            return False, "off (no AVX512-BF16 in this build or CPU): oneDNN's call"
    elif not hasattr(ops, "packed_gemv_f32_supported") or not ops.packed_gemv_f32_supported():
        return False, "off (no AVX512 in this build): oneDNN's call"
    if dtype not in cpu_support().packable:
        return False, f"off ({_NAMES[dtype]} weights are not packed here)"
    return True, ""


def _compare_with_onednn(ops: Any, dtype: torch.dtype, rows_packed: int) -> str | None:
    """Run the kernel against oneDNN, on weights packed for ``rows_packed`` rows, on shapes that pad both
    dimensions; why it is off, or None."""
    g = torch.Generator().manual_seed(0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    try:
        for n, k in ((130, 72), (64, 33), (520, 576)):  # padded and exact N and K, an odd K; 9 blocks
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_packed)
            view = ops.packed_view(packed)
            for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, MAX_ROWS):
                x = torch.randn(rows, k, generator=g).to(dtype)
                for bias in (None, b):
                    want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "").float()
                    got = ops.packed_linear(x, view, bias).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if not err < tol:  # a wrong layout gives an error of order 1
                        return f"off (disagrees with oneDNN at {n}x{k}, {rows} rows: {err:.2e}): oneDNN's call"
    except Exception as exc:  # noqa: BLE001 - any failure means: keep oneDNN's call
        return f"off ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}): oneDNN's call"
    return None


# Entries (row, column, value) of a weight, sampled before packing, against which a packed view is checked.
Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sample_entries(weight: torch.Tensor, count: int = 512) -> Sample:
    """``count`` entries of ``weight`` ``[N, K]`` at seeded random places, and its corners."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(n * 7919 + k)
    rows = torch.cat([torch.randint(0, n, (count,), generator=g), torch.tensor([0, 0, n - 1, n - 1])])
    cols = torch.cat([torch.randint(0, k, (count,), generator=g), torch.tensor([0, k - 1, 0, k - 1])])
    return rows, cols, weight[rows, cols].clone()


def reads(view: torch.Tensor, sample: Sample) -> bool:
    """Whether the kernel finds ``sample``'s entries where it reads them in ``view`` (:func:`packed_view` of
    the sampled weight, packed): oneDNN's layout for a shape can change with the row count it packs for, the
    CPU and the thread count while the byte count that ``packed_view`` checks stays the same."""
    rows, cols, values = sample
    kpad = view.shape[1]
    if view.dtype == torch.bfloat16:  # blocks of 64 outputs x K/2 pairs of inputs
        at = (rows // 64) * (64 * kpad) + (cols // 2) * 128 + (rows % 64) * 2 + cols % 2
    else:  # float32: blocks of 64 outputs x K
        at = (rows // 64) * (64 * kpad) + cols * 64 + rows % 64
    flat = view.reshape(-1)
    inside = at < flat.numel()  # a last partial block may reach past the view's rows
    return bool(inside.any()) and torch.equal(flat[at[inside]], values[inside].to(view.dtype))
