"""Memory handed back after a burst: free KV cache blocks' pages and the heap's free memory."""

from __future__ import annotations

import gc
import mmap
import os
import platform
import random
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from tapllm import LLM
from tapllm.config import EngineConfig
from tapllm.engine.kv_memory import _runs, release_free_blocks
from tapllm.utils.platform import release_free_memory, release_pages
from tests.conftest import random_prompts
from tests.helpers import greedy


def _resident_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.mark.parametrize("seed", range(40))
def test_runs_cover_exactly_the_blocks(seed):
    rng = random.Random(seed)
    ordered = sorted(rng.sample(range(60), rng.randrange(0, 61)))
    runs = list(_runs(ordered))
    assert [b for start, stop in runs for b in range(start, stop)] == ordered
    assert all(a_stop < b_start for (_, a_stop), (b_start, _) in zip(runs, runs[1:]))


def test_release_pages_drops_resident_pages_and_reads_zeros():
    size = 64 << 20
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(7)
    before = _resident_kb()
    released = release_pages(t.data_ptr() + 100, size - 200)  # partial pages at the ends are kept
    after = _resident_kb()
    assert released == size - 2 * mmap.PAGESIZE
    assert before - after >= 0.9 * released / 1024
    assert t[:100].eq(7).all() and t[-100:].eq(7).all()
    assert t[mmap.PAGESIZE:-mmap.PAGESIZE].eq(0).all()
    assert release_pages(t.data_ptr(), 10) == 0  # less than a page
    del t
    buf.close()


def test_release_free_blocks_zeroes_only_free_blocks():
    heads, blocks, size, dim = 2, 12, 16, 64  # a block of one head: 4 KiB in fp32, one page
    bufs = [mmap.mmap(-1, heads * blocks * size * dim * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for _ in range(2)]
    k, v = (torch.frombuffer(b, dtype=torch.float32).view(heads, blocks, size, dim) for b in bufs)
    k.fill_(1.0)
    v.fill_(2.0)
    free = [1, 2, 3, 7, 11]
    released = release_free_blocks([(k, v)], free)
    assert released == 2 * heads * len(free) * size * dim * 4
    used = [b for b in range(blocks) if b not in free]
    assert k[:, free].eq(0).all() and v[:, free].eq(0).all()
    assert k[:, used].eq(1).all() and v[:, used].eq(2).all()
    del k, v


def _llm(tiny_models, **kw) -> LLM:
    return LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_blocks=256, block_size=16, **kw)


def test_after_release_the_engine_computes_the_same_and_forgets_free_prefixes(tiny_models):
    llm = _llm(tiny_models)
    engine = llm.engine
    prompts = random_prompts([40, 70, 33], seed=3, vocab=500)
    params = greedy(8)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine.blocks.cached, "the prompts' full blocks are cached after the burst"
    released = engine.release_memory()
    assert released > 0
    assert not engine.blocks.cached
    assert all(h is None for b, h in enumerate(engine.blocks.block_hash) if b in set(engine.blocks.free))
    # Whole pages only: the free blocks' rows read as zeros where their pages were handed back.
    free = sorted(engine.blocks.free)
    assert sum(int(k[:, free].eq(0).all(dim=(-1, -2)).sum()) for k, _ in engine.runner.kv_caches) > 0
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == first


def test_release_is_refused_while_requests_are_in_flight(tiny_models):
    llm = _llm(tiny_models)
    engine = llm.engine
    engine.add(engine.input_processor.prepare(random_prompts([20], seed=1, vocab=500)[0], greedy(4)))
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release_memory()
    assert engine.release_memory_if_idle() is False
    while engine.has_unfinished_requests():
        engine.step()


def test_release_when_idle_runs_once_per_idle_spell(tiny_models):
    llm = _llm(tiny_models, release_memory_after_idle_s=0.05)
    engine = llm.engine
    assert engine.release_memory_if_idle() is False  # nothing ran since start
    llm.generate(random_prompts([30], seed=2, vocab=500), greedy(4), use_tqdm=False)
    assert engine.release_memory_if_idle() is False  # not idle long enough yet
    time.sleep(0.06)
    assert engine.release_memory_if_idle() is True
    assert engine.release_memory_if_idle() is False  # already handed back
    never = _llm(tiny_models, release_memory_after_idle_s=None)
    never.generate(random_prompts([30], seed=2, vocab=500), greedy(4), use_tqdm=False)
    time.sleep(0.01)
    assert never.engine.release_memory_if_idle() is False


@pytest.mark.parametrize("bad", [-1.0, "10", True])
def test_release_after_idle_is_validated(bad):
    with pytest.raises(ValueError, match="release_memory_after_idle_s"):
        EngineConfig(release_memory_after_idle_s=bad).validate()


def test_onednn_caches_are_bounded_unless_the_environment_says_otherwise(monkeypatch):
    from tapllm.utils.platform import ONEDNN_CACHE_ENTRIES, bound_onednn_caches

    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "500")
    assert bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "500",
                                     "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_ENTRIES)}


def test_release_with_collect_frees_what_only_a_cycle_holds():
    class Holder:
        pass

    was_enabled = gc.isenabled()
    gc.disable()  # an idle process allocates nothing that would start a full collection
    try:
        h = Holder()
        h.buffer = bytearray(8 << 20)
        h.itself = h
        alive = weakref.ref(h)
        del h
        release_free_memory()
        assert alive() is not None, "a trim alone leaves the cycle and its buffer"
        release_free_memory(collect=True)
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()


_API_ALLOCATOR_SCRIPT = r"""
import ctypes, sys
from tapllm.utils.platform import tune_api_allocator

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

tuned = tune_api_allocator() if sys.argv[1] == "tuned" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(16 << 20)  # glibc's threshold then rises to its size, unless it is fixed
ctypes.memset(first, 1, 16 << 20)
libc.free(first)
base = rss_kb()
big, pins = [], []
for _ in range(8):  # 8 MiB buffers, each followed by a live block (too large for the heap's free lists)
    p = libc.malloc(8 << 20)
    ctypes.memset(p, 1, 8 << 20)
    big.append(p)
    pins.append(libc.malloc(1 << 20))
for p in big:
    libc.free(p)
print(tuned, (rss_kb() - base) // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize("mode", ["tuned", "default"])
def test_api_allocator_hands_large_buffers_back_when_freed(mode):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", _API_ALLOCATOR_SCRIPT, mode], capture_output=True, text=True,
                         check=True, timeout=300, env=env)
    tuned, kept_mib = out.stdout.split()
    if mode == "tuned":
        assert tuned == "True" and int(kept_mib) < 8, out.stdout
    else:  # glibc's dynamic threshold puts them on the heap, where the blocks after them pin them
        assert int(kept_mib) >= 48, out.stdout
