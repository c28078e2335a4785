"""Read a dataset written by ``tapllm collect``: ``tapllm.datasets.open(DIR)`` (the public name of
this module's :func:`open`).

Rows are read through memory maps of the shard files, so a random row costs its own bytes,
never a whole shard's.

>>> ds = tapllm.datasets.open("acts/")           # a torch.utils.data.Dataset of token rows
>>> len(ds), ds.points, ds.layers
>>> row = ds[0]                                   # {"resid_post": [layers, hidden], "token_id": ..., ...}
>>> batch = ds[[5, 17, 3]]                        # the same columns, batched
>>> loader = DataLoader(ds, batch_size=4096, shuffle=True)            # standard: rows collated
>>> loader = DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), 4096, False), batch_size=None)  # faster
>>> stream = ds.iterable(batch_size=4096, shuffle_buffer=16384)      # IterableDataset, shuffle buffer
>>> for batch in ds.iter_batches(4096): ...       # input order
"""

from __future__ import annotations

import builtins
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tapllm.collect.mmap_shards import ShardView
from tapllm.collect.readers import ShuffledBatches, gather
from tapllm.collect.shards import sha256_file

Batch = dict[str, torch.Tensor]


class ActivationDataset(Dataset):
    """The token rows of a finished collection, read through memory maps of its shards.

    ``ds[i]`` is one row (a dict of tensors: each point ``[layers, hidden]``, ``token_id``,
    ``request_index``, ``position``); ``ds[list_or_tensor]`` and :meth:`get_batch` are
    batches; ``__getitems__`` serves a ``DataLoader``'s batched reads. At most
    ``max_open_shards`` shard files are mapped at once.
    """

    def __init__(self, path: Path, max_open_shards: int = 64) -> None:
        self.path = path
        meta_file = path / "metadata.json"
        if not meta_file.exists():
            hint = " (the run is incomplete: rerun the same command)" if (path / "run.json").exists() else ""
            raise FileNotFoundError(f"{path} has no metadata.json: not a finished tapllm dataset{hint}")
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        with builtins.open(meta_file) as f:
            self.metadata: dict[str, Any] = json.load(f)
        self.shards: list[dict[str, Any]] = self.metadata["shards"]
        self._starts = np.cumsum([0] + [s["rows"] for s in self.shards]).astype(np.int64)
        self.max_open_shards = max_open_shards
        self._views: OrderedDict[int, ShardView] = OrderedDict()

    @property
    def points(self) -> list[str]:
        """The captured points."""
        return list(self.metadata["points"])

    @property
    def layers(self) -> list[int]:
        """The captured block indices."""
        return list(self.metadata["layers"])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the files again
        state = self.__dict__.copy()
        state["_views"] = OrderedDict()
        return state

    def view(self, i: int) -> ShardView:
        """Shard ``i``, mapped (the least recently used map is closed beyond ``max_open_shards``)."""
        v = self._views.get(i)
        if v is None:
            v = ShardView(self.path / self.shards[i]["file"], self.metadata["storage"])
            self._views[i] = v
            if len(self._views) > self.max_open_shards:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(i)
        return v

    def shard(self, i: int) -> Batch:
        """All columns of shard ``i``."""
        v = self.view(i)
        return v.slice(0, v.rows)

    def get_batch(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows ``indices`` (any order, negative from the end) as one batch of tensors."""
        idx = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
            bad = int(idx.min()) if int(idx.min()) < -n else int(idx.max())
            raise IndexError(f"row {bad} out of range for {n} rows")
        idx = np.where(idx < 0, idx + n, idx)
        if not self.shards:
            raise IndexError("the dataset has no rows")
        return gather(self, idx)

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        if isinstance(key, slice):
            return self.get_batch(np.arange(len(self))[key])
        if isinstance(key, int | np.integer) or (isinstance(key, torch.Tensor) and key.ndim == 0):
            row = int(key)
            if not -len(self) <= row < len(self):
                raise IndexError(f"row {row} out of range for {len(self)} rows")
            return {k: v[0] for k, v in self.get_batch([row]).items()}
        return self.get_batch(key)

    def __getitems__(self, indices: list[int]) -> list[Batch]:
        """A ``DataLoader``'s batched read: the rows, read in one pass, one dict each."""
        batch = self.get_batch(indices)
        keys = list(batch)
        return [dict(zip(keys, row)) for row in zip(*(v.unbind(0) for v in batch.values()))]  # unbind: one call a column

    def iter_batches(self, batch_size: int = 4096) -> Iterator[Batch]:
        """Batches of up to ``batch_size`` rows, in input order (a batch never spans two shards)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for i in range(len(self.shards)):
            v = self.view(i)
            for a in range(0, v.rows, batch_size):
                yield v.slice(a, min(a + batch_size, v.rows))

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.iter_batches():
            for r in range(batch["position"].shape[0]):
                yield {k: v[r] for k, v in batch.items()}

    def iterable(self, batch_size: int | None = None, shuffle_buffer: int = 16384, block_rows: int = 1024,
                 seed: int = 0) -> ShuffledRows:
        """The rows as an ``IterableDataset`` in shuffled order (see :class:`ShuffledRows`)."""
        return ShuffledRows(self, batch_size, shuffle_buffer, block_rows, seed)

    def verify(self) -> None:
        """Check every shard's sha256 against the metadata; ``ValueError`` names a bad shard."""
        for s in self.shards:
            if sha256_file(self.path / s["file"]) != s["sha256"]:
                raise ValueError(f"shard {s['file']} does not match its checksum")


class ShuffledRows(ShuffledBatches):
    """The rows of an :class:`ActivationDataset`, shuffled across shards with a buffer: blocks of
    ``block_rows`` consecutive rows, in a random order over all shards, stream into a buffer of
    ``shuffle_buffer`` rows from which rows are drawn at random (see
    :class:`tapllm.collect.readers.ShuffledBatches`). Yields rows, or batches of ``batch_size``
    rows (use ``DataLoader(..., batch_size=None)`` then).
    """

    def __init__(self, ds: ActivationDataset, batch_size: int | None, shuffle_buffer: int, block_rows: int,
                 seed: int) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        super().__init__(ds, batch_size or 256, "block", block_rows=block_rows, shuffle_buffer=shuffle_buffer,
                         seed=seed)
        self.rows = batch_size is None

    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            if not self.rows:
                yield batch
                continue
            for r in range(batch["position"].shape[0]):
                yield {k: v[r] for k, v in batch.items()}


def open(path: str | Path, max_open_shards: int = 64) -> ActivationDataset:  # noqa: A001 - the reader's natural name
    """Open a folder written by ``tapllm collect``."""
    return ActivationDataset(Path(path), max_open_shards)
