"""tapllm's Triton attention kernels (decode, prefill, KV write) against the plain-PyTorch attention they replace.

The interpreter's set-up, the tolerances and the NaN-poisoned paged cache are in
``triton_paged`` (shared with the other Triton test modules).
"""

from __future__ import annotations

import pytest
import torch
from triton_paged import (  # first: it decides Triton's mode before triton is imported
    CUDA,
    CUDA_CASES,
    INTERPRETED,
    TOL,
    Paged,
    cuda,
    interpret,  # noqa: F401 - a fixture
    options,
)

from tapllm.kernels import triton_attention as ta
from tapllm.layers.attention import (
    AttentionMetadata,
    AttentionOptions,
    PrefillBatch,
    PrefillChunk,
    _attend,
    _decode_attention,
    _finite,
    gather_keys,
    paged_attention,
)


def _decode_reference(q: torch.Tensor, paged: Paged, tables: torch.Tensor, lens: torch.Tensor,
                      opts: AttentionOptions) -> torch.Tensor:
    """The eager decode path (``paged_attention``'s, no kernels) in float32."""
    keys = torch.arange(tables.shape[1] * paged.page, device=q.device)
    lens = lens.long()
    meta = AttentionMetadata(slot_mapping=lens.new_zeros(0), num_decodes=q.shape[0], decode_block_tables=tables.long(),
                             decode_mask=(keys[None, :] >= lens[:, None])[:, None, :], prefills=[], decode_lens=lens)
    return _decode_attention(q.float(), paged.k32, paged.v32, meta, opts)


def _check_decode(q: torch.Tensor, paged: Paged, lens: torch.Tensor, opts: AttentionOptions, dtype: torch.dtype,
                  tables: torch.Tensor | None = None) -> torch.Tensor:
    tables = paged.tables if tables is None else tables
    got = ta.decode_attention(q, paged.k, paged.v, tables, lens, opts.scale, opts.window or 0, opts.softcap or 0.0)
    assert got.dtype == q.dtype and got.shape == q.shape
    live = lens > 0
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))  # length-0 rows: zeros, no key read
    if live.any():
        want = _decode_reference(q[live], paged, tables[live], lens[live], opts)
        torch.testing.assert_close(got[live].float(), want, rtol=TOL[dtype], atol=TOL[dtype])
    return got


# (heads, kv_heads, head_dim, block_size, dtype, lens): every GQA ratio, head size, dtype and block
# size appears; lens straddle block edges (1, 15, 16, 17) and long ones span many blocks.
DECODE_CASES = [
    (4, 4, 64, 16, torch.float32, [1, 15, 16, 17]),
    (6, 2, 80, 16, torch.float32, [17, 33, 5]),
    (8, 2, 96, 8, torch.float32, [16, 1, 40]),
    (4, 1, 128, 32, torch.float32, [64, 65, 3]),
    (6, 2, 256, 16, torch.float32, [15, 31]),
    (6, 2, 128, 16, torch.bfloat16, [1, 17, 50]),
    (8, 2, 80, 64, torch.float16, [70, 9]),
    (4, 4, 96, 16, torch.bfloat16, [16, 2]),
]


