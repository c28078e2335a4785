"""``--dataset NAME_OR_PATH``: any Hugging Face ``datasets`` dataset, read as a stream.

- a folder written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` and ``--split``):
  ``load_from_disk``, memory-mapped;
- a data file or a glob of them (``.parquet``, ``.jsonl``/``.json``, ``.csv``, ``.txt``,
  ``.arrow``), or a folder of data files: ``load_dataset(..., streaming=True)``, read a
  block at a time;
- anything else is a Hub dataset name, read from the local ``datasets`` cache (this is what
  ``load_dataset(NAME, split=...)`` prepared before); one that is not there is an error.

Records are read in order, ``--column`` of each: a string is tokenized (without special
tokens, in batches), a list of integers is taken as token ids already.
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text",
             ".arrow": "arrow"}
_BATCH = 512  # records tokenized at once


@dataclass(slots=True, frozen=True)
class DatasetSpec:
    """What ``--dataset``, ``--split`` and ``--column`` name."""

    name: str
    split: str = "train"
    column: str = "text"


def open_dataset(spec: DatasetSpec) -> Any:
    """The dataset (``datasets.Dataset`` or ``IterableDataset``), restricted to ``spec.column``.

    ``ValueError`` / ``FileNotFoundError`` name ``--dataset``, ``--split`` or ``--column``.
    """
    try:
        import datasets
    except ImportError:
        raise ImportError("--dataset needs the datasets package: pip install 'tapllm[data]'") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    path = Path(spec.name).expanduser()
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = _from_disk(datasets, path, spec)
    elif path.exists() or glob.has_magic(spec.name):
        ds = _from_files(datasets, path, spec)
    else:
        ds = _from_cache(datasets, spec)
    columns = ds.column_names
    if columns is not None and spec.column not in columns:
        raise ValueError(f"--column {spec.column!r} is not a column of --dataset {spec.name} (columns: {columns})")
    return ds.select_columns([spec.column])


def _from_disk(datasets: Any, path: Path, spec: DatasetSpec) -> Any:
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a damaged folder
        raise ValueError(f"--dataset {path}: not readable by datasets.load_from_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if spec.split not in ds:
            raise ValueError(f"--split {spec.split!r} is not a split of --dataset {path} (splits: {list(ds)})")
        ds = ds[spec.split]
    return ds


def _from_files(datasets: Any, path: Path, spec: DatasetSpec) -> Any:
    if path.is_dir():
        kwargs: dict[str, Any] = {"path": str(path), "split": spec.split}
    else:
        suffix = "".join(Path(spec.name).suffixes[-1:]).lower()
        builder = _BUILDERS.get(suffix)
        if builder is None:
            raise ValueError(f"--dataset {spec.name}: unknown file type {suffix!r} (known: {sorted(_BUILDERS)})")
        if spec.split != "train":
            raise ValueError(f"--split {spec.split!r}: data files given as --dataset form the one split 'train'")
        kwargs = {"path": builder, "data_files": spec.name, "split": "train"}
    try:
        return datasets.load_dataset(**kwargs, streaming=True)
    except Exception as exc:  # FileNotFoundError, DatasetGenerationError, ValueError for a bad split...
        raise ValueError(f"--dataset {spec.name}: cannot read it with datasets.load_dataset ({exc})") from None


def _from_cache(datasets: Any, spec: DatasetSpec) -> Any:
    try:
        return datasets.load_dataset(spec.name, split=spec.split)
    except Exception as exc:  # offline: ConnectionError, FileNotFoundError, DatasetNotFoundError...
        raise FileNotFoundError(
            f"--dataset {spec.name}: not a local file or folder, and not in the Hugging Face datasets cache "
            f"with split {spec.split!r} (nothing is downloaded here; save it with save_to_disk or give its "
            f"files): {type(exc).__name__}: {exc}"
        ) from None


def fingerprint(ds: Any, spec: DatasetSpec) -> str:
    """What identifies the data: the ``datasets`` fingerprint of a memory-mapped dataset, else
    a hash of the data files' names, sizes and modification times."""
    import datasets

    if isinstance(ds, datasets.Dataset):  # computed from the data files (or the transforms applied)
        return ds._fingerprint
    path = Path(spec.name).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else (
        sorted(Path(p) for p in glob.glob(spec.name)) if glob.has_magic(spec.name) else [path])
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "files-" + h.hexdigest()[:32]


def documents(ds: Any, column: str, skip: int, tokenize: Callable[[list[str]], list[list[int]]]
              ) -> Iterator[list[int]]:
    """The token ids of each record after the first ``skip``, in order; ``ValueError`` names a
    record whose ``column`` is neither a string nor a list of token ids."""
    stream = ds.skip(skip) if skip else ds
    index = skip
    for batch in stream.iter(batch_size=_BATCH):
        values = batch[column]
        texts = [v for v in values if isinstance(v, str)]
        encoded = iter(tokenize(texts) if texts else [])
        for v in values:
            if isinstance(v, str):
                yield next(encoded)
            elif isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                yield v
            else:
                raise ValueError(f"--dataset record {index}: --column {column!r} must hold text or a list of "
                                 f"token ids, got {type(v).__name__}")
            index += 1


def tokenize_fn(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """Batched tokenization without special tokens (BOS is the context builder's business)."""

    def tokenize(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return tokenize
