"""Shuffled read throughput of a tapllm dataset, for ``benchmarks/collect.py``: prints one JSON line.

Run with ``PYTHONPATH`` set to the tapllm checkout to measure (``collect.py --baseline-rev``
extracts an older revision's ``tapllm/`` and runs this against it, so a run compares the code
before and after side by side). Each mode is one shuffled pass over every row in batches of
``--batch`` rows, the best of ``--repeats`` passes (the files are in the page cache):

  dataloader     ``DataLoader(ds, batch_size=B, shuffle=True)``: rows read through
                 ``__getitems__`` and collated (token-level shuffle, the standard way)
  batchsampler   ``DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), B), batch_size=None)``
  iterable       ``ds.iterable(batch_size=B)``: blocks through a shuffle buffer
  token, block, context, context+buffer
                 ``tapllm.collect.readers.ShuffledBatches`` with that unit (every column; the
                 buffer holds 16 batches)
"""

from __future__ import annotations

import argparse
import json
import time


def loader(ds, mode: str, batch: int):
    """The iterable of batches for ``mode``."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    gen = torch.Generator().manual_seed(0)
    if mode == "dataloader":
        return DataLoader(ds, batch_size=batch, shuffle=True, generator=gen)
    if mode == "batchsampler":
        return DataLoader(ds, sampler=BatchSampler(RandomSampler(ds, generator=gen), batch, False), batch_size=None)
    if mode == "iterable":
        return DataLoader(ds.iterable(batch_size=batch), batch_size=None)
    from tapllm.collect.readers import ShuffledBatches

    unit, _, buffered = mode.partition("+")
    return DataLoader(ShuffledBatches(ds, batch, unit, shuffle_buffer=16 * batch if buffered else 0),
                      batch_size=None)


def main() -> None:
    """Measure the modes asked for."""
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="dataloader,batchsampler,iterable,token,block,context,context+buffer")
    args = p.parse_args()

    import tapllm.datasets

    ds = tapllm.datasets.open(args.folder)
    out = {}
    for mode in args.modes.split(","):
        best = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rows = sum(int(b["position"].shape[0]) for b in loader(ds, mode, args.batch))
            best = max(best, rows / (time.perf_counter() - t0))
            assert rows == len(ds), (mode, rows, len(ds))
        out[mode] = best
    print(json.dumps(out))


if __name__ == "__main__":
    main()
