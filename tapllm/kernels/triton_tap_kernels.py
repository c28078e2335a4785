"""The Triton kernel of a graph step's tap site (launched by :mod:`tapllm.kernels.triton_tap`).

This module imports triton at the top; :mod:`tapllm.kernels.triton_tap` imports it only when a
kernel is about to run. One program per batch row: it looks its row's slot up in the tables,
applies the slot's steering operations at this site whose position range holds the row's
position (in the order the request listed them, each rounded to the tensor's dtype as the eager
operation is), then, when the row is captured, stores it at the row's place in the capture buffer.
A row with nothing to do loads three numbers and stops. The row keeps x's dtype's values between
operations, so storing it (to x, or to a capture buffer of x's dtype) needs no further rounding. Rows are ``GROUPS x WIDTH`` tiles (heads x
head_dim for head points), so a direction's coefficient is taken per group.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tapllm.kernels.triton_rounding import round_rne
from tapllm.tap import tables

# An operation's kind is the first of its OP_FIELDS numbers (see tapllm.tap.tables); any other kind is a set.
_ADD = tl.constexpr(tables.OP_ADD)
_SCALE = tl.constexpr(tables.OP_SCALE)
_DIRECTION = tl.constexpr(tables.OP_DIRECTION)
OP_FIELDS = tl.constexpr(tables.OP_FIELDS)


@triton.jit
def site_wants(r, site, num_sites, row_slot_ptr, row_base_ptr, cap_off_ptr, st_count_ptr):
    """(steering operations, capture offset, row base) of row ``r`` at ``site``; nothing to do unless
    ``count > 0`` or ``(base >= 0) & (off >= 0)``."""
    entry = tl.load(row_slot_ptr + r).to(tl.int64) * num_sites + site
    return tl.load(st_count_ptr + entry), tl.load(cap_off_ptr + entry), tl.load(row_base_ptr + r)


@triton.jit
def apply_site(x, lane, ok, r, count, off, base, site, num_sites, row_slot_ptr, pos_ptr, cap_out_ptr, st_first_ptr,
               op_ptr, op_value_ptr, pool_ptr, stride_pool, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Row ``r``'s tile ``x`` (float32 ``[groups, width]`` holding ``DTYPE`` values; ``lane`` each number's
    place in the site's row, ``ok`` the numbers that exist) after the slot's operations at ``site``, each
    rounded to ``DTYPE``; the result is also stored in the capture buffer when the row is captured there.
    ``count``/``off``/``base`` come from :func:`site_wants`. A kernel that computes a site's tensor may call
    this on the row it holds instead of launching :func:`tap_site_kernel`."""
    if count > 0:
        entry = tl.load(row_slot_ptr + r).to(tl.int64) * num_sites + site
        pos = tl.load(pos_ptr + r)
        first = tl.load(st_first_ptr + entry).to(tl.int64)
        for i in range(count):
            op = op_ptr + (first + i) * OP_FIELDS
            kind = tl.load(op)
            lo = tl.load(op + 1)
            hi = tl.load(op + 2)
            if (pos >= lo) & (pos < hi):
                row = tl.load(op + 3) + (pos - lo) * tl.load(op + 4)
                v = tl.load(pool_ptr + row * stride_pool + lane, mask=ok, other=0.0)
                if kind == _ADD:
                    x = x + v
                elif kind == _SCALE:
                    x = x * v
                elif kind == _DIRECTION:
                    coef = tl.sum(x * v, axis=1, keep_dims=True)
                    x = x + (tl.load(op_value_ptr + first + i) - coef) * v
                else:
                    x = tl.where(v == v, v, x)  # NaN in the pool row: this number is kept
                x = round_rne(x, DTYPE, EMULATE_RNE)
    if (base >= 0) & (off >= 0):
        tl.store(cap_out_ptr + base + off + lane, x.to(cap_out_ptr.dtype.element_ty), mask=ok)
    return x


@triton.jit
def tap_tile(x, lane, ok, r, site, num_sites, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr,
             st_first_ptr, st_count_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, DTYPE: tl.constexpr,
             EMULATE_RNE: tl.constexpr):
    """:func:`apply_site` on row ``r``'s tile ``x`` when the row has something to do at ``site``, else ``x``
    as it is. The table arguments after ``site`` are in the order of ``triton_tap.site_args``."""
    count, off, base = site_wants(r, site, num_sites, row_slot_ptr, row_base_ptr, cap_off_ptr, st_count_ptr)
    if (count > 0) | ((base >= 0) & (off >= 0)):
        x = apply_site(x, lane, ok, r, count, off, base, site, num_sites, row_slot_ptr, pos_ptr, cap_out_ptr,
                       st_first_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, DTYPE, EMULATE_RNE)
    return x


@triton.jit
def tap_site_kernel(
    x_ptr, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr,
    op_ptr, op_value_ptr, pool_ptr,
    site, num_sites, stride_xt, stride_xg, stride_pool,
    GROUPS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One row of a site's tensor ``x`` (``[T, GROUPS, WIDTH]``, strided rows): steered in place, captured."""
    r = tl.program_id(0)
    count, off, base = site_wants(r, site, num_sites, row_slot_ptr, row_base_ptr, cap_off_ptr, st_count_ptr)
    if (count > 0) | ((base >= 0) & (off >= 0)):
        offs_g = tl.arange(0, BLOCK_G)
        offs_w = tl.arange(0, BLOCK_W)
        ok = (offs_g < GROUPS)[:, None] & (offs_w < WIDTH)[None, :]
        src = x_ptr + r.to(tl.int64) * stride_xt + offs_g[:, None] * stride_xg + offs_w[None, :]
        x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        lane = offs_g[:, None] * WIDTH + offs_w[None, :]
        y = apply_site(x, lane, ok, r, count, off, base, site, num_sites, row_slot_ptr, pos_ptr, cap_out_ptr,
                       st_first_ptr, op_ptr, op_value_ptr, pool_ptr, stride_pool, x_ptr.dtype.element_ty,
                       EMULATE_RNE)
        if count > 0:
            tl.store(src, y.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def prologue_kernel(row_slot_ptr, pos_ptr, last_ptr, cap_rec_ptr, cap_lo_ptr, cap_hi_ptr, cap_last_ptr, row_base_ptr,
                    t, BLOCK: tl.constexpr):
    """Every row's place in the capture buffer (``TapTables.prologue``) in one program: the ``t`` rows'
    numbers captured, from their slots' records, summed in batch order; ``-1`` where a row captures nothing."""
    r = tl.arange(0, BLOCK)
    ok = r < t
    slot = tl.load(row_slot_ptr + r, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + r, mask=ok, other=0)
    last = tl.load(last_ptr + r, mask=ok, other=0) != 0
    rec = tl.load(cap_rec_ptr + slot, mask=ok, other=0)
    inside = ok & (pos >= tl.load(cap_lo_ptr + slot, mask=ok, other=0)) & \
        (pos < tl.load(cap_hi_ptr + slot, mask=ok, other=0)) & \
        (last | (tl.load(cap_last_ptr + slot, mask=ok, other=0) == 0))
    numbers = tl.where(inside, rec, 0)
    ends = tl.cumsum(numbers, 0)
    tl.store(row_base_ptr + r, tl.where(numbers > 0, ends - numbers, -1), mask=ok)


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when triton was imported): they run on CPU tensors.
INTERPRETED = not isinstance(tap_site_kernel, JITFunction)
