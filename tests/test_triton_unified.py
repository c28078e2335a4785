"""Unified attention (a step's prefill chunks and decodes in one ragged launch) against the eager path.

A step is a list of sequences given as (context, new rows): a decode has one new row, a fresh
prompt context 0, and a padding sequence no rows (its context and table row are garbage: it
must read nothing). The rows are laid out sequence after sequence, then padding rows (NaN
queries) up to the step's token bucket; the sequences' blocks sit in shuffled rows of a
table that also holds a request outside the step. The reference is the eager path's
``_attend`` per sequence over its keys gathered from the cache, in float32. The interpreter's
set-up and the NaN-poisoned cache are ``triton_paged``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_paged import (  # first: it decides Triton's mode before triton is imported
    CUDA_CASES,
    TOL,
    Paged,
    cuda,
    interpret,  # noqa: F401 - a fixture
    options,
)

from tapllm.kernels import triton_attention as ta
from tapllm.layers.attention import AttentionOptions, _attend, gather_keys

_GARBAGE_CONTEXT = 10**6  # a padding sequence's context: reading anything for it would go far out of bounds


@dataclass
class Step:
    """One step's inputs to :func:`ta.unified_attention`, and what the reference needs."""

    paged: Paged
    seqs: list[tuple[int, int]]
    q: torch.Tensor
    block_table: torch.Tensor
    seq_rows: torch.Tensor
    cu_q: torch.Tensor
    ctx: torch.Tensor

    def to(self, device: str) -> Step:
        self.paged.to(device)
        for name in ("q", "block_table", "seq_rows", "cu_q", "ctx"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def _step(g: torch.Generator, seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, page: int,
          dtype: torch.dtype, pad_rows: int = 3, pad_seqs: int = 2, index_dtype: torch.dtype = torch.int64,
          spare: int = 2) -> Step:
    """``seqs`` as (context, new rows), then ``pad_seqs`` padding sequences and ``pad_rows`` padding rows."""
    seqs = list(seqs) + [(0, 0)] * pad_seqs
    real = [i for i, (_, n) in enumerate(seqs) if n]
    totals = [seqs[i][0] + seqs[i][1] for i in real] + [37]  # the last: a request outside the step
    paged = Paged(g, totals, kv_heads, dim, page, dtype, spare=spare, index_dtype=index_dtype, scale=2.0)
    perm = torch.randperm(len(totals), generator=g)
    where = perm.argsort()  # the shuffled table row of each of paged's rows
    rows = [int(where[real.index(i)]) if n else int(where[-1]) for i, (_, n) in enumerate(seqs)]
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1] + pad_rows, heads, dim, generator=g).to(dtype)
    q[cu[-1]:] = float("nan")
    as_index = lambda xs: torch.tensor(xs, dtype=index_dtype)  # noqa: E731
    ctx = [c if n else _GARBAGE_CONTEXT for c, n in seqs]
    return Step(paged, seqs, q, paged.tables[perm], as_index(rows), as_index(cu), as_index(ctx))


def _reference(step: Step, opts: AttentionOptions) -> torch.Tensor:
    """Each sequence's rows through the eager path's ``_attend``, in float32: ``[cu_q[S], H, D]``."""
    cu = step.cu_q.tolist()
    out = torch.zeros((cu[-1],) + tuple(step.q.shape[1:]), dtype=torch.float32, device=step.q.device)
    tables = iter(step.paged.tables_list)
    for s, (c, n) in enumerate(step.seqs):
        if not n:
            continue
        table = next(tables)
        kc = gather_keys(step.paged.k32, table, c + n)[None]
        vc = gather_keys(step.paged.v32, table, c + n)[None]
        qc = step.q[cu[s] : cu[s + 1]].float().transpose(0, 1)[None]
        out[cu[s] : cu[s + 1]] = _attend(qc, kc, vc, c, opts)[0].transpose(0, 1)
    return out


def _run(step: Step, opts: AttentionOptions) -> torch.Tensor:
    p = step.paged
    return ta.unified_attention(step.q, p.k, p.v, step.block_table, step.seq_rows, step.cu_q, step.ctx, opts.scale,
                                opts.window or 0, opts.softcap or 0.0)


