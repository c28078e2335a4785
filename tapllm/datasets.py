"""Read a dataset written by ``tapllm collect``: ``tapllm.datasets.open(DIR)``.

>>> ds = tapllm.datasets.open("acts/")
>>> len(ds), ds.points, ds.layers
>>> for batch in ds.iter_batches(4096):      # dicts of tensors, rows in input order
...     x = batch["resid_post"]               # [rows, layers, hidden]
>>> row = ds[0]                               # one token's row
"""

from __future__ import annotations

import builtins
import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tapllm.collect.shards import read_shard, sha256_file


class ActivationDataset:
    """Shards of a finished collection, read lazily one shard at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        meta_file = path / "metadata.json"
        if not meta_file.exists():
            hint = " (the run is incomplete: rerun the same command)" if (path / "run.json").exists() else ""
            raise FileNotFoundError(f"{path} has no metadata.json: not a finished tapllm dataset{hint}")
        with builtins.open(meta_file) as f:
            self.metadata: dict[str, Any] = json.load(f)
        self.shards = self.metadata["shards"]
        self._starts = []
        total = 0
        for s in self.shards:
            self._starts.append(total)
            total += s["rows"]
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def points(self) -> list[str]:
        """The captured points."""
        return list(self.metadata["points"])

    @property
    def layers(self) -> list[int]:
        """The captured block indices."""
        return list(self.metadata["layers"])

    def __len__(self) -> int:
        return int(self.metadata["num_rows"])

    def shard(self, i: int) -> dict[str, torch.Tensor]:
        """All columns of shard ``i``."""
        if self._cache is None or self._cache[0] != i:
            self._cache = (i, read_shard(self.path / self.shards[i]["file"], self.metadata["storage"]))
        return self._cache[1]

    def iter_batches(self, batch_size: int = 4096) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of up to ``batch_size`` rows, in input order (a batch never spans two shards)."""
        for i in range(len(self.shards)):
            cols = self.shard(i)
            n = cols["position"].shape[0]
            for a in range(0, n, batch_size):
                yield {k: v[a : a + batch_size] for k, v in cols.items()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.iter_batches():
            for r in range(batch["position"].shape[0]):
                yield {k: v[r] for k, v in batch.items()}

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} rows")
        row %= len(self)
        i = bisect.bisect_right(self._starts, row) - 1
        cols = self.shard(i)
        return {k: v[row - self._starts[i]] for k, v in cols.items()}

    def verify(self) -> None:
        """Check every shard's sha256 against the metadata; ``ValueError`` names a bad shard."""
        for s in self.shards:
            if sha256_file(self.path / s["file"]) != s["sha256"]:
                raise ValueError(f"shard {s['file']} does not match its checksum")


def open(path: str | Path) -> ActivationDataset:  # noqa: A001 - the reader's natural name
    """Open a folder written by ``tapllm collect``."""
    return ActivationDataset(Path(path))
