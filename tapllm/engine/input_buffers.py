"""The device buffers a graph step reads: one named tensor per input, at addresses that never change.

A CUDA graph reads its inputs where they were when it was captured, so a graph step's inputs live
in :class:`InputBuffers`, allocated once for the largest step, one int64 buffer cut into named
views. Each step writes the host layout of its rows into a host mirror and sends the part it uses
in one copy; a row past the step's own (a graph bucket's padding) reads the padding slot, whose
block-table row names only the padding block, at position 0 and writes its key and value there.

Per row: the token id, its position, its slot (the block-table row of its request) and whether it
is the last row of its request's chunk. Per sequence (for the attention of a step with prefill
chunks): the first row of each sequence (``cu_q``, one more entry than sequences), the tokens it
had cached before the step (``ctx``) and its slot. Per sampled row: the batch row it reads and its
slot (the padding slot past the step's). A row whose token id is -1 reads its slot's last sampled
token on the device (the host is a step ahead of the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ROW_FIELDS = ("ids", "positions", "row_slot", "last_rows")
_SEQ_FIELDS = ("ctx", "seq_rows", "sample_rows", "sample_slot")


@dataclass(slots=True)
class InputViews:
    """The first ``rows`` rows and ``seqs`` sequences of the buffers (what one graph reads)."""

    ids: torch.Tensor
    positions: torch.Tensor
    row_slot: torch.Tensor
    last_rows: torch.Tensor  # 1 on the last row of a request's chunk
    cu_q: torch.Tensor
    ctx: torch.Tensor
    seq_rows: torch.Tensor
    sample_rows: torch.Tensor
    sample_slot: torch.Tensor


class InputBuffers:
    """The graph step's inputs on the device and their host mirror (see the module docstring)."""

    def __init__(self, rows: int, seqs: int, padding_slot: int, device: torch.device) -> None:
        self.rows, self.seqs, self.padding_slot = rows, seqs, padding_slot
        self._offsets: dict[str, tuple[int, int]] = {}
        size = 0
        for name in _ROW_FIELDS:
            self._offsets[name] = (size, rows)
            size += rows
        self._offsets["cu_q"] = (size, seqs + 1)
        size += seqs + 1
        for name in _SEQ_FIELDS:
            self._offsets[name] = (size, seqs)
            size += seqs
        self.size = size
        self.device = device
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)

    def view(self, rows: int, seqs: int) -> InputViews:
        """The device views a graph of ``rows`` rows and ``seqs`` sequences reads."""
        def field(name: str, n: int) -> torch.Tensor:
            start, _ = self._offsets[name]
            return self.buffer[start : start + n]

        return InputViews(field("ids", rows), field("positions", rows), field("row_slot", rows),
                          field("last_rows", rows), field("cu_q", seqs + 1), field("ctx", seqs),
                          field("seq_rows", seqs), field("sample_rows", seqs), field("sample_slot", seqs))

    def fill(self, host: np.ndarray, rows: int, seqs: int, *, ids: list[int], positions: list[int], row_slot: list[int],
             last_rows: list[int], cu_q: list[int] | None = None, ctx: list[int] | None = None,
             seq_rows: list[int] | None = None, sample_rows: list[int] | None = None,
             sample_slot: list[int] | None = None) -> None:
        """Write one step's values into ``host`` (laid out like the buffer), padding its rows to ``rows`` and
        its sequences to ``seqs`` (a padding row reads the padding slot at position 0; a padding sequence is
        empty)."""
        def field(name: str) -> np.ndarray:
            start, n = self._offsets[name]
            return host[start : start + n]

        n = len(ids)
        for name, values, pad in (("ids", ids, 0), ("positions", positions, 0),
                                  ("row_slot", row_slot, self.padding_slot), ("last_rows", last_rows, 0)):
            h = field(name)
            h[:n] = values
            h[n:rows] = pad
        if cu_q is not None:
            k = len(cu_q) - 1
            h = field("cu_q")
            h[: k + 1] = cu_q
            h[k + 1 : seqs + 1] = cu_q[-1]
            for name, values, pad in (("ctx", ctx, 0), ("seq_rows", seq_rows, self.padding_slot)):
                h = field(name)
                h[:k] = values
                h[k:seqs] = pad
        if sample_rows is not None:
            for name, values, pad in (("sample_rows", sample_rows, 0), ("sample_slot", sample_slot, self.padding_slot)):
                h = field(name)
                h[: len(values)] = values
                h[len(values) : seqs] = pad

    def load(self, uploaded: torch.Tensor) -> None:
        """Copy a step's uploaded values (what :meth:`fill` wrote) into the buffers (a copy on the device)."""
        self.buffer.copy_(uploaded)
