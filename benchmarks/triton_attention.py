"""tapllm's Triton attention over the paged KV cache, on a CUDA device, against two peers.

Decode: the Triton kernel (keys read from scattered blocks in place, split over programs)
against the eager paged path it replaces (``_decode_attention``: gather, then two matmuls) and
against SDPA over contiguous K/V (no paging at all: what a dense cache costs). Each is timed
as the CUDA backend runs decode steps, replayed from a CUDA graph (GPU time per call), and the
Triton op once more launched from Python. Printed: time per call, the K/V bytes read over
that time, and the ratios. Prefill: the Triton kernel on
chunks in one launch against SDPA's causal kernel per chunk on contiguous K/V (keys repeated
per query head beforehand, so it may take its flash path). Unified: a ragged step (chunks and
decodes) in one graph-safe launch against the same step split over the prefill and decode
kernels. Decode rows also run in a table as wide as a 128k context (what a graph captured at
max_model_len passes): each row splits its own keys, so the width costs nothing. Heads are
Llama-3-8B's (32 query heads, 8 KV heads, head size 128), bf16, block size 16.

Run: ``PYTHONPATH=. python benchmarks/triton_attention.py`` (needs CUDA and triton).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tapllm.kernels import triton_attention as ta
from tapllm.layers.attention import AttentionMetadata, AttentionOptions, _decode_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def _bench(fn) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, cache flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def _paged(batch: int, length: int, dtype: torch.dtype):
    blocks = -(-length // PAGE)
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(KV_HEADS, num_blocks, PAGE, DIM, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks] + 1).view(batch, blocks).int()
    return k_cache, v_cache, tables


def _graphed(fn, calls: int = 20):
    """``fn`` captured ``calls`` times in one CUDA graph: a replay's time over ``calls`` is the GPU's
    time per call, without the host's launch overhead (the backend replays decode steps so)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return lambda: graph.replay(), calls


def decode(batch: int, length: int, dtype: torch.dtype, width_keys: int = 0) -> None:
    """``width_keys``: pad the block table to this many keys (entries past a row's length are never read)."""
    k_cache, v_cache, tables = _paged(batch, length, dtype)
    if width_keys > tables.shape[1] * PAGE:
        pad = tables.new_zeros(batch, width_keys // PAGE - tables.shape[1])
        tables = torch.cat([tables, pad], dim=1)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM, dtype=dtype, device="cuda")
    scale = DIM**-0.5
    keys = torch.arange(tables.shape[1] * PAGE, device="cuda")
    meta = AttentionMetadata(slot_mapping=lens, num_decodes=batch, decode_block_tables=tables.long(),
                             decode_mask=(keys[None, :] >= lens[:, None])[:, None, :], prefills=[],
                             decode_lens=lens.long())
    opts = AttentionOptions(scale=scale)
    kd = torch.randn(batch, KV_HEADS, length, DIM, dtype=dtype, device="cuda")
    vd = torch.randn_like(kd)
    qd = q[:, :, None, :]
    calls = {
        "triton": lambda: ta.decode_attention(q, k_cache, v_cache, tables, lens, scale),
        "eager": lambda: _decode_attention(q, k_cache, v_cache, meta, opts),
        "sdpa_dense": lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True),
    }
    eager_ms = _bench(calls["triton"])
    times = {}
    for name, fn in calls.items():
        replay, n = _graphed(fn)
        times[name] = _bench(replay) / n
    gbs = 2 * batch * length * KV_HEADS * DIM * q.element_size() / (times["triton"] * 1e-3) / 1e9
    splits = ta.decode_splits(batch, KV_HEADS, tables.shape[1] * PAGE)
    print(f"decode B={batch:<4} L={length:<6} W={tables.shape[1] * PAGE:<6} splits={splits:<3} "
          f"(row uses {ta.row_splits(length, splits)}) graphed: triton {times['triton'] * 1e3:7.1f} us "
          f"({gbs:5.0f} GB/s)  eager {times['eager'] * 1e3:7.1f} us  sdpa(dense) {times['sdpa_dense'] * 1e3:7.1f} us  "
          f"eager/triton {times['eager'] / times['triton']:5.2f}x  "
          f"sdpa/triton {times['sdpa_dense'] / times['triton']:5.2f}x"
          f"  | triton launched from Python {eager_ms * 1e3:6.1f} us")


