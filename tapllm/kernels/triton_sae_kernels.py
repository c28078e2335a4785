"""The Triton kernel of SAE features (launched by :mod:`tapllm.kernels.triton_sae`).

This module imports triton at the top; :mod:`tapllm.kernels.triton_sae` imports it only when the
kernel is about to run. One program per row of encoder pre-activations ``pre`` (``x_in @ W_enc +
b_enc``, computed by one matmul outside): it selects latents, decodes them with ``W_dec`` into the
row's reconstruction, measures the error against the row's target, and writes the row's largest
latents, sorted, with the error norm into one int32 row.

Selection is exact: the K-th largest score is found by a radix search over the scores' order keys
(float32 bits mapped to int32 so that integer order is float order), four bits a pass, each pass
counting how many scores reach 16 candidates; the scores above it and the first ties (lowest ids)
are gathered into K slots, packed as ``key << 32 | (2**31 - 1 - id)`` so one integer sort orders them by value,
largest first, then by id.

- ``topk`` SAEs select on ``pre`` (K = the SAE's k); their latents are ``relu`` of those, decoded
  from the K gathered decoder rows;
- ``standard``/``jumprelu`` select on the latents ``z`` themselves (K = the requests' largest k) and
  decode every active latent: tiles of latents with none active are skipped, and inactive rows of
  ``W_dec`` are masked off, so only active rows are read.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# ARCH: the architecture's index in tapllm.kernels.triton_sae.ARCHS (0 standard, 1 jumprelu, 2 topk)
_JUMPRELU = tl.constexpr(1)
_TOPK = tl.constexpr(2)


@triton.jit
def _order_key(v):
    """int32 keys ordered as the float32 values ``v`` (negative floats have their other bits flipped)."""
    b = v.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(k):
    """The float32 value of an order key (the mapping is its own inverse)."""
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _scores(pre_row, thr_ptr, s, ok, ARCH: tl.constexpr):
    """What latents ``s`` are selected by: ``pre`` (topk), else the latents (0 where inactive)."""
    p = tl.load(pre_row + s, mask=ok, other=0.0)
    if ARCH == _TOPK:
        v = p
    else:
        keep = p > 0.0
        if ARCH == _JUMPRELU:
            keep = keep & (p > tl.load(thr_ptr + s, mask=ok, other=0.0))
        v = tl.where(keep, p, 0.0)
    return v


@triton.jit
def sae_features_kernel(
    pre_ptr, thr_ptr, w_dec_ptr, base_ptr, target_ptr, out_ptr,
    d_sae, d_out, stride_pre, stride_w, stride_base, stride_target, stride_out,
    ARCH: tl.constexpr, K: tl.constexpr, K_OUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    COLLECT_S: tl.constexpr, DEC_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Row ``r``: ``out[r] = [K_OUT ids | K_OUT values' float32 bits | error norm's bits]`` (module docstring).

    ``base`` rows (stride 0: ``b_dec`` for every row) start the reconstruction; ``target`` rows (any
    float dtype) are what it is measured against."""
    r = tl.program_id(0).to(tl.int64)
    pre_row = pre_ptr + r * stride_pre
    half = tl.full([], 1, tl.int64) << 31

    # The K-th largest key t (as an offset key in [0, 2**32): int64), four bits a pass.
    digits = tl.arange(0, 16).to(tl.int64)
    t = tl.full([], 0, tl.int64)
    for i in tl.static_range(8):
        shift = 28 - 4 * i
        cand = (t + (digits << shift) - half).to(tl.int32)
        counts = tl.zeros([16], tl.int32)
        for s0 in range(0, d_sae, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ok = s < d_sae
            k = _order_key(_scores(pre_row, thr_ptr, s, ok, ARCH))
            counts += tl.sum(((k[:, None] >= cand[None, :]) & ok[:, None]).to(tl.int32), axis=0)
        t += tl.max(tl.where(counts >= K, digits, 0), axis=0) << shift
    t32 = (t - half).to(tl.int32)

    above = tl.full([], 0, tl.int32)
    for s0 in range(0, d_sae, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < d_sae
        k = _order_key(_scores(pre_row, thr_ptr, s, ok, ARCH))
        above += tl.sum((ok & (k > t32)).to(tl.int32), axis=0)
    ties = K - above  # keys equal to t taken, lowest ids first

    # Gather the K selected into slots, packed so that one sort orders them.
    slots = tl.arange(0, BLOCK_K)
    floor = tl.full([BLOCK_K], -9223372036854775807 - 1, tl.int64)
    packed = floor
    taken = tl.full([], 0, tl.int32)
    tied = tl.full([], 0, tl.int32)
    for s0 in range(0, d_sae, COLLECT_S):
        s = s0 + tl.arange(0, COLLECT_S)
        ok = s < d_sae
        k = _order_key(_scores(pre_row, thr_ptr, s, ok, ARCH))
        is_tie = ok & (k == t32)
        rank = tied + tl.cumsum(is_tie.to(tl.int32), axis=0) - 1
        take = (ok & (k > t32)) | (is_tie & (rank < ties))
        n = tl.sum(take.to(tl.int32), axis=0)
        if n > 0:
            place = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            code = (k.to(tl.int64) << 32) + (2147483647 - s).to(tl.int64)
            hit = take[:, None] & (place[:, None] == slots[None, :])
            packed = tl.maximum(packed, tl.max(tl.where(hit, code[:, None], floor[None, :]), axis=0))
        taken += n
        tied += tl.sum(is_tie.to(tl.int32), axis=0)
    packed = tl.sort(packed, descending=True)
    hi = packed >> 32
    ids = (2147483647 - (packed - (hi << 32))).to(tl.int32)
    vals = _key_value(hi.to(tl.int32))
    if ARCH == _TOPK:
        vals = tl.where(vals > 0.0, vals, 0.0)
    out_row = out_ptr + r * stride_out
    first = slots < K_OUT
    tl.store(out_row + slots, ids, mask=first)
    tl.store(out_row + K_OUT + slots, vals.to(tl.int32, bitcast=True), mask=first)

    # The reconstruction and its error, BLOCK_D numbers of the output row at a time.
    use = (slots < K) & (vals > 0.0)
    weight = tl.where(use, vals, 0.0)
    err = tl.full([], 0.0, tl.float32)
    for d0 in range(0, d_out, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dok = d < d_out
        y = tl.load(base_ptr + r * stride_base + d, mask=dok, other=0.0)
        if ARCH == _TOPK:
            w = tl.load(w_dec_ptr + ids.to(tl.int64)[:, None] * stride_w + d[None, :],
                        mask=use[:, None] & dok[None, :], other=0.0)
            y += tl.sum(weight[:, None] * w, axis=0)
        else:
            for s0 in range(0, d_sae, DEC_S):
                s = s0 + tl.arange(0, DEC_S)
                z = _scores(pre_row, thr_ptr, s, s < d_sae, ARCH)
                if tl.max(z, axis=0) > 0.0:
                    w = tl.load(w_dec_ptr + s.to(tl.int64)[:, None] * stride_w + d[None, :],
                                mask=(z > 0.0)[:, None] & dok[None, :], other=0.0)
                    y += tl.sum(z[:, None] * w, axis=0)
        x = tl.load(target_ptr + r * stride_target + d, mask=dok, other=0.0).to(tl.float32)
        diff = tl.where(dok, x - y, 0.0)
        err += tl.sum(diff * diff, axis=0)
    tl.store(out_row + 2 * K_OUT, tl.sqrt(err).to(tl.int32, bitcast=True))


# Whether @triton.jit made interpreted kernels (TRITON_INTERPRET=1 when triton was imported): they run on CPU tensors.
INTERPRETED = not isinstance(sae_features_kernel, JITFunction)
