"""Nanoseconds per element of the fused element-wise kernels (rms_norm, add_rms_norm_, gated_act,
rotary_, kv_write) at the default model's shapes (SmolLM2-135M: hidden 576, intermediate 1536,
9 query / 3 KV heads of 64), called as the model calls them, on 1 thread, by CPU time.

    python benchmarks/elementwise.py [--rows 2048 16] [--dtypes bfloat16 float32] [--reps 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from tapllm.kernels import fused_kernels, kernels_status

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 576, 1536, 9, 3, 64, 16


def cpu_ns(fn, elements: int, reps: int, min_s: float = 0.05) -> float:
    """Best over ``reps`` of the CPU time per call of ``fn``, in ns per element."""
    fn()
    calls = 1
    while True:  # enough calls per rep to measure
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        if time.process_time() - t0 >= min_s:
            break
        calls *= 2
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best * 1e9 / elements


def cases(ops, t: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, HIDDEN, generator=g).to(dtype)
    r = torch.randn(t, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    yield "rms_norm", t * HIDDEN, lambda: ops.rms_norm(x, w, 1e-5, 0)
    yield "add_rms_norm_", t * HIDDEN, lambda: ops.add_rms_norm_(x, r, w, 1e-5, 0)  # x drifts; values stay finite
    gu = (torch.randn(t, 2 * INTER, generator=g) * 3).to(dtype)
    yield "gated_act silu", t * INTER, lambda: ops.gated_act(gu, 0)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(t, q_size + 2 * kv_size, generator=g).to(dtype)
    q = qkv[:, :q_size].view(t, HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(t, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(t, KV_HEADS, HEAD_DIM)
    # quarter turns: exact in any dtype, so q and k neither grow nor shrink over the repeated calls
    # (real angles would drive them to inf/NaN or denormals, which no step meets)
    quarter = torch.randint(0, 4, (t, HEAD_DIM // 2), generator=g).double() * (torch.pi / 2)
    cos = torch.cat((quarter.cos(), quarter.cos()), -1).round().to(dtype)
    sin = torch.cat((quarter.sin(), quarter.sin()), -1).round().to(dtype)
    yield "rotary_", t * (HEADS + KV_HEADS) * HEAD_DIM, lambda: ops.rotary_(q, k, cos, sin)
    blocks = (t + BLOCK - 1) // BLOCK * 2
    kc = torch.zeros(KV_HEADS, blocks, BLOCK, HEAD_DIM, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * BLOCK, generator=g)[:t].sort().values
    yield "kv_write", 2 * t * kv_size, lambda: ops.kv_write(k, v, kc, vc, slots)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 16])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = fused_kernels()
    assert ops is not None, kernels_status()
    print(f"# {kernels_status()}; ns per element, 1 thread, CPU time (best of {args.reps})")
    print(f"{'op':16} {'dtype':9} {'rows':>5} {'ns/elem':>8} {'us/call':>8}")
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        for t in args.rows:
            for name, n, fn in cases(ops, t, dtype):
                if args.only and args.only not in name:
                    continue
                ns = cpu_ns(fn, n, args.reps)
                print(f"{name:16} {dt:9} {t:5} {ns:8.3f} {ns * n / 1e3:8.2f}", flush=True)


if __name__ == "__main__":
    main()
