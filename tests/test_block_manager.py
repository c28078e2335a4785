"""KV block bookkeeping: reference counts, hash-chained prefix sharing, LRU eviction."""

from __future__ import annotations

from tapllm.engine.block_manager import BlockManager
from tapllm.engine.request import Request
from tapllm.sampling_params import SamplingParams


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, 0, None, tokens, SamplingParams(), None)


def _run(bm: BlockManager, req: Request) -> None:
    cached = bm.find_cached_prefix(req)
    req.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(req, req.num_tokens - req.num_computed_tokens, cached)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_shared_prefix_is_reused_and_ref_counted():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(10)), "a")
    _run(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 7
    b = _req(list(range(8)) + [99, 98, 97], "b")
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    _run(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free_request(a)
    assert bm.ref_counts[b.block_table[0]] == 1


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    _run(bm, _req(list(range(8))))
    assert len(bm.find_cached_prefix(_req(list(range(8))))) == 1  # 8 tokens: block 2 holds the last
    assert len(bm.find_cached_prefix(_req(list(range(9))))) == 2


def test_hash_chain_depends_on_everything_before():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    _run(bm, _req([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.find_cached_prefix(_req([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    salted = _req([1, 2, 3, 4, 5, 6, 7, 8, 9])
    salted.cache_salt = b"other"
    assert bm.find_cached_prefix(salted) == []


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _req([1, 2, 3, 4, 5])
    _run(bm, a)
    bm.free_request(a)
    assert bm.num_free_blocks == 4
    assert len(bm.find_cached_prefix(_req([1, 2, 3, 4, 5]))) == 2  # still cached after free
    c = _req([7, 7, 8])  # needs 2 blocks: evicts the least recently freed ones first
    _run(bm, c)
    assert len(bm.find_cached_prefix(_req([1, 2, 3, 4, 5]))) == 2  # a's prefix blocks survive
    d = _req([9, 9, 9, 9, 9, 9, 9])
    assert bm.allocate(d, 7) is False  # 2 free blocks, 4 needed: nothing changes
    assert bm.num_free_blocks == 2 and d.block_table == []


def test_no_caching_when_disabled():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    _run(bm, _req([1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(_req([1, 2, 3, 4, 5])) == []


def test_blocks_holding_nothing_reusable_are_handed_out_again_first():
    """The cache's pages are committed on first write: recycling the same blocks keeps the
    resident set as small as the work, while cached prefixes still wait at the back."""
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    first = _req(list(range(10)), "a")
    _run(bm, first)
    used = set(first.block_table)
    bm.free_request(first)
    for round_ in range(5):
        r = _req([round_] * 9, f"r{round_}")
        _run(bm, r)
        assert set(r.block_table) <= used
        bm.free_request(r)
    cached = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    a = _req(list(range(10)), "a")  # 2 full blocks cached, the partial third holds nothing reusable
    _run(cached, a)
    full, partial = a.block_table[:2], a.block_table[2]
    cached.free_request(a)
    b = _req([7] * 3, "b")
    _run(cached, b)
    assert b.block_table == [partial]
    assert cached.find_cached_prefix(_req(list(range(10)), "c")) == full


def test_default_kv_cache_budget_is_a_share_of_available_memory():
    from tapllm.engine.model_runner import DEFAULT_KV_MAX_BYTES, default_kv_cache_bytes

    budget = default_kv_cache_bytes()
    assert 0 < budget <= DEFAULT_KV_MAX_BYTES


def test_kv_cache_pages_are_committed_a_small_page_at_a_time():
    """Scattered writes into a fresh cache commit 4 KiB pages, not 2 MiB huge pages (with numpy's
    zeros, THP made the first prefill of a batch of 16 commit 440 MB instead of 205 MB)."""
    import re
    import sys

    import pytest
    import torch

    from tapllm.engine.kv_alloc import cache_zeros as _zeros

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")

    def anon_kib() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1))

    cache = _zeros((256, 2048, 256), torch.float32, torch.device("cpu"))  # 512 MiB
    before = anon_kib()
    flat = cache.view(-1)
    for i in range(64):  # one element every 8 MiB
        flat[i * (2 << 20)] = 1.0
    grown = anon_kib() - before
    assert grown < 16 * 1024, f"64 scattered writes committed {grown} KiB"
    assert float(cache.sum()) == 64.0


def test_kv_cache_precommit_makes_the_cache_resident_at_start(tiny_models):
    """``kv_cache_precommit=True`` writes the whole cache at start-up (zeros, as before), so no
    step faults its pages in; without it the cache stays uncommitted until written."""
    import re
    import sys

    import pytest
    import torch

    from tapllm.engine.kv_alloc import cache_zeros as _zeros

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")

    def anon_kib() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1))

    before = anon_kib()
    lazy = _zeros((64, 1024, 256), torch.float32, torch.device("cpu"))  # 64 MiB
    assert anon_kib() - before < 8 * 1024
    before = anon_kib()
    eager = _zeros((64, 1024, 256), torch.float32, torch.device("cpu"), commit=True)
    assert anon_kib() - before > 60 * 1024
    assert float(eager.abs().sum()) == 0.0 and float(lazy.abs().sum()) == 0.0

    from tapllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    runs = [LLM(model=str(tiny_models["llama"]), dtype="float32", kv_cache_blocks=32,
                kv_cache_precommit=flag).generate(prompts, params, use_tqdm=False) for flag in (False, True)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
