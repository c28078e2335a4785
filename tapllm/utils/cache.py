"""tapllm's on-disk cache: where it lives, and keys for entries derived from other files."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def cache_root() -> Path:
    """Where tapllm caches what it derives (converted checkpoints, kernels, snapshots):
    ``$TAPLLM_CACHE``, else ``tapllm`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    env = os.environ.get("TAPLLM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tapllm"


def files_key(files: Iterable[Path], *extra: str) -> str:
    """A short key that changes when any of ``files`` is edited, replaced, added or removed
    (their resolved paths, sizes and modification times), or when an ``extra`` string changes."""
    h = hashlib.sha256()
    for f in sorted(files):
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    for e in extra:
        h.update(f"{e}\n".encode())
    return h.hexdigest()[:20]
