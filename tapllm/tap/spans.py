"""Where a chunk of a request sits in a step's batch, as plain numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class RowSpan:
    """Positions ``[start, start + num_tokens)`` of one request sit at batch rows ``[row, row + num_tokens)``."""

    row: int
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        """One past the chunk's last position."""
        return self.start + self.num_tokens

    def row_of(self, position: int) -> int:
        """The batch row of ``position`` (which must lie in the chunk)."""
        return self.row + position - self.start


def rows_tensor(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Batch rows (or any ids) as an int64 tensor on ``device``, sent without waiting for the device:
    a blocking copy would first wait for every kernel queued before it."""
    t = torch.tensor(rows, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
