"""Rounding float32 to a tensor's dtype inside tapllm's Triton kernels, as an eager PyTorch op rounds.

``EMULATE_RNE`` is set by a launcher in Triton's interpreter for bfloat16: the interpreter keeps
bfloat16 as bit patterns and casts float32 to it by truncation, so there the rounding to nearest
even that the GPU does is done on the float32 bits first (then the cast is exact).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Float32 ``x`` rounded to ``DTYPE`` (to nearest even)."""
    if EMULATE_RNE:  # add half an ulp of bfloat16 (ties to even), then truncate; NaN kept as it is
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16 << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(DTYPE)


@triton.jit
def round_rne(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Float32 ``x`` rounded to ``DTYPE`` and back to float32 (what an eager op in ``DTYPE`` returns)."""
    return cast_rne(x, DTYPE, EMULATE_RNE).to(tl.float32)
