"""The prompts of a collection run, as a source the engine loop reads from a given index on.

``--input`` (:class:`ItemSource`): JSONL, Parquet, or a Hugging Face ``datasets`` folder, read
whole; each record needs one of ``text`` (or ``prompt``), ``messages`` (a chat, rendered with
the model's chat template) or ``prompt_token_ids``; see :mod:`tapllm.collect.prompt_records` for which
wins.

``--dataset`` (:class:`DatasetSource`): any ``datasets`` dataset streamed through the context
builder of :mod:`tapllm.collect.contexts` (``--column`` names the field).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tapllm.collect.contexts import ContextSettings, Cursor, build_contexts
from tapllm.collect.hf_input import DatasetSpec, documents, tokenize_fn
from tapllm.collect.prompt_records import FIELDS, Item, read_jsonl, record_item, to_prompt


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


Prompt = tuple[int, "str | list[int]", "list[int] | None"]


class ItemSource:
    """The records [start, end) of ``--input`` (held in memory), one request each."""

    def __init__(self, items: list[Item], start: int, end: int) -> None:
        self.items = items  # the records of [start, end) only
        self.start = start
        self.end: int | None = end

    def prompts(self, first: int, cursor: list[int] | None, render_chat: Any, tokenizer: Any
                ) -> Iterator[Prompt]:
        """``(index, prompt, None)`` for the records from ``first`` on."""
        for i in range(first, self.end or 0):
            try:
                prompt = to_prompt(self.items[i - self.start], render_chat)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--input record {i}: {exc}") from None
            yield i, prompt, None


class DatasetSource:
    """The contexts of ``--dataset``, built while the dataset streams by (its length is not
    known in advance): one request per context, with the cursor to resume after it."""

    def __init__(self, ds: Any, spec: DatasetSpec, settings: ContextSettings) -> None:
        self.ds = ds
        self.spec = spec
        self.settings = settings
        self.start = 0
        self.end: int | None = None

    def prompts(self, first: int, cursor: list[int] | None, render_chat: Any, tokenizer: Any
                ) -> Iterator[Prompt]:
        """``(context index, token ids, cursor after it)`` from context ``first`` on, which
        ``cursor`` (the one reported with context ``first - 1``) locates in the dataset."""
        cur = Cursor.from_list(cursor)
        skip = cur.records - 1 if cur.carry else cur.records
        docs = documents(self.ds, self.spec.column, skip, tokenize_fn(tokenizer))
        for k, (ctx, after) in enumerate(build_contexts(docs, self.settings, cur)):
            yield first + k, ctx, after.to_list()
