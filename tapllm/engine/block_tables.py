"""Every running request's KV block table, kept on the device and updated by diffs (vLLM V1's persistent batch).

A request gets a row of :attr:`BlockTables.table` ``[rows + 1, width]`` the first time it is
scheduled, and the whole of its table is sent then. After that a step sends only the entries it
changed, from the first block it writes into on (a decode step: usually none, one when it
starts a block), since the blocks before hold computed context that never changes; a
preempted request (its blocks were freed and are taken anew) is sent whole again. Those
``(row, column, block)`` triples travel in the step's one upload and are written with one
``index_put_``; a step's tables are then gathered from the rows on the device. The last row
holds only ``padding_block``: it is the padding slot, which the padding rows of a graph step read.
"""

from __future__ import annotations

import torch

from tapllm.engine.request import Request


class BlockTables:
    """The device-resident block tables (see the module docstring)."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device, padding_block: int = 0) -> None:
        self.block_size = block_size
        self.width = width
        self.device = device
        self.padding_block = padding_block
        self.table = torch.zeros((rows + 1, width), dtype=torch.int64, device=device)
        self.table[rows] = padding_block
        self._free = list(range(rows - 1, -1, -1))
        self._rows: dict[Request, tuple[int, int | None]] = {}  # request -> (row, preemptions when sent whole)
        self._sent: dict[Request, list[int]] = {}  # request -> the entries its row holds
        self.generation = 0  # bumped when ``table`` moves (a CUDA graph reading it must be captured anew)

    @property
    def padding_slot(self) -> int:
        """The padding slot: the row padding rows of a graph step read, every entry ``padding_block``."""
        return self.table.shape[0] - 1

    def row(self, req: Request, first_written: int, diff: list[int]) -> int:
        """``req``'s row; appends to ``diff`` (flat ``row, column, block`` triples) the entries this step
        must send: all of them for a request new to the table or preempted since, else those from
        block ``first_written`` on."""
        table = req.block_table
        if len(table) > self.width:
            raise ValueError(f"request {req.request_id} holds {len(table)} KV blocks, more than a table row's "
                             f"{self.width}")
        entry = self._rows.get(req)
        if entry is None or entry[1] != req.num_preemptions:
            row = entry[0] if entry is not None else self._take()
            self._rows[req] = (row, req.num_preemptions)
            sent = self._sent[req] = []
            first = 0
        else:
            row, first, sent = entry[0], first_written, self._sent[req]
        for col in range(first, len(table)):
            if col >= len(sent):
                sent.append(table[col])
            elif sent[col] == table[col]:
                continue
            sent[col] = table[col]
            diff += (row, col, table[col])
        return row

    def resend(self, req: Request) -> None:
        """Send ``req``'s whole row at its next step (its last diff may never have reached the device)."""
        entry = self._rows.get(req)
        if entry is not None:
            self._rows[req] = (entry[0], None)

    def _take(self) -> int:
        if not self._free:  # more requests in flight than rows: grow (the table moves)
            old = self.table
            rows = old.shape[0] - 1
            self.table = torch.zeros((2 * rows + 1, self.width), dtype=torch.int64, device=self.device)
            self.table[:rows] = old[:rows]
            self.table[2 * rows] = self.padding_block
            self._free = list(range(2 * rows - 1, rows - 1, -1))
            self.generation += 1
        return self._free.pop()

    def release(self, req: Request) -> None:
        """Give back the row of a request that finished or was aborted (unknown requests are ignored)."""
        entry = self._rows.pop(req, None)
        self._sent.pop(req, None)
        if entry is not None:
            self._free.append(entry[0])

    def apply(self, diff: torch.Tensor) -> None:
        """Write the uploaded ``diff`` (``[k, 3]`` triples on the device) into the table."""
        if diff.numel():
            self.table.index_put_((diff[:, 0], diff[:, 1]), diff[:, 2])

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The tables of ``rows`` (device indices), their first ``width`` columns: ``[len(rows), width]``."""
        return self.table[:, :width].index_select(0, rows)
