"""A graph step's tap at one site, in Triton: steering from the slot tables, then capture (see
:mod:`tapllm.tap.tables` for the tables and :mod:`tapllm.kernels.triton_tap_kernels` for the kernel);
and the step's prologue, which places each captured row in the capture buffer, in one launch.

Triton is imported only when a site runs. On CPU tensors the kernel runs in Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported), which is how the tests check it against
:func:`tapllm.kernels.reference.tap_site`. The launch depends on shapes only (graph-safe).
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.rounding import emulate_rne
from tapllm.kernels.triton_modules import kernels_module, runs_on
from tapllm.tap.sites import Site
from tapllm.tap.tables import TapTables


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_tap_kernels")


def available(device: torch.device) -> bool:
    """Whether the site kernel can run on ``device`` (CUDA, or the CPU under Triton's interpreter)."""
    return runs_on(_kernels(), device)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def tap_site(x: torch.Tensor, site: Site, tables: TapTables, row_slot: torch.Tensor, positions: torch.Tensor) -> None:
    """Steer ``x`` (the site's rows: ``[T, width]`` or ``[T, groups, group_width]``) in place from the
    slots' operations, then copy the captured rows into ``tables.cap_out`` at ``tables.row_base``."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("tap_site: triton cannot be imported (pip install triton)")
    t = x.shape[0]
    if x.dim() == 3:
        if tuple(x.shape[1:]) != (site.groups, site.group_width) or x.stride(2) != 1:
            raise ValueError(f"tap_site: {site.point} rows must be [T, {site.groups}, {site.group_width}] with "
                             f"contiguous last dim; got {tuple(x.shape)}, strides {x.stride()}")
        stride_g = x.stride(1)
    elif x.dim() == 2 and x.shape[1] == site.width and x.stride(1) == 1 and site.groups == 1:
        stride_g = 0
    else:
        raise ValueError(f"tap_site: {site.point} rows must be [T, {site.width}] with contiguous rows; "
                         f"got {tuple(x.shape)}, strides {x.stride()}")
    if row_slot.shape[0] < t or positions.shape[0] < t:
        raise ValueError(f"tap_site: row_slot ({row_slot.shape[0]}) and positions ({positions.shape[0]}) must "
                         f"cover the {t} rows")
    if t == 0:
        return
    kernels.tap_site_kernel[(t,)](
        x, row_slot, positions, tables.row_base, tables.cap_off, tables.cap_out, tables.st_first, tables.st_count,
        tables.ops, tables.op_value, tables.pool,
        site.index, len(tables.sites), x.stride(0), stride_g, tables.pool.stride(0),
        GROUPS=site.groups, WIDTH=site.group_width, BLOCK_G=_pow2(site.groups), BLOCK_W=_pow2(site.group_width),
        EMULATE_RNE=emulate_rne(kernels.INTERPRETED, x.dtype), num_warps=4 if site.width <= 4096 else 8)


def prologue(tables: TapTables, row_slot: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor) -> None:
    """:meth:`TapTables.prologue` (each row's place in the capture buffer, ``tables.row_base``) in one
    launch instead of a dozen small ops; ``last_rows`` is nonzero on the last row of each chunk."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("prologue: triton cannot be imported (pip install triton)")
    t = row_slot.shape[0]
    if positions.shape[0] != t or last_rows.shape[0] != t or tables.row_base.shape[0] < t:
        raise ValueError(f"prologue: row_slot ({t}), positions ({positions.shape[0]}) and last_rows "
                         f"({last_rows.shape[0]}) must be the same rows, at most {tables.row_base.shape[0]}")
    if t == 0:
        return
    block = _pow2(t)
    kernels.prologue_kernel[(1,)](row_slot, positions, last_rows, tables.cap_rec, tables.cap_lo, tables.cap_hi,
                                  tables.cap_last, tables.row_base, t, BLOCK=block,
                                  num_warps=min(16, max(1, block // 256)))


def site_args(tables: TapTables, row_slot: torch.Tensor, positions: torch.Tensor) -> tuple:
    """What a fused kernel passes to ``triton_tap_kernels.site_wants``/``apply_site`` (after the site's
    index): ``(num_sites, row_slot, positions, row_base, cap_off, cap_out, st_first, st_count, ops, op_value,
    pool, pool row stride)``."""
    return (len(tables.sites), row_slot, positions, tables.row_base, tables.cap_off, tables.cap_out,
            tables.st_first, tables.st_count, tables.ops, tables.op_value, tables.pool, tables.pool.stride(0))
