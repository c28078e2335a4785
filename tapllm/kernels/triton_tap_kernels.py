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
def tap_site_kernel(
    x_ptr, row_slot_ptr, pos_ptr, row_base_ptr, cap_off_ptr, cap_out_ptr, st_first_ptr, st_count_ptr,
    op_ptr, op_value_ptr, pool_ptr,
    site, num_sites, stride_xt, stride_xg, stride_pool,
    GROUPS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    r = tl.program_id(0)
    slot = tl.load(row_slot_ptr + r).to(tl.int64)
    entry = slot * num_sites + site
    count = tl.load(st_count_ptr + entry)
    base = tl.load(row_base_ptr + r)
    off = tl.load(cap_off_ptr + entry)
    captured = (base >= 0) & (off >= 0)
    if (count > 0) | captured:
        offs_g = tl.arange(0, BLOCK_G)
        offs_w = tl.arange(0, BLOCK_W)
        ok = (offs_g < GROUPS)[:, None] & (offs_w < WIDTH)[None, :]
        src = x_ptr + r.to(tl.int64) * stride_xt + offs_g[:, None] * stride_xg + offs_w[None, :]
        x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        if count > 0:
            pos = tl.load(pos_ptr + r)
            lane = offs_g[:, None] * WIDTH + offs_w[None, :]
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
                        coef = tl.sum(x * v, axis=1)
                        x = x + (tl.load(op_value_ptr + first + i) - coef)[:, None] * v
                    else:
                        x = tl.where(v == v, v, x)  # NaN in the pool row: this number is kept
                    x = round_rne(x, x_ptr.dtype.element_ty, EMULATE_RNE)
            tl.store(src, x.to(x_ptr.dtype.element_ty), mask=ok)
        if captured:
            dst = cap_out_ptr + base + off + offs_g[:, None] * WIDTH + offs_w[None, :]
            tl.store(dst, x.to(cap_out_ptr.dtype.element_ty), mask=ok)


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when triton was imported): they run on CPU tensors.
INTERPRETED = not isinstance(tap_site_kernel, JITFunction)