def _check(step: Step, opts: AttentionOptions, dtype: torch.dtype) -> torch.Tensor:
    got = _run(step, opts)
    assert got.dtype == step.q.dtype and got.shape == step.q.shape
    used = int(step.cu_q[-1])
    assert torch.equal(got[used:], torch.zeros_like(got[used:]))  # padding rows: zeros
    torch.testing.assert_close(got[:used].float(), _reference(step, opts), rtol=TOL[dtype], atol=TOL[dtype])
    return got


SCORES = ((0, 0.0), (5, 0.0), (0, 3.0), (20, 5.0))  # (window, softcap)

# (heads, kv_heads, head_dim, block_size, dtype, sequences as (context, new rows)): GQA groups 1, 2, 4
# and 8, head sizes 64, 80 and 128, every dtype; decodes only, prefills only, and both, with lengths
# around block and tile edges and padding sequences among the real ones.
UNIFIED_CASES = [
    (2, 2, 64, 16, torch.float32, [(0, 1), (15, 1), (16, 1), (40, 1), (3, 1)]),
    (4, 2, 80, 16, torch.float32, [(0, 17), (0, 1), (5, 30)]),
    (8, 2, 128, 32, torch.float32, [(20, 1), (0, 9), (7, 0), (33, 1), (16, 20)]),
    (8, 1, 64, 8, torch.float32, [(0, 5), (7, 1), (3, 12), (0, 1)]),
    (4, 1, 80, 16, torch.bfloat16, [(17, 1), (0, 0), (0, 25), (20, 8)]),
    (8, 1, 128, 16, torch.bfloat16, [(0, 1), (40, 10), (1, 1)]),
    (4, 2, 128, 64, torch.float16, [(70, 6), (0, 1), (0, 19)]),
    (3, 3, 80, 16, torch.float16, [(9, 1), (0, 7), (31, 2)]),
]