@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype,lens", DECODE_CASES)
def test_decode_matches_the_eager_path(interpret, heads, kv_heads, dim, page, dtype, lens):
    g = torch.Generator().manual_seed(heads * dim + page)
    paged = Paged(g, lens, kv_heads, dim, page, dtype, scale=2.0)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    for window, softcap in ((0, 0.0), (7, 0.0), (0, 3.0), (16, 5.0)):
        _check_decode(q, paged, torch.tensor(lens), options(dim, window, softcap), dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_decode_long_contexts_split_over_programs_with_padding_rows(interpret, index_dtype):
    """Long contexts (many blocks, several splits, some splits past a row's end) next to rows of
    length 0 whose tables point anywhere; int32 or int64 tables and lengths; q a strided view."""
    g = torch.Generator().manual_seed(7)
    lens = [300, 0, 129, 1, 0]
    paged = Paged(g, lens, 2, 64, 16, torch.float32, spare=5, index_dtype=index_dtype)
    tables = paged.tables.clone()
    tables[1] = torch.randint(0, paged.k.shape[1], (paged.width,), generator=g)
    assert ta.decode_splits(len(lens), 2, paged.width * paged.page) > 1
    qkv = torch.randn(len(lens), 4 * 64 + 32, generator=g)
    q = qkv[:, : 4 * 64].view(len(lens), 4, 64)  # rows strided as the fused projection's
    for window, softcap in ((0, 0.0), (100, 0.0), (1, 0.0), (0, 10.0)):
        _check_decode(q, paged, torch.tensor(lens, dtype=index_dtype), options(64, window, softcap), torch.float32,
                      tables)


def test_decode_all_rows_empty_give_zeros(interpret):
    g = torch.Generator().manual_seed(3)
    paged = Paged(g, [0, 0, 0], 1, 64, 16, torch.bfloat16)
    q = torch.randn(3, 3, 64, generator=g).bfloat16()
    got = ta.decode_attention(q, paged.k, paged.v, paged.tables, torch.zeros(3, dtype=torch.int32), 0.125, 0, 0.0)
    assert torch.equal(got, torch.zeros_like(q))


def _prefill_case(g: torch.Generator, chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, page: int,
                  dtype: torch.dtype, lead: int = 0, index_dtype: torch.dtype = torch.int64):
    """Chunks given as (context, length), at rows after ``lead`` rows that belong to none (decodes)."""
    paged = Paged(g, [c + n for c, n in chunks], kv_heads, dim, page, dtype, index_dtype=index_dtype, scale=2.0)
    starts, row = [], lead
    for _, n in chunks:
        starts.append(row)
        row += n
    q = torch.randn(row, heads, dim, generator=g).to(dtype)
    as_index = lambda xs: torch.tensor(xs, dtype=index_dtype)  # noqa: E731
    return paged, q, as_index(starts), as_index([n for _, n in chunks]), as_index([c for c, _ in chunks])


def _prefill_reference(q: torch.Tensor, paged: Paged, chunks: list[tuple[int, int]], starts: list[int],
                       opts: AttentionOptions) -> torch.Tensor:
    """Each chunk through the eager path's ``_attend``, over its keys gathered from the cache, in float32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for (ctx, n), s, table in zip(chunks, starts, paged.tables_list):
        kc = gather_keys(paged.k32, table, ctx + n)[None]
        vc = gather_keys(paged.v32, table, ctx + n)[None]
        qc = q[s : s + n].float().transpose(0, 1)[None]
        out[s : s + n] = _attend(qc, kc, vc, ctx, opts)[0].transpose(0, 1)
    return out


def _check_prefill(q, paged, starts, lens, contexts, chunks, opts, dtype, max_len=None):
    got = ta.prefill_attention(q, paged.k, paged.v, starts, lens, contexts, paged.tables, opts.scale,
                               opts.window or 0, opts.softcap or 0.0,
                               max(n for _, n in chunks) if max_len is None else max_len)
    assert got.dtype == q.dtype and got.shape == q.shape
    want = _prefill_reference(q, paged, chunks, starts.tolist(), opts)
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


# (heads, kv_heads, head_dim, block_size, dtype, chunks as (context, length)): fresh prompts, chunks
# that continue a cached context, lengths around block and tile edges, in one launch.
PREFILL_CASES = [
    (4, 4, 64, 16, torch.float32, [(0, 17), (0, 1), (16, 16), (5, 30)]),
    (6, 2, 80, 8, torch.float32, [(0, 23), (40, 3)]),
    (8, 2, 96, 16, torch.float32, [(15, 1), (0, 33), (3, 12)]),
    (3, 1, 128, 32, torch.float32, [(0, 70), (33, 9)]),
    (4, 2, 256, 16, torch.float32, [(0, 20), (17, 5)]),
    (6, 2, 128, 16, torch.bfloat16, [(0, 25), (20, 8)]),
    (8, 2, 80, 64, torch.float16, [(70, 6), (0, 19)]),
]


@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype,chunks", PREFILL_CASES)
def test_prefill_matches_the_eager_path(interpret, heads, kv_heads, dim, page, dtype, chunks):
    g = torch.Generator().manual_seed(heads * dim + page + 1)
    paged, q, starts, lens, contexts = _prefill_case(g, chunks, heads, kv_heads, dim, page, dtype)
    for window, softcap in ((0, 0.0), (5, 0.0), (0, 3.0), (20, 5.0)):
        _check_prefill(q, paged, starts, lens, contexts, chunks, options(dim, window, softcap), dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_prefill_rows_outside_chunks_are_zero_and_window_of_one(interpret, index_dtype):
    """Leading rows (the step's decodes) stay zero; a window of 1 leaves each query its own key;
    a grid sized by a larger max_len than needed changes nothing."""
    g = torch.Generator().manual_seed(11)
    chunks = [(0, 9), (20, 4), (0, 1)]
    paged, q, starts, lens, contexts = _prefill_case(g, chunks, 4, 2, 64, 16, torch.float32, lead=3,
                                                     index_dtype=index_dtype)
    for window, max_len in ((0, 9), (1, 9), (3, 64)):
        _check_prefill(q, paged, starts, lens, contexts, chunks, options(64, window, 0.0), torch.float32, max_len)
    got = ta.prefill_attention(q, paged.k, paged.v, starts, lens, contexts, paged.tables, 0.125)  # max_len read
    assert torch.equal(got[:3], torch.zeros_like(got[:3]))


def _eager_write(k, v, k_cache, v_cache, slots):
    """The eager path's cache write (``paged_attention`` without kernels), for the slots kept."""
    keep = slots >= 0
    kv = k_cache.shape[0]
    k_cache.view(kv, -1, k.shape[2]).index_copy_(1, slots[keep].long(), k[keep].transpose(0, 1))
    v_cache.view(kv, -1, k.shape[2]).index_copy_(1, slots[keep].long(), _finite(v[keep]).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kv_write_zeroes_non_finite_values_and_skips_negative_slots(interpret, dtype, index_dtype):
    g = torch.Generator().manual_seed(5)
    kv_heads, dim, page, t = 3, 80, 16, 9
    k_cache = torch.randn(kv_heads, 6, page, dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, 6, page, dim, generator=g).to(dtype)
    qkv = torch.randn(t, (4 + 2 * kv_heads) * dim, generator=g).to(dtype)  # k, v: strided views as the model's
    k = qkv[:, 4 * dim : (4 + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (4 + kv_heads) * dim :].view(t, kv_heads, dim)
    v[0, 0, 0], v[2, 1, 5], v[4, 2, 79], k[3, 0, 0] = float("nan"), float("inf"), float("-inf"), float("inf")
    slots = torch.tensor([0, 17, -1, 95, 40, -1, 5, 63, 80], dtype=index_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    _eager_write(k, v, want_k, want_v, slots)
    ta.kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k)  # keys as given (inf included), skipped slots untouched
    assert torch.equal(v_cache, want_v)


def test_ops_swap_into_paged_attention(interpret):
    """The Triton ops as the CUDA backend hands them to a step (``meta.attn``) in a mixed step
    (decodes, a fresh prompt, a chunk continuing its cache) give what the eager path gives."""
    g = torch.Generator().manual_seed(13)
    heads, kv_heads, dim, page = 6, 2, 64, 16
    opts = AttentionOptions(scale=dim**-0.5, window=12)
    dec_ctx = [20, 33]  # decode rows: cached tokens before the new one
    chunks = [(0, 18), (17, 6)]  # (context, length)
    totals = [n + 1 for n in dec_ctx] + [c + n for c, n in chunks]
    paged = Paged(g, totals, kv_heads, dim, page, torch.float32)
    k_cache, v_cache = paged.k32.clone(), paged.v32.clone()
    slots, rows = [], []
    for table, total, new in zip(paged.tables_list, totals, [1, 1, 18, 6]):
        slots += [table[p // page] * page + p % page for p in range(total - new, total)]
    t = len(slots)
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    slot_mapping = torch.tensor(slots)
    lens = torch.tensor([n + 1 for n in dec_ctx])
    keys = torch.arange(paged.width * page)
    tables = [paged.tables_list[i] for i in (2, 3)]
    prefills = [PrefillChunk(2, 18, 0, None), PrefillChunk(20, 6, 17, torch.tensor(tables[1]))]

    def meta(kernels):
        m = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=2, decode_block_tables=paged.tables[:2],
                              decode_mask=(keys[None, :] >= lens[:, None])[:, None, :], prefills=prefills,
                              decode_lens=lens, attn=kernels)
        if kernels is not None:
            m.prefill_batch = PrefillBatch.build(prefills, tables, torch.device("cpu"))
        return m

    from tapllm.backends.cuda import TritonAttention

    ops = TritonAttention()  # what the CUDA backend hands the model
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = paged_attention(q, k, v, want_k, want_v, meta(None), opts)
    got = paged_attention(q, k, v, k_cache, v_cache, meta(ops), opts)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got, want, rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_available_and_bad_input():
    assert ta.available("cpu") == INTERPRETED and ta.available(torch.zeros(1)) == INTERPRETED
    assert not ta.available(torch.device("meta"))
    assert ta.available("cuda") == CUDA
    q, cache = torch.zeros(1, 4, 64), torch.zeros(2, 3, 16, 64)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            ta.decode_attention(q, cache, cache, tables, lens, 0.1)
    bad = [
        ((torch.zeros(1, 3, 64), cache, cache, tables, lens), "multiple of the cache's KV heads"),
        ((torch.zeros(1, 4, 320), torch.zeros(2, 3, 16, 320), torch.zeros(2, 3, 16, 320), tables, lens),
         "over the limit of 256"),
        ((q, cache, cache, tables.float(), lens), "block_tables must be a 2-D int32 or int64"),
        ((q, cache, cache, tables, torch.ones(2, dtype=torch.int32)), "same number of rows"),
        ((q.bfloat16(), cache, cache, tables, lens), "share one dtype"),
        ((q, cache, torch.zeros(2, 3, 8, 64), tables, lens), "k_cache and v_cache must both be"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            ta.decode_attention(*args, 0.1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        ta.decode_attention(q, cache, cache, tables, lens, 0.1, -1)
    with pytest.raises(ValueError, match="one entry per chunk"):
        ta.prefill_attention(q, cache, cache, lens, lens, lens, torch.zeros(2, 2, dtype=torch.int32), 0.1, 0, 0.0, 1)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 1 tokens"):
        ta.kv_write(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), cache, cache, torch.zeros(2, dtype=torch.int64))


# ---- on the GPU, compiled, at real sizes ----------------------------------------------------------


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype", CUDA_CASES)
def test_cuda_decode(heads, kv_heads, dim, page, dtype):
    g = torch.Generator().manual_seed(heads + dim)
    for lens in ([8192], [1, 15, 16, 17, 0, 1000] + [700] * 26):  # batch 1 long (many splits); a batch of 32
        paged = Paged(g, lens, kv_heads, dim, page, dtype, scale=2.0).to("cuda")
        q = torch.randn(len(lens), heads, dim, generator=g).to(dtype).cuda()
        for window, softcap in ((0, 0.0), (4096 if len(lens) == 1 else 300, 0.0), (0, 30.0)):
            _check_decode(q, paged, torch.tensor(lens, dtype=torch.int32).cuda(), options(dim, window, softcap), dtype)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,dim,page,dtype", CUDA_CASES)
def test_cuda_prefill(heads, kv_heads, dim, page, dtype):
    g = torch.Generator().manual_seed(heads + dim + 1)
    chunks = [(0, 1024), (2048, 512), (0, 3), (100, 257), (4000, 1)]
    paged, q, starts, lens, contexts = _prefill_case(g, chunks, heads, kv_heads, dim, page, dtype, lead=5)
    paged.to("cuda")
    q, starts, lens, contexts = q.cuda(), starts.cuda(), lens.cuda(), contexts.cuda()
    for window, softcap in ((0, 0.0), (600, 0.0), (0, 50.0)):
        _check_prefill(q, paged, starts, lens, contexts, chunks, options(dim, window, softcap), dtype)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kv_write(dtype):
    g = torch.Generator().manual_seed(2)
    kv_heads, dim, page, t = 8, 128, 16, 4096
    k_cache = torch.randn(kv_heads, 512, page, dim, generator=g).to(dtype).cuda()
    v_cache = torch.randn(kv_heads, 512, page, dim, generator=g).to(dtype).cuda()
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype).cuda()
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype).cuda()
    v[::97, 3, 7] = float("nan")
    v[::89, 0, 0] = float("-inf")
    slots = torch.randperm(512 * page, generator=g)[:t].cuda()
    slots[::5] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    _eager_write(k, v, want_k, want_v, slots)
    ta.kv_write(k, v, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@cuda
@pytest.mark.cuda
def test_cuda_graph_replays_decode_with_new_lengths_and_tables():
    """One capture (split over programs, then merged) replayed with other lengths, tables and
    queries in the same buffers, rows of length 0 included, gives what a fresh call gives."""
    g = torch.Generator().manual_seed(17)
    heads, kv_heads, dim, page, batch, width = 32, 8, 128, 16, 4, 256
    dtype = torch.bfloat16
    assert ta.decode_splits(batch, kv_heads, width * page) > 1
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    q = torch.zeros(batch, heads, dim, dtype=dtype, device="cuda")
    k_cache = torch.zeros(kv_heads, 4 * width + 3, page, dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    opts = options(dim, 0, 0.0)

    def step():
        return ta.decode_attention(q, k_cache, v_cache, tables, lens, opts.scale, 0, 0.0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial, new_lens in enumerate(([4000, 1, 0, 17], [0, 0, 0, 0], [16, 2500, 4096, 0], [1, 1, 1, 1])):
        paged = Paged(g, new_lens, kv_heads, dim, page, dtype, spare=width).to("cuda")
        k_cache[:, : paged.k.shape[1]].copy_(paged.k)
        v_cache[:, : paged.v.shape[1]].copy_(paged.v)
        tables.copy_(paged.tables[:, :width])
        lens.copy_(torch.tensor(new_lens))
        q.copy_(torch.randn(batch, heads, dim, generator=g).to(dtype))
        graph.replay()
        fresh = _check_decode(q, paged, lens, opts, dtype, tables)  # a fresh call, against the reference
        assert torch.equal(out, fresh), f"trial {trial}: the replay differs from a fresh call"
