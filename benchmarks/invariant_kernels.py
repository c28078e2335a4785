"""CPU time of ``batch_invariant``'s kernels against the default mode's, on the default model's shapes.

Linears: the packed GEMV (every step under ``batch_invariant``) against oneDNN's GEMM on the same
prepacked bf16 weight (the default mode's call for steps of more than 64 rows), at prefill-chunk
row counts (``--rows``), for each of the model's four linears (fused q/k/v, o, fused gate/up, down).

Attention: ``row_attention`` (decode rows under ``batch_invariant``) against ``decode_attention``.
One call attends one query row per sequence over its whole context, as a decode step does, on the
default model's attention shape (9 query heads, 3 KV heads, head size 64, bf16) and head-major
paged caches [Hkv, blocks, 16, D]. Each timed pass runs the op once on each of ``--layers``
separate caches, so the keys and values come from memory as in a model's step (a single cache
would stay in the last-level cache). Blocks are shuffled by default; ``--in-order`` gives each
sequence consecutive blocks, as a fresh engine allocates them. The two ops alternate pass by pass
and each keeps its best pass (noise only ever slows a pass); the last column is the ratio.

    python benchmarks/invariant_kernels.py [--rows 512,2048] [--batches 16,64] [--context 576] [--in-order]
"""

from __future__ import annotations

import argparse
import time

import torch

from tapllm.kernels import fused_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LINEARS = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]  # name, N, K


def best_of(fns: dict, passes: int, calls: int) -> dict:
    """Each function's fastest pass of ``calls`` calls, the functions alternating pass by pass."""
    best = {name: float("inf") for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def linears(ops: object, rows: list[int], passes: int) -> None:
    g = torch.Generator().manual_seed(0)
    for m in rows:
        for name, n, k in LINEARS:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g).to(torch.bfloat16), 16)
            view = ops.packed_view(packed)
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            best = best_of({
                "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], ""),
                "gemv": lambda i: ops.packed_linear(x, view, None),
            }, passes, 10)
            flops = 2 * m * n * k
            print(f"rows {m:5d} {name:8s} {n}x{k}: oneDNN {best['onednn'] * 1e6:7.0f} us "
                  f"({flops / best['onednn'] / 1e9:4.0f} GFLOP/s)  packed GEMV {best['gemv'] * 1e6:7.0f} us "
                  f"({flops / best['gemv'] / 1e9:4.0f} GFLOP/s)  GEMV / oneDNN {best['gemv'] / best['onednn']:.3f}")


def caches(batch: int, context: int, layers: int, in_order: bool, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    per = (context + BLOCK - 1) // BLOCK
    blocks = batch * per + 8
    shape = (KV_HEADS, blocks, BLOCK, HEAD_DIM)
    ks = [torch.randn(*shape, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn(*shape, generator=g).to(dtype) for _ in range(layers)]
    order = torch.arange(blocks) if in_order else torch.randperm(blocks, generator=g)
    tables = order[: batch * per].view(batch, per).contiguous()
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, ks, vs, tables, torch.full((batch,), context, dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="512,2048", help="rows of the linears (prefill chunks), comma-separated")
    ap.add_argument("--batches", default="16,64", help="sequences per attention call, comma-separated")
    ap.add_argument("--context", type=int, default=576, help="keys each row attends")
    ap.add_argument("--layers", type=int, default=30, help="separate caches per pass")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--in-order", action="store_true", help="consecutive blocks per sequence")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    ops = fused_kernels()
    if ops is None:
        raise SystemExit("the fused CPU kernels are off here (see the log): nothing to measure")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, bf16")
    if args.rows:
        linears(ops, [int(r) for r in args.rows.split(",")], args.passes)
    print(f"attention: context {args.context}, {args.layers} caches, blocks {'in order' if args.in_order else 'shuffled'}")
    for batch in (int(b) for b in args.batches.split(",") if b):
        q, ks, vs, tables, lens = caches(batch, args.context, args.layers, args.in_order, torch.bfloat16)

        def attend(op: object) -> object:
            return lambda i: op(q, ks[i], vs[i], tables, lens, HEAD_DIM**-0.5, 0, 0.0)

        best = best_of({"dec": attend(ops.decode_attention), "row": attend(ops.row_attention)}, args.passes, len(ks))
        dec, row = best["dec"], best["row"]
        print(f"batch {batch:3d}: decode_attention {dec * 1e6:7.0f} us  row_attention {row * 1e6:7.0f} us  "
              f"row / decode {row / dec:.3f}")


if __name__ == "__main__":
    main()
