"""One shard's columns as memory-mapped arrays: reading rows touches only their pages.

safetensors: the file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the data; each tensor becomes a numpy view into
one ``np.memmap`` of the file. Arrow: the IPC stream is read with ``pyarrow.memory_map``
(zero-copy), and each record batch's buffers are viewed as numpy arrays.

The safetensors header is read here rather than through ``safetensors.safe_open``: its slices
take ranges, not index arrays, so a shuffled batch would cost one call per row, while a numpy
view of the mapped file gathers any index set in one fancy-indexing copy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class _Column:
    """A column as numpy chunks (one for safetensors, one per record batch for Arrow)."""

    __slots__ = ("bf16", "chunks", "starts", "tail")

    def __init__(self, chunks: list[np.ndarray], bf16: bool, tail: tuple[int, ...], dtype: np.dtype) -> None:
        self.chunks = chunks or [np.empty((0, *tail), dtype=dtype)]
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks])
        self.bf16 = bf16
        self.tail = tail

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.view(torch.bfloat16) if self.bf16 else t

    def take(self, idx: np.ndarray) -> torch.Tensor:
        """Rows ``idx`` (any order), copied out of the map."""
        if len(self.chunks) == 1:
            return self._tensor(self.chunks[0][idx])
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((len(idx), *self.tail), dtype=self.chunks[0].dtype)
        for c in np.unique(which):
            m = which == c
            out[m] = self.chunks[c][idx[m] - self.starts[c]]
        return self._tensor(out)

    def slice(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b), copied."""
        return self.take(np.arange(a, b)) if len(self.chunks) > 1 else self._tensor(np.array(self.chunks[0][a:b]))


class ShardView:
    """The columns of one shard file, mapped; ``take`` / ``slice`` copy only the rows asked for."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path = path
        self.map: np.memmap | None = None  # safetensors: the file's map (readers madvise it)
        if fmt == "safetensors":
            self.columns, self.map = _open_safetensors(path)
        else:
            self.columns = _open_arrow(path)
        self.rows = int(self.columns["position"].starts[-1])

    def take(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows ``idx`` (0-based within the shard, any order) of every column."""
        return {k: c.take(idx) for k, c in self.columns.items()}

    def slice(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """Rows [a, b) of every column."""
        return {k: c.slice(a, b) for k, c in self.columns.items()}


def _open_safetensors(path: Path) -> tuple[dict[str, _Column], np.memmap]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    raw = np.asarray(mapped)
    base = 8 + size
    cols = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which the reader does not map")
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        arr = raw[base + b : base + e].view(dtype).reshape(shape)
        cols[name] = _Column([arr], info["dtype"] == "BF16", shape[1:], np.dtype(dtype))
    return cols, mapped


def _open_arrow(path: Path) -> dict[str, _Column]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:  # the table's buffers keep the map alive
        table = pa.ipc.open_stream(source).read_all()
    cols = {}
    for field in table.schema:
        col = table.column(field.name)
        if pa.types.is_fixed_size_list(field.type):
            layers, hidden = field.type.list_size, field.type.value_type.list_size
            dtype = field.type.value_type.value_type.to_pandas_dtype()
            chunks = [c.flatten().flatten().to_numpy(zero_copy_only=True).reshape(len(c), layers, hidden)
                      for c in col.chunks if len(c)]
            cols[field.name] = _Column(chunks, False, (layers, hidden), np.dtype(dtype))
        else:
            chunks = [c.to_numpy(zero_copy_only=True) for c in col.chunks if len(c)]
            cols[field.name] = _Column(chunks, False, (), np.dtype(field.type.to_pandas_dtype()))
    return cols
