"""Read the prompts of a collection run: JSONL, Parquet, or a Hugging Face ``datasets`` folder.

Each record needs one of ``text`` (or ``prompt``), ``messages`` (a chat, rendered with the
model's chat template) or ``prompt_token_ids``; see :mod:`tapllm.inputs` for which wins.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tapllm.inputs import FIELDS, Item, read_jsonl, record_item


def read_items(path: Path) -> list[Item]:
    """All records of ``path``; ``ValueError`` names the file, line or row and the problem."""
    if not path.exists():
        raise FileNotFoundError(f"--input: no such file or folder: {path}")
    if not path.is_dir() and path.suffix != ".parquet":
        return read_jsonl(path)
    records = _read_datasets_folder(path) if path.is_dir() else _read_parquet(path)
    if not records:
        raise ValueError(f"--input: {path} holds no records")
    return [record_item(rec, f"{path} row {n}") for n, rec in enumerate(records)]


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ValueError(f"--input: {path} is not a readable Parquet file ({exc})") from None
    cols = [c for c in FIELDS if c in table.column_names]
    if not cols:
        raise ValueError(f"--input: {path} has no column named one of {list(FIELDS)} "
                         f"(columns: {table.column_names})")
    return table.select(cols).to_pylist()


def _read_datasets_folder(path: Path) -> list[dict[str, Any]]:
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError and others for a non-dataset folder
        raise ValueError(f"--input: {path} is not a folder written by datasets' save_to_disk ({exc})") from None
    if hasattr(ds, "keys") and not hasattr(ds, "column_names"):
        raise ValueError(f"--input: {path} is a DatasetDict; give one split's folder")
    cols = [c for c in FIELDS if c in ds.column_names]
    if not cols:
        raise ValueError(f"--input: {path} has no column named one of {list(FIELDS)} (columns: {ds.column_names})")
    return ds.select_columns(cols).to_list()


def fingerprint(path: Path) -> str:
    """A content hash of the input (file bytes, or a folder's files), to recognise a rerun."""
    if not path.exists():
        raise FileNotFoundError(f"--input: no such file or folder: {path}")
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
