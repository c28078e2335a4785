"""Read the prompts of a collection run: JSONL, Parquet, or a Hugging Face ``datasets`` folder.

Each record needs one of ``text`` (or ``prompt``), ``messages`` (a chat, rendered with the
model's chat template) or ``prompt_token_ids``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("text", "prompt", "messages", "prompt_token_ids")


@dataclass(slots=True)
class Item:
    """One input record: ``kind`` is ``"text"``, ``"messages"`` or ``"ids"``."""

    kind: str
    value: Any


def read_items(path: Path) -> list[Item]:
    """All records of ``path``; ``ValueError`` names the file, line or row and the problem."""
    if not path.exists():
        raise FileNotFoundError(f"--input: no such file or folder: {path}")
    if path.is_dir():
        records = _read_datasets_folder(path)
        where = "row"
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
        where = "row"
    else:
        records = _read_jsonl(path)
        where = "line"
    if not records:
        raise ValueError(f"--input: {path} holds no records")
    items = []
    for n, rec in enumerate(records, start=1 if where == "line" else 0):
        items.append(_item(rec, f"{path}:{n}" if where == "line" else f"{path} row {n}"))
    return items


def _item(rec: Any, where: str) -> Item:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: each record must be an object with one of {list(FIELDS)}")
    if rec.get("messages") is not None:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        return Item("messages", msgs)
    if rec.get("prompt_token_ids") is not None:
        ids = rec["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
        return Item("ids", ids)
    text = rec.get("text", rec.get("prompt"))
    if text is None:
        raise ValueError(f"{where}: needs a 'text', 'prompt', 'messages' or 'prompt_token_ids' field "
                         f"(found {sorted(rec)})")
    if not isinstance(text, str):
        raise ValueError(f"{where}: 'text' must be a string")
    return Item("text", text)


def _read_jsonl(path: Path) -> list[Any]:
    out = []
    with path.open("rb") as f:  # decoded line by line, so an error names its line
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte "
                                 f"{exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    return out


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