@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype,seqs", UNIFIED_CASES)
def test_unified_matches_the_eager_path(interpret, heads, kv_heads, dim, page, dtype, seqs):
    g = torch.Generator().manual_seed(heads * dim + page + 3)
    step = _step(g, seqs, heads, kv_heads, dim, page, dtype)
    for window, softcap in SCORES:
        _check(step, options(dim, window, softcap), dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_unified_long_continuation_over_many_tiles_and_windows(interpret, index_dtype):
    """A chunk over a long cached context spans several query blocks and key tiles: the tiles every
    query sees (no masks), with and without a window, and the masked ones either side."""
    g = torch.Generator().manual_seed(19)
    step = _step(g, [(150, 40), (130, 1), (0, 70)], 4, 2, 64, 16, torch.float32, index_dtype=index_dtype)
    for window, softcap in ((0, 0.0), (1, 0.0), (64, 0.0), (100, 0.0), (200, 2.0)):
        _check(step, options(64, window, softcap), torch.float32)


def test_unified_bucket_padding_and_strided_queries(interpret):
    """Padding rows over several query blocks, padding sequences first, among and after the real
    ones, a one-row step, int32 indices, and q a strided view of a fused projection."""
    g = torch.Generator().manual_seed(23)
    heads, dim = 8, 64
    step = _step(g, [(0, 0), (12, 1), (0, 0), (0, 3)], heads, 2, dim, 16, torch.float32, pad_rows=40, pad_seqs=3,
                 index_dtype=torch.int32)
    qkv = torch.randn(step.q.shape[0], heads * dim + 48, generator=g)
    qkv[:, : heads * dim] = step.q.reshape(step.q.shape[0], -1)
    step.q = qkv[:, : heads * dim].view(-1, heads, dim)
    for window, softcap in SCORES:
        _check(step, options(dim, window, softcap), torch.float32)
    one = _step(g, [(33, 1)], heads, 2, dim, 16, torch.float32, pad_rows=0, pad_seqs=0)
    _check(one, options(dim, 0, 0.0), torch.float32)


def test_unified_all_padding_reads_nothing(interpret):
    """A step of padding only (every sequence empty, garbage contexts) over an all-NaN cache: zeros."""
    g = torch.Generator().manual_seed(29)
    step = _step(g, [], 4, 2, 64, 16, torch.bfloat16, pad_rows=20, pad_seqs=4)
    step.paged.k.fill_(float("nan"))
    step.paged.v.fill_(float("nan"))
    got = _run(step, options(64, 0, 0.0))
    assert torch.equal(got, torch.zeros_like(got))


def test_unified_bad_input():
    q, cache = torch.zeros(4, 4, 64), torch.zeros(2, 3, 16, 64)
    table, rows = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    cu, ctx = torch.tensor([0, 1, 4], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    bad = [
        ((q, cache, cache, table, rows, cu[:2], ctx), "cu_q must have 3 entries and ctx 2"),
        ((q, cache, cache, table, rows, cu, ctx[:1]), "cu_q must have 3 entries and ctx 2"),
        ((q, cache, cache, table.float(), rows, cu, ctx), "block_table must be a 2-D int32 or int64"),
        ((q, cache, cache, table, rows[None], cu, ctx), "seq_rows must be a 1-D"),
        ((torch.zeros(4, 3, 64), cache, cache, table, rows, cu, ctx), "multiple of the cache's KV heads"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message) as caught:
            ta.unified_attention(*args, 0.1)
        assert str(caught.value).startswith("unified_attention: ")
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        ta.unified_attention(q, cache, cache, table, rows, cu, ctx, 0.1, 0, -1.0)


def test_backend_trial_passes_in_the_interpreter(interpret):
    """The CUDA backend's load-time trial (decode, prefill, and a mixed unified step against the
    PyTorch path), run on the CPU in the interpreter."""
    from tapllm.backends.cuda import TritonAttention, _compare

    assert _compare(torch.device("cpu"), TritonAttention()) is None


# ---- on the GPU, compiled, at real sizes ----------------------------------------------------------

REAL_STEP = [(0, 1024), (2048, 512), (0, 3), (100, 257), (4000, 1)] + [(700 + 37 * i, 1) for i in range(24)]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype", CUDA_CASES)
def test_cuda_unified(heads, kv_heads, dim, page, dtype):
    g = torch.Generator().manual_seed(heads + dim + 2)
    step = _step(g, REAL_STEP, heads, kv_heads, dim, page, dtype, pad_rows=100, pad_seqs=7).to("cuda")
    for window, softcap in ((0, 0.0), (600, 0.0), (0, 50.0)):
        _check(step, options(dim, window, softcap), dtype)


@cuda
@pytest.mark.cuda
def test_cuda_graph_replays_unified_with_new_steps():
    """One capture at a token bucket and a sequence count, replayed with other splits of the rows
    (decodes only, one long chunk, both, padding only) in the same buffers, gives what a fresh call
    gives, and what the reference gives."""
    g = torch.Generator().manual_seed(31)
    heads, kv_heads, dim, page, dtype = 32, 8, 128, 16, torch.bfloat16
    bucket, max_seqs, width = 512, 16, 512
    steps = [
        [(1000 + 97 * i, 1) for i in range(16)],
        [(3000, 500)],
        [(0, 200), (5, 0), (4000, 1), (128, 111), (16, 1), (0, 1)],
        [],
    ]
    probe = [_step(g, seqs, heads, kv_heads, dim, page, dtype, pad_rows=bucket - sum(n for _, n in seqs),
                   pad_seqs=max_seqs - len(seqs), spare=width) for seqs in steps]
    blocks = max(p.paged.k.shape[1] for p in probe)
    k_cache = torch.zeros(kv_heads, blocks, page, dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros(bucket, heads, dim, dtype=dtype, device="cuda")
    seq_rows = torch.zeros(max_seqs, dtype=torch.int64, device="cuda")
    cu_q = torch.zeros(max_seqs + 1, dtype=torch.int64, device="cuda")
    ctx = torch.zeros(max_seqs, dtype=torch.int64, device="cuda")
    table = torch.zeros(max(p.block_table.shape[0] for p in probe), width, dtype=torch.int64, device="cuda")
    opts = options(dim, 0, 0.0)

    def call() -> torch.Tensor:
        return ta.unified_attention(q, k_cache, v_cache, table, seq_rows, cu_q, ctx, opts.scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for trial, step in enumerate(probe):
        step.to("cuda")
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        k_cache[:, : step.paged.k.shape[1]].copy_(step.paged.k)
        v_cache[:, : step.paged.v.shape[1]].copy_(step.paged.v)
        table.zero_()
        table[: step.block_table.shape[0]].copy_(step.block_table[:, :width])
        for buf, new in ((q, step.q), (seq_rows, step.seq_rows), (cu_q, step.cu_q), (ctx, step.ctx)):
            buf.copy_(new)
        graph.replay()
        fresh = _check(step, opts, dtype)
        assert torch.equal(out, fresh), f"trial {trial}: the replay differs from a fresh call"
