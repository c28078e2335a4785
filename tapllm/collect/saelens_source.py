"""A collected dataset as SAELens' activation source.

SAELens' trainer takes any iterator of activation batches: ``SAETrainer(cfg, sae,
data_provider)``, where ``data_provider`` yields ``[train_batch_size_samples, d_in]`` tensors
without end (its ``ActivationsStore`` is one, starting a new epoch when the data runs out).
:class:`SAELensSource` is such an iterator over one point at one layer of a tapllm dataset:

>>> source = SAELensSource("acts/", point="resid_post", layer=15, batch_size=4096, unit="context")
>>> trainer = SAETrainer(cfg, sae, data_provider=source)   # sae_lens.training.sae_trainer
>>> trainer.fit()

It needs no SAELens import: batches come from :class:`~tapllm.collect.readers.ShuffledBatches`
(context-level shuffle by default, SAELens' own granularity), full batches only, each epoch in
a new order, in ``dtype`` on ``device``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tapllm.collect.readers import ShuffledBatches


class SAELensSource(Iterator[torch.Tensor]):
    """Endless ``[batch_size, hidden]`` batches of ``point`` at block ``layer`` (see the module docstring).

    ``dataset``: a folder written by ``tapllm collect`` or an opened
    :class:`tapllm.datasets.ActivationDataset`. ``point`` / ``layer``: default the dataset's
    only point / layer (``ValueError`` when it holds several). ``unit``, ``block_rows``,
    ``shuffle_buffer``, ``seed``: as :class:`~tapllm.collect.readers.ShuffledBatches`.
    ``epochs``: stop after this many passes (``None``: never, as SAELens' store).
    ``epoch`` counts the passes started.
    """

    def __init__(self, dataset: Any, point: str | None = None, layer: int | None = None, batch_size: int = 4096,
                 unit: str = "context", *, block_rows: int = 1024, shuffle_buffer: int = 0, seed: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 epochs: int | None = None) -> None:
        if isinstance(dataset, str | Path):
            from tapllm.collect import dataset as activation_dataset

            dataset = activation_dataset.open(dataset)
        point = _one_of("point", point, dataset.points, "points")
        layer = _one_of("layer", layer, dataset.layers, "blocks")
        if len(dataset) < batch_size:
            raise ValueError(f"batch_size {batch_size} is more than the dataset's {len(dataset)} rows")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.point, self.layer = point, layer
        self.d_in = int(dataset.metadata["hidden_size"]) if "hidden_size" in dataset.metadata else None
        self.reader = ShuffledBatches(dataset, batch_size, unit, block_rows=block_rows, shuffle_buffer=shuffle_buffer,
                                      columns=[point], layers=[layer], seed=seed, drop_last=True)
        self.device, self.dtype = torch.device(device), dtype
        self.epochs = epochs
        self.epoch = 0
        self._it: Iterator[dict[str, torch.Tensor]] | None = None

    def __iter__(self) -> SAELensSource:
        return self

    def __next__(self) -> torch.Tensor:
        while True:
            if self._it is None:
                if self.epochs is not None and self.epoch >= self.epochs:
                    raise StopIteration
                self.reader.set_epoch(self.epoch)
                self._it = iter(self.reader)
                self.epoch += 1
            batch = next(self._it, None)
            if batch is not None:
                return batch[self.point][:, 0].to(device=self.device, dtype=self.dtype)
            self._it = None


def _one_of(name: str, value: Any, held: list, what: str) -> Any:
    """``value`` if the dataset holds it, the dataset's only one when ``value`` is None; else ``ValueError``."""
    if value is None:
        if len(held) != 1:
            raise ValueError(f"{name}: the dataset holds {what} {held}; name one")
        return held[0]
    if value not in held:
        raise ValueError(f"{name} must be one of the dataset's {what} {held}, got {value!r}")
    return value
