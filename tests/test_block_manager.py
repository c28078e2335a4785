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
