"""The KV cache's tensors: zero pages that become resident only as they are written."""

from __future__ import annotations

import math
import mmap

import torch


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, commit: bool = False) -> torch.Tensor:
    """A zero-filled cache tensor; on CPU its pages become resident only when first written,
    unless ``commit``: then they are written now (``kv_cache_precommit``).

    The cache must start as zeros (masked slots are multiplied by zero probabilities, and
    garbage could be NaN). An anonymous ``mmap`` gives untouched zero pages, so a large cache
    costs memory only as far as requests fill it (``torch.zeros`` would write, and so commit,
    the whole size up front). Transparent huge pages are refused for it: a cache is touched a
    4 KiB block here and there, and with 2 MiB pages (what numpy's ``zeros`` asks for) the
    first prefill of a batch of 16 committed 440 MB instead of 205 MB.
    """
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps ``buffer`` alive for as long as the tensor lives.
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    if commit:
        # Writing faults the pages in on every torch thread (MAP_POPULATE faults on one).
        flat.zero_()
    return flat.view(dtype).view(shape)
