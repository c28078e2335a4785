"""Handing the KV cache's memory of free blocks back to the kernel.

On CPU the cache is an anonymous private mapping whose pages become resident as blocks are
first written (``model_runner._zeros``), so after a burst of requests it holds the pages of
every block the burst touched, long after the requests are gone. :func:`release_free_blocks`
drops the pages of blocks no request holds (``madvise(MADV_DONTNEED)``): they read as zeros, as
a fresh cache does, and become resident again only when a request writes them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tapllm.utils.platform import release_pages


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
