"""A block's norms, rotary and gated activation with a graph step's tap sites applied inside the kernel.

:func:`rms_norm_sites` is :func:`~tapllm.kernels.triton_elementwise.rms_norm` (or, given ``r``,
:func:`~tapllm.kernels.triton_elementwise.add_rms_norm_`) that also applies the sites of a
:class:`~tapllm.tap.fused.NormSites` to the row it holds: to ``r`` before the add, to the residual
after it (stored in place), to the normed output. :func:`rotary_sites` is
:func:`~tapllm.kernels.triton_elementwise.rotary_` (or, given the cache, ``rotary_kv_write``)
that applies a :class:`~tapllm.tap.fused.HeadSites`'s sites to q and k after rotary and to v,
before the K/V write. :func:`gated_act_sites` is ``gated_act`` with a site on its output (one
program a row). Each site does what :func:`tapllm.kernels.triton_tap.tap_site` does there (see
:mod:`tapllm.tap.tables`), so the result equals the plain op with ``tap_site`` launches between.

A norm or an activation holds its row in one tile, so rows wider than
:data:`~tapllm.kernels.triton_elementwise.ONE_PASS_WIDTH` (or more sites than the kernel carries)
are not taken: the op returns None and does nothing, and the caller taps as it would without
fusion. Launches depend on shapes and site numbers only (graph-safe). Triton is imported only
when an op runs; under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU
from tapllm.kernels.triton_elementwise import (ONE_PASS_WIDTH, check_heads, check_kv_write, check_norm, check_rows,
                                               check_values, rotary_launch)
from tapllm.kernels.rounding import emulate_rne
from tapllm.kernels.triton_modules import kernels_module
from tapllm.kernels.triton_tap import site_args
from tapllm.tap.fused import HeadSites, KernelSites, NormSites

# The most sites a norm kernel applies at each place: on r, on the residual, on the output.
MAX_ON_R, MAX_ON_X, MAX_ON_OUT = 1, 3, 1


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_fused_sites_kernels")


def _launcher(op: str, t: torch.Tensor, rows: KernelSites) -> tuple[Any, bool]:
    """The kernels' module and whether bfloat16 rounding is emulated, once the tensors are where it runs."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(f"{op}: triton cannot be imported (pip install triton)")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and kernels.INTERPRETED):
        raise ValueError(f"{op}: tensors must be on a CUDA device, or on the CPU with Triton's interpreter on; "
                         f"got {t.device}")
    if rows.tables.device != t.device:
        raise ValueError(f"{op}: the tap tables are on {rows.tables.device}, the rows on {t.device}")
    if rows.row_slot.shape[0] < t.shape[0] or rows.positions.shape[0] < t.shape[0]:
        raise ValueError(f"{op}: row_slot ({rows.row_slot.shape[0]}) and positions ({rows.positions.shape[0]}) "
                         f"must cover the {t.shape[0]} rows")
    return kernels, emulate_rne(kernels.INTERPRETED, t.dtype)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _padded(sites: tuple[int, ...], n: int) -> tuple[int, ...]:
    return sites + (0,) * (n - len(sites))


def rms_norm_sites(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, mode: int,
                   sites: NormSites) -> torch.Tensor | None:
    """The norm of rows ``x`` [T, N] (with ``r``: of ``x += r``, in place) in ``mode``'s order, with
    ``sites`` applied (the residual, steered, is stored in ``x``); None when the rows or sites do not
    fit one kernel (then nothing is done: see the module docstring)."""
    op = "rms_norm_sites"
    check_norm(op, x, w, mode)
    if r is not None:
        check_rows(op, "r", r, like=x)
    elif sites.on_r:
        raise ValueError(f"{op}: sites on r without r")
    rows, width = x.shape
    if width > ONE_PASS_WIDTH or len(sites.on_r) > MAX_ON_R or len(sites.on_x) > MAX_ON_X \
            or len(sites.on_out) > MAX_ON_OUT:
        return None
    kernels, emulate = _launcher(op, x, sites.rows)
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = _pow2(width)
    kernels.rms_norm_sites_kernel[(rows,)](
        x, x if r is None else r, w, out, width, float(eps), x.stride(0), 0 if r is None else r.stride(0),
        out.stride(0), *_padded(sites.on_r, MAX_ON_R), *_padded(sites.on_x, MAX_ON_X),
        *_padded(sites.on_out, MAX_ON_OUT), *site_args(sites.rows.tables, sites.rows.row_slot, sites.rows.positions),
        MODE=mode, ADD=r is not None, ON_R=len(sites.on_r), ON_X=len(sites.on_x), ON_OUT=len(sites.on_out),
        STORE_X=r is not None or bool(sites.on_x), BLOCK=block, EMULATE_RNE=emulate,
        num_warps=min(16, max(1, block // 512)))
    return out


def gated_act_sites(gate_up: torch.Tensor, mode: int, rows: KernelSites, site: int) -> torch.Tensor | None:
    """``act(gate) * up`` of rows ``gate_up`` [T, 2I] in ``mode`` (as ``gated_act``), with ``site`` applied;
    None when a row is wider than one tile (then nothing is done)."""
    op = "gated_act_sites"
    check_rows(op, "gate_up", gate_up)
    t, width = gate_up.shape
    inter = width // 2
    if width % 2:
        raise ValueError(f"{op}: gate_up must have an even number of columns [gate | up]; got {width}")
    if mode not in (ACT_SILU, ACT_GELU_TANH):
        raise ValueError(f"{op}: mode must be {ACT_SILU} (SiLU) or {ACT_GELU_TANH} (GELU, tanh form); got {mode}")
    if inter > ONE_PASS_WIDTH:
        return None
    kernels, emulate = _launcher(op, gate_up, rows)
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    block = _pow2(inter)
    kernels.gated_act_sites_kernel[(t,)](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), site,
        *site_args(rows.tables, rows.row_slot, rows.positions), ACT=mode, BLOCK=block, EMULATE_RNE=emulate,
        num_warps=min(16, max(4, block // 512)))
    return out


def rotary_sites(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, sites: HeadSites) -> None:
    """Rotary in place on ``q`` [T, H, D] and ``k`` [T, Hkv, D] with cos/sin ``[T, R]``, then ``sites``
    on q, k and on ``v`` [T, Hkv, D] (steered in place); with ``write`` ``(k_cache, v_cache,
    slot_mapping)`` the keys and values are then stored in the cache, as ``rotary_kv_write`` does."""
    op = "rotary_sites"
    check_heads(op, q, k, cos, sin)
    check_values(op, q, k, v)
    if write is not None:
        check_kv_write(op, q, k, *write)
    kernels, emulate = _launcher(op, q, sites.rows)
    if q.shape[0] == 0:
        return
    grid, args, constexprs = rotary_launch(q, k, cos, sin, v, write)
    on = (sites.q, sites.k, sites.v)
    kernels.rotary_sites_kernel[grid](
        *args, *(0 if s is None else s for s in on),
        *site_args(sites.rows.tables, sites.rows.row_slot, sites.rows.positions), **constexprs,
        ON_Q=sites.q is not None, ON_K=sites.k is not None, ON_V=sites.v is not None, EMULATE_RNE=emulate,
        num_warps=4)
