"""Handing memory back once an engine is idle: the KV cache's free blocks, and the heap.

On CPU the cache is an anonymous private mapping whose pages become resident as blocks are
first written (``kv_alloc.cache_zeros``), so after a burst of requests it holds the pages of
every block the burst touched, long after the requests are gone. :func:`release_free_blocks`
drops the pages of blocks no request holds (``madvise(MADV_DONTNEED)``): they read as zeros, as
a fresh cache does, and become resident again only when a request writes them.
:class:`IdleRelease` decides when (a server's loop asks it while idle) and trims the heap too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tapllm.utils.platform import release_free_memory, release_pages

if TYPE_CHECKING:
    from tapllm.config import EngineConfig
    from tapllm.engine.block_manager import BlockManager
    from tapllm.engine.model_runner import ModelRunner

logger = logging.getLogger("tapllm")


def _runs(blocks: list[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs ``[start, stop)`` of consecutive ids in ascending ``blocks``."""
    start = prev = None
    for b in blocks:
        if prev is not None and b == prev + 1:
            prev = b
            continue
        if start is not None:
            yield start, prev + 1
        start = prev = b
    if start is not None:
        yield start, prev + 1


def release_free_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int]) -> int:
    """Drop the pages that only ``blocks`` (ascending ids of blocks nobody uses) occupy in every
    layer's K and V cache (``[kv_heads, blocks, block_size, head_dim]``, contiguous, on CPU);
    the bytes handed back."""
    released = 0
    runs = list(_runs(blocks))
    for cache in (c for pair in kv_caches for c in pair):
        if cache.device.type != "cpu" or not cache.is_contiguous():
            continue
        heads, num_blocks = cache.shape[0], cache.shape[1]
        block_bytes = cache[0, 0].numel() * cache.element_size()
        base = cache.data_ptr()
        for h in range(heads):
            head = base + h * num_blocks * block_bytes
            for start, stop in runs:
                released += release_pages(head + start * block_bytes, (stop - start) * block_bytes)
    return released


class IdleRelease:
    """What an engine hands back once idle, and when.

    :meth:`release`: on CPU the pages of every free KV cache block (the prefix cache forgets them:
    a prompt seen before is computed again; skipped with ``kv_cache_precommit``, which keeps the
    cache resident by choice) and the heap's free memory (a full garbage collection, then
    ``malloc_trim``: the batch temporaries, capture buffers and request state of a burst).
    :meth:`release_if_idle`: the same, once per idle spell, ``release_memory_after_idle_s``
    seconds after the latest step.
    """

    def __init__(self, runner: ModelRunner, blocks: BlockManager, config: EngineConfig) -> None:
        self.runner = runner
        self.blocks = blocks
        self.config = config
        self.last_active = time.monotonic()  # the end of the latest step
        self.released = True  # nothing to hand back until a step has run

    def busy(self) -> None:
        """A step begins: there will be something to hand back."""
        self.released = False

    def stepped(self) -> None:
        """A step ended."""
        self.last_active = time.monotonic()

    def release(self) -> int:
        """Hand the memory back now (the caller checked that no request is in flight); the KV cache
        bytes released."""
        released = 0
        if self.runner.device.type == "cpu" and not self.config.kv_cache_precommit:
            released = release_free_blocks(self.runner.kv_caches, self.blocks.forget_free_blocks())
        release_free_memory(collect=True)
        return released

    def release_if_idle(self) -> bool:
        """:meth:`release` once per idle spell, when the latest step ended long enough ago; whether it did."""
        after = self.config.release_memory_after_idle_s
        if after is None or self.released or time.monotonic() - self.last_active < after:
            return False
        self.released = True
        released = self.release()
        logger.info("idle for %.0f s: handed back %.0f MB of free KV cache blocks (their cached prefixes "
                    "forgotten) and the heap's free memory", after, released / 1e6)
        return True
