"""Process-level settings that make CPU inference fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger("tapllm")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1  # mallopt takes a C int
_tuned = False


def tune_cpu_allocator() -> bool:
    """Stop glibc from handing large buffers back to the kernel after every free.

    Each step allocates and frees multi-megabyte temporaries (gathered KV context, prefill
    activations). By default glibc serves those with fresh ``mmap`` pages and unmaps them on
    free, so every step pays a page fault per 4 KiB touched: decode attention over long
    contexts ran 2-4x slower from that alone. Keeping them on the heap (what vLLM gets by
    preloading tcmalloc) removes it. Set ``TAPLLM_MALLOC_TUNING=0`` to leave malloc alone.
    """
    global _tuned
    if _tuned or os.environ.get("TAPLLM_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return _tuned
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    _tuned = ok
    if ok:
        logger.debug("glibc malloc tuned: large buffers stay on the heap")
    return ok