def prefill(chunks: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """``chunks`` as (context, length): one Triton launch against one SDPA call per chunk."""
    totals = [c + n for c, n in chunks]
    k_cache, v_cache, _ = _paged(1, sum(-(-t // PAGE) for t in totals) * PAGE, dtype)
    width = max(-(-t // PAGE) for t in totals)
    order = torch.randperm(k_cache.shape[1] - 1, device="cuda") + 1
    tables, used = torch.zeros(len(chunks), width, dtype=torch.int32, device="cuda"), 0
    for i, t in enumerate(totals):
        nb = -(-t // PAGE)
        tables[i, :nb] = order[used : used + nb]
        used += nb
    rows = sum(n for _, n in chunks)
    q = torch.randn(rows, HEADS, DIM, dtype=dtype, device="cuda")
    starts = torch.tensor([sum(n for _, n in chunks[:i]) for i in range(len(chunks))], device="cuda")
    lens = torch.tensor([n for _, n in chunks], device="cuda")
    contexts = torch.tensor([c for c, _ in chunks], device="cuda")
    scale = DIM**-0.5
    dense = [(torch.randn(1, HEADS, n, DIM, dtype=dtype, device="cuda"),
              torch.randn(1, HEADS, c + n, DIM, dtype=dtype, device="cuda"),
              torch.randn(1, HEADS, c + n, DIM, dtype=dtype, device="cuda"), c) for c, n in chunks]

    def sdpa() -> None:
        for qc, kc, vc, c in dense:
            if c == 0:
                F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
            else:  # queries at the end of their keys: a bottom-right causal mask
                n, t = qc.shape[2], kc.shape[2]
                mask = torch.ones(n, t, dtype=torch.bool, device="cuda").tril(t - n)
                F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)

    max_len = max(n for _, n in chunks)
    t_triton = _bench(lambda: ta.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, scale,
                                                   0, 0.0, max_len))
    t_sdpa = _bench(sdpa)
    flops = sum(4 * n * (c + (n + 1) / 2) * HEADS * DIM for c, n in chunks)  # causal: the pairs that count
    print(f"prefill chunks={chunks}  triton {t_triton:7.3f} ms ({flops / t_triton / 1e9:6.0f} TFLOP/s)  "
          f"sdpa {t_sdpa:7.3f} ms  sdpa/triton {t_sdpa / t_triton:5.2f}x")


def unified(seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """A step of sequences as (context, new rows): one unified launch against the prefill kernel on
    its chunks plus the decode kernel on its decodes (rows of one token)."""
    totals = [c + n for c, n in seqs]
    need = [-(-t // PAGE) for t in totals]
    k_cache, v_cache, _ = _paged(1, sum(need) * PAGE, dtype)
    order = torch.randperm(k_cache.shape[1] - 1, device="cuda") + 1
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = order[used : used + nb]
        used += nb
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], HEADS, DIM, dtype=dtype, device="cuda")
    as_index = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    seq_rows, cu_q, ctx = as_index(list(range(len(seqs)))), as_index(cu), as_index([c for c, _ in seqs])
    dec = [i for i, (_, n) in enumerate(seqs) if n == 1]
    chunk = [i for i, (_, n) in enumerate(seqs) if n > 1]
    scale = DIM**-0.5
    qd, dec_tables, dec_lens = q[: len(dec)], tables[dec], as_index([totals[i] for i in dec])
    starts, lens = as_index([cu[i] for i in chunk]), as_index([seqs[i][1] for i in chunk])
    contexts, chunk_tables = as_index([seqs[i][0] for i in chunk]), tables[chunk]
    max_len = max([seqs[i][1] for i in chunk] + [1])

    def split() -> None:
        if chunk:
            ta.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, chunk_tables, scale, 0, 0.0, max_len)
        if dec:
            ta.decode_attention(qd, k_cache, v_cache, dec_tables, dec_lens, scale)

    t_unified = _bench(lambda: ta.unified_attention(q, k_cache, v_cache, tables, seq_rows, cu_q, ctx, scale))
    t_split = _bench(split)
    shown = seqs if len(seqs) <= 6 else f"{len(chunk)} chunks, {len(dec)} decodes"
    print(f"unified step={shown}  unified {t_unified:7.3f} ms  prefill+decode kernels {t_split:7.3f} ms  "
          f"split/unified {t_split / t_unified:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for batch, length in ((1, 4096), (1, 32768), (16, 4096), (64, 2048), (256, 1024)):
        decode(batch, length, dtype)
    for batch, length in ((1, 8192), (8, 8192)):
        decode(batch, length, dtype, width_keys=131072)
    for chunks in ([(0, 4096)], [(0, 512)] * 8, [(6144, 2048)], [(0, 1000), (3000, 500), (0, 37), (100, 2000)]):
        prefill(chunks, dtype)
        unified(chunks, dtype)
    for seqs in ([(4000, 1)] * 64, [(1000, 1)] * 256, [(2000, 1)] * 32 + [(0, 2048)], [(8000, 1)] * 4 + [(512, 512)]):
        unified(seqs, dtype)


if __name__ == "__main__":
    main()
