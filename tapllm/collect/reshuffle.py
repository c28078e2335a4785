"""A copy of a collected dataset with its rows in shuffled order: the layout for reading a
dataset larger than memory at token-level randomness.

A token-level shuffle reads rows scattered over every shard: fast from the page cache, but
from disk every row is a small random read. Written once in shuffled order, the copy is read
with block units, large contiguous reads announced ahead (see
:mod:`tapllm.collect.readers`), while its batches still mix rows from the whole dataset; each
epoch can reorder the blocks and mix them through a buffer:

>>> write_shuffled("acts/", "acts-shuffled/", unit="token", seed=0)
>>> ShuffledBatches(tapllm.datasets.open("acts-shuffled/"), 4096, unit="block", shuffle_buffer=65536)

The copy is a tapllm dataset like its source (same columns, format and ``metadata.json``
fields, ``request_index`` and ``position`` still naming each row's origin) plus
``"shuffled": {"source", "unit", "seed"}``, in shards of ``shard_rows`` rows (their
``requests`` are empty: a shard holds rows of any request), each written atomically with its
checksum; ``metadata.json`` comes last, so a copy without it is unfinished.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tapllm.collect.readers import ShuffledBatches
from tapllm.collect.shards import SUFFIX, write_file, write_shard
from tapllm.collect.writer import ShardEntry


def write_shuffled(source: Any, out: str | Path, unit: str = "token", seed: int = 0, shard_rows: int | None = None,
                   block_rows: int = 1024) -> Path:
    """Write ``source`` (a folder or an opened ``ActivationDataset``) to the empty folder ``out`` in
    shuffled order (``unit``: ``"token"``, ``"block"`` or ``"context"``, as
    :class:`~tapllm.collect.readers.ShuffledBatches`); returns ``out``. ``shard_rows``: rows a
    shard (default: the source's ``shard_tokens``)."""
    from tapllm.collect import dataset as activation_dataset

    ds = activation_dataset.open(source) if isinstance(source, str | Path) else source
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out {out} is not an empty folder: choose a new one")
    meta = ds.metadata
    rows = shard_rows if shard_rows is not None else int(meta.get("shard_tokens", 65536))
    if rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {rows}")
    fmt = meta.get("storage", "safetensors")
    reader = ShuffledBatches(ds, rows, unit, block_rows=block_rows, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for seq, batch in enumerate(reader):
        name = f"part000-{seq:05d}{SUFFIX[fmt]}"
        size, digest = write_shard(out / name, batch, fmt)
        entries.append(ShardEntry(name, 0, seq, int(batch["position"].shape[0]), [], size, digest))
    if fmt == "arrow":  # state.json / dataset_info.json, as collect writes them
        from tapllm.collect.run import _write_datasets_files

        _write_datasets_files(out, entries)
    shuffled = {"source": str(Path(ds.path).resolve()), "unit": unit, "seed": seed}
    copy = {**meta, "num_shards": len(entries), "bytes": sum(e.bytes for e in entries),
            "shards": [asdict(e) for e in entries], "shard_tokens": rows, "shuffled": shuffled}
    write_file(out / "metadata.json", json.dumps(copy, indent=2))
    return out
