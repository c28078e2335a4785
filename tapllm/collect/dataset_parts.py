"""``--dataset`` across Ray workers: which records each part reads, computed by the worker alone.

Every worker opens the dataset itself (the driver reads no record and ships none) and keeps
its part, a deterministic function of the input and the number of parts:

- a memory-mapped ``Dataset`` (a ``save_to_disk`` folder, a Hub dataset in the local cache):
  contiguous blocks of rows, part 0 the first (``datasets.distributed.split_dataset_by_node``,
  i.e. ``Dataset.shard(contiguous=True)``: the first ``len % parts`` parts hold one row more).
  Parts in order are the input in order.
- a stream of data files: whole files per part (``IterableDataset.shard``, contiguous blocks
  of files) when the number of files is a multiple of ``parts`` and there is no
  ``--max-rows``; otherwise every part reads the stream and keeps the records ``i`` with
  ``i % parts == part``. (Not ``split_dataset_by_node`` here: datasets 5.2 applies a later
  ``skip`` before that split, which would resume a part at the wrong record.)

``--max-rows N`` keeps the first ``N`` records of the whole input before the split, so the
parts together read what a one-process run reads. Each part is then cut into contexts by
itself: without ``--packing`` a context holds one document (or a piece of one), exactly as in
one process; with ``--packing`` a part concatenates its own documents only, so no context
spans two parts.
"""

from __future__ import annotations

from typing import Any

from tapllm.collect.hf_input import DatasetSpec, fingerprint, open_dataset


def part_of(ds: Any, part: int, parts: int, max_rows: int | None = None) -> Any:
    """The records of ``ds`` that part ``part`` of ``parts`` collects (see the module docstring)."""
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}: need 0 <= part < parts")
    import datasets
    from datasets.distributed import split_dataset_by_node

    if isinstance(ds, datasets.Dataset):
        if max_rows is not None:
            ds = ds.select(range(min(max_rows, len(ds))))
        return ds if parts == 1 else split_dataset_by_node(ds, rank=part, world_size=parts)
    if max_rows is not None:
        ds = ds.take(max_rows)
    if parts == 1:
        return ds
    if max_rows is None and ds.num_shards % parts == 0:
        return ds.shard(num_shards=parts, index=part, contiguous=True)
    return ds.filter(lambda _, i: i % parts == part, with_indices=True)


def open_part(spec: DatasetSpec, part: int, parts: int, max_rows: int | None, expected_fingerprint: str) -> Any:
    """Open ``--dataset`` on this machine and keep part ``part``; ``RuntimeError`` when the data
    here is not what the driver described (another copy, or changed files)."""
    ds = open_dataset(spec)
    seen = fingerprint(ds, spec)
    if seen != expected_fingerprint:
        raise RuntimeError(f"--dataset {spec.name} on this worker has fingerprint {seen}, the driver saw "
                           f"{expected_fingerprint}: every node must read the same data (shared storage)")
    return part_of(ds, part, parts, max_rows)
