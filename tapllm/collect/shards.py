"""Shard files: safetensors or Arrow IPC stream (what Hugging Face ``datasets`` memory-maps).

A shard holds ``rows`` token rows: per point a ``[rows, layers, hidden]`` array, and the
columns ``token_id``, ``request_index`` and ``position``. Files are written beside their
final name and renamed into place after an fsync, so a shard is either whole or absent, and
get the mode the umask gives (safetensors' own temporary is ``0600``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from tapllm.utils.dtypes import ARROW_DTYPES
from tapllm.utils.files import atomic_write

INDEX_COLUMNS = ("token_id", "request_index", "position", "sae_error_norm", "loss_mask")  # one number a row
SUFFIX = {"safetensors": ".safetensors", "arrow": ".arrow"}


class DiskFullError(OSError):
    """The output device ran out of space (or a file size limit was hit) while writing."""


_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def write_error(path: Path, exc: OSError) -> OSError:
    """``exc`` restated so that it names ``path`` (a temporary's name, or none, is all many carry)."""
    if exc.errno is None:
        return OSError(f"cannot write {path}: {exc}")
    reason = exc.strerror or os.strerror(exc.errno)
    if exc.errno in _FULL:
        return DiskFullError(exc.errno, f"no space left writing {path} ({reason})")
    return OSError(exc.errno, f"cannot write {path}: {reason}")


def write_shard(path: Path, columns: dict[str, torch.Tensor], fmt: str) -> tuple[int, str]:
    """Write one shard atomically, with the umask's mode; returns (bytes, sha256 hex).

    An ``OSError`` names ``path`` (``DiskFullError`` for a full disk or a file size limit).
    """
    write = _write_safetensors if fmt == "safetensors" else _write_arrow
    write_file(path, lambda tmp: write(tmp, columns))
    return path.stat().st_size, sha256_file(path)


def write_file(path: Path, data: bytes | str | Callable[[Path], None]) -> None:
    """``atomic_write`` whose ``OSError`` names ``path`` (``DiskFullError`` for a full disk)."""
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise write_error(path, exc) from None


def _write_safetensors(path: Path, columns: dict[str, torch.Tensor]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file({k: v.contiguous() for k, v in columns.items()}, str(path), metadata={"format": "tapllm.shard"})
    except SafetensorError as exc:  # its I/O failures are not OSError: recover the errno from the message
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from exc


def _write_arrow(path: Path, columns: dict[str, torch.Tensor]) -> None:
    import pyarrow as pa

    arrays, names = [], []
    for name, t in columns.items():
        if name in INDEX_COLUMNS:
            arrays.append(pa.array(t.numpy()))
        else:
            rows, layers, hidden = t.shape
            flat = pa.array(t.reshape(-1).numpy())
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(flat, hidden), layers))
        names.append(name)
    table = pa.Table.from_arrays(arrays, names=names)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, (64 << 20) // max(1, _row_bytes(columns))))


def _row_bytes(columns: dict[str, torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in columns.values() if t.shape[0])


def arrow_dtype_ok(dtype: torch.dtype) -> bool:
    """Arrow has no bfloat16."""
    return dtype in ARROW_DTYPES


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
