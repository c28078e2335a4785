"""Pausing Python's garbage collector while a model loads."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_collector() -> Iterator[None]:
    """Keep the cyclic garbage collector from running inside the block (restored after it).

    Loading imports hundreds of modules and builds a model: tens of thousands of long-lived
    objects, each batch of which sets off a full collection over everything torch created
    (tens to hundreds of milliseconds each on a small machine). None of it is garbage; the
    engine collects once at the end of its load and freezes what is left.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
