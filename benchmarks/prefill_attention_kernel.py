"""Wall time of the fused prefill_attention op (1 thread unless --threads) on the shapes chunked prefill gives it.

Each call is laid out as the model's prefill batch: q [T, H, D] a view of the fused projection,
head-major paged caches [Hkv, blocks, 16, D] with shuffled block tables. GFLOP/s counts only the
causal half (2 * 2 * D per visible query-key pair and head). In bfloat16 on a CPU that runs AMX
tiles each shape runs twice, on the tiles and on the AVX512 task (``tiles=False``), side by side.

    python benchmarks/prefill_attention_kernel.py [--reps 5] [--check] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from tapllm.kernels import fused_kernels, reference

SHAPES = [  # name, chunks x new tokens, cached context, heads, kv heads, head dim
    ("4x512 new", 4, 512, 0, 9, 3, 64),
    ("1x512 after 1536", 1, 512, 1536, 9, 3, 64),
    ("4x512 new d128", 4, 512, 0, 8, 2, 128),
    ("1x512 after 1536 d128", 1, 512, 1536, 8, 2, 128),
]


def make(chunks: int, n: int, ctx: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, bs: int = 16):
    g = torch.Generator().manual_seed(0)
    per = (ctx + n + bs - 1) // bs
    blocks = chunks * per + 1
    k_cache = torch.randn(kv_heads, blocks, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: chunks * per].view(chunks, per)
    t = chunks * n
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(t, heads, d)
    starts = torch.arange(chunks) * n
    lens = torch.full((chunks,), n)
    contexts = torch.full((chunks,), ctx)
    flops = chunks * heads * 4 * d * sum(ctx + i + 1 for i in range(n))
    return (q, k_cache, v_cache, starts, lens, contexts, tables, d**-0.5, 0, 0.0), flops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="also compare with the float32 reference")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = fused_kernels()
    amx = bool(ops.amx_supported())
    print(f"{args.threads} thread(s); AMX tiles: {'yes' if amx else 'no (this CPU, or TAPLLM_AMX=0)'}")

    def best_of(call: tuple) -> tuple[float, torch.Tensor]:
        ops.prefill_attention(*call)
        best, out = float("inf"), None
        for _ in range(args.reps):
            t0 = time.perf_counter()  # wall time: with several threads, CPU time would add theirs up
            out = ops.prefill_attention(*call)
            best = min(best, time.perf_counter() - t0)
        return best, out

    for dtype in (torch.bfloat16, torch.float32):
        for name, chunks, n, ctx, heads, kv_heads, d in SHAPES:
            call, flops = make(chunks, n, ctx, heads, kv_heads, d, dtype)
            best, out = best_of(call)
            line = f"{str(dtype)[6:]:9s} {name:24s} {best * 1e3:8.2f} ms {flops / best / 1e9:7.1f} GFLOP/s"
            if amx and dtype == torch.bfloat16:
                avx512, _ = best_of((*call, False))
                line += f"  | AVX512 task {avx512 * 1e3:8.2f} ms  tiles {avx512 / best:4.2f}x"
            if args.check:
                want = reference.prefill_attention(*call)
                line += f"  max err {(out.float() - want.float()).abs().max().item():.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
