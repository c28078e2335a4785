"""What each running request captures and steers, kept on the device per slot: the tap of a graph step.

A graph replays the same kernels on the same addresses, so a step's tap cannot be a plan made
for that step: it is a set of tables, written when a request takes a slot (and cleared when it
leaves), that the tap's kernel reads at every site with the step's row -> slot map and positions.
The tables hold plain numbers only (this package knows no request); ``tapllm.engine`` turns a
request's capture and steering into them.

Capture, per slot: ``cap_off[slot, site]`` is where the site's row sits in the slot's *record*
(one position's captured numbers, site after site; -1: not captured), ``cap_rec[slot]`` the record's
size, ``cap_lo``/``cap_hi`` the positions captured and ``cap_last`` whether only the last row of
each chunk is (``positions="last"``). Each step the :meth:`TapTables.prologue` gives every row
its place in the flat capture buffer ``cap_out``: rows that capture follow each other in batch
order, each taking its slot's record (``row_base``; -1 for a row that captures nothing), so one
request's rows of a step are one contiguous block ``[rows, record]``. The host computes the same
places from its mirror of the tables (:meth:`TapTables.places` row by row, :meth:`TapTables.chunk_places`
chunk by chunk, as a step uses it), so it knows which part of the buffer to copy back and whose rows
are where, without reading the device.

Steering, per slot and site: ``st_first``/``st_count`` name a run of operations in ``ops``
(``[kind, first position, end position, pool row, pool rows per position]``, and ``op_value``: a
clamp's target), applied in order to rows whose position lies in ``[first, end)``. An operation
reads one ``pool`` row of the site's width (the row at ``pool row + (position - first) * pool
rows per position``): the vector to add, the factors to multiply by (1 where a head or neuron is
not chosen), the unit direction (0 where not chosen) or the values to set (NaN where not chosen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tapllm.tap.sites import Sites

OP_ADD, OP_SCALE, OP_DIRECTION, OP_SET = 1, 2, 3, 4
OP_FIELDS = 5
NO_END = 1 << 62  # the end position of an operation with no end


@dataclass(slots=True)
class SlotCapture:
    """A slot's capture in plain numbers: each captured site's offset in the record, the record's size,
    the positions ``[lo, hi)`` captured, and whether only each chunk's last row is."""

    offsets: dict[int, int]
    record: int
    lo: int
    hi: int
    last_only: bool = False


@dataclass(slots=True)
class SlotOp:
    """One steering operation of a slot at one site: ``rows`` ``[n, site width]`` (float32) go to the pool;
    positions ``[lo, hi)``; ``stride`` pool rows per position (0: one row for every position)."""

    site: int
    kind: int
    lo: int
    hi: int
    rows: torch.Tensor
    stride: int = 0
    value: float = 0.0


class RangeAllocator:
    """Contiguous ranges of ``[0, capacity)``, first fit (a slot's operations and pool rows)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), by start

    def take(self, size: int) -> int | None:
        """The start of a free range of ``size`` (0 is always free), or None when none is left."""
        if size == 0:
            return 0
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def give(self, start: int, size: int) -> None:
        """Return a range taken earlier (neighbours merge)."""
        if size == 0:
            return
        spans = sorted([*self._free, (start, size)])
        merged: list[tuple[int, int]] = []
        for s, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    @property
    def used(self) -> int:
        return self.capacity - sum(n for _, n in self._free)


class TapTables:
    """The device tables of every slot's capture and steering (see the module docstring)."""

    def __init__(self, sites: Sites, slots: int, rows: int, device: torch.device, dtype: torch.dtype, *,
                 max_ops: int, pool_rows: int, capture_numbers: int) -> None:
        """``slots`` table rows (the padding slot included), ``rows`` the most rows of a step;
        ``max_ops``/``pool_rows`` the steering capacity, ``capture_numbers`` the capture buffer's size."""
        n, s = slots, len(sites)
        self.sites = sites
        self.device = device
        self.cap_off = torch.full((n, s), -1, dtype=torch.int32, device=device)
        self.cap_rec = torch.zeros(n, dtype=torch.int64, device=device)
        self.cap_lo = torch.zeros(n, dtype=torch.int64, device=device)
        self.cap_hi = torch.zeros(n, dtype=torch.int64, device=device)
        self.cap_last = torch.zeros(n, dtype=torch.bool, device=device)
        self.cap_out = torch.zeros(max(1, capture_numbers), dtype=dtype, device=device)
        self.row_base = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.st_first = torch.zeros((n, s), dtype=torch.int32, device=device)
        self.st_count = torch.zeros((n, s), dtype=torch.int32, device=device)
        self.ops = torch.zeros((max(1, max_ops), OP_FIELDS), dtype=torch.int64, device=device)
        self.op_value = torch.zeros(max(1, max_ops), dtype=torch.float32, device=device)
        self.pool = torch.zeros((max(1, pool_rows), sites.max_width), dtype=torch.float32, device=device)
        # The host's mirror of what places rows in the capture buffer.
        self.rec = np.zeros(n, dtype=np.int64)
        self.lo = np.zeros(n, dtype=np.int64)
        self.hi = np.zeros(n, dtype=np.int64)
        self.last = np.zeros(n, dtype=np.bool_)
        self.steered = np.zeros(n, dtype=np.bool_)
        # The same numbers as lists, for :meth:`chunk_places`' loop (a list's item costs a fraction of an
        # array's); written together with the arrays.
        # each slot's capture span, read per step on the host: (record, lo, hi, last only), None: no capture
        self.spans: list[tuple[int, int, int, bool] | None] = [None] * n
        self.capturing = 0  # slots that capture
        self.steering = 0  # slots that steer
        self._ops = RangeAllocator(max_ops)
        self._pool = RangeAllocator(pool_rows)
        self._held: dict[int, tuple[int, int, int, int]] = {}  # slot -> (op start, ops, pool start, rows)
        # Rows written since the last step's upload: (device rows, host values); the engine sends them in the
        # step's one upload (a copy from pageable host memory would wait for the device).
        self.pending: list[tuple[torch.Tensor, np.ndarray]] = []

    # ---- per slot ----------------------------------------------------------------------------
    def write(self, slot: int, capture: SlotCapture | None, ops: Sequence[SlotOp]) -> str | None:
        """Fill ``slot``'s rows; None, or why they do not fit (the slot is then left empty)."""
        self.clear(slot)
        if capture is not None and capture.record:
            if capture.record > self.cap_out.numel():
                return "a request's captured record exceeds the capture buffer"
            off = np.full(len(self.sites), -1, dtype=np.int32)
            for site, o in capture.offsets.items():
                off[site] = o
            self.pending.append((self.cap_off[slot], off))
            self.cap_rec[slot] = capture.record
            self.cap_lo[slot] = capture.lo
            self.cap_hi[slot] = capture.hi
            self.cap_last[slot] = capture.last_only
            self.rec[slot], self.lo[slot], self.hi[slot] = capture.record, capture.lo, capture.hi
            self.last[slot] = capture.last_only
            self.spans[slot] = (capture.record, capture.lo, capture.hi, capture.last_only)
            self.capturing += 1
        if ops:
            problem = self._write_ops(slot, ops)
            if problem is not None:
                self.clear(slot)
                return problem
        return None

    def _write_ops(self, slot: int, ops: Sequence[SlotOp]) -> str | None:
        order = sorted(range(len(ops)), key=lambda i: ops[i].site)  # stable: a site's ops keep their order
        n_rows = sum(int(op.rows.shape[0]) for op in ops)
        first_op, first_row = self._ops.take(len(ops)), self._pool.take(n_rows)
        if first_op is None or first_row is None:
            if first_op is not None:
                self._ops.give(first_op, len(ops))
            if first_row is not None:
                self._pool.give(first_row, n_rows)
            return "its steering operands exceed the graph's steering tables"
        self._held[slot] = (first_op, len(ops), first_row, n_rows)
        table = np.zeros((len(ops), OP_FIELDS), dtype=np.int64)
        values = np.zeros(len(ops), dtype=np.float32)
        pool = np.zeros((n_rows, self.sites.max_width), dtype=np.float32)
        first = np.zeros(len(self.sites), dtype=np.int32)
        count = np.zeros(len(self.sites), dtype=np.int32)
        row = 0
        for k, i in enumerate(order):
            op = ops[i]
            n, width = op.rows.shape
            pool[row : row + n, :width] = op.rows.numpy()
            table[k] = (op.kind, op.lo, op.hi, first_row + row, op.stride)
            values[k] = op.value
            if count[op.site] == 0:
                first[op.site] = first_op + k
            count[op.site] += 1
            row += n
        self.pending += [(self.ops[first_op : first_op + len(ops)], table),
                         (self.op_value[first_op : first_op + len(ops)], values),
                         (self.st_first[slot], first), (self.st_count[slot], count)]
        if n_rows:
            self.pending.append((self.pool[first_row : first_row + n_rows], pool))
        self.steered[slot] = True
        self.steering += 1
        return None

    def flush_pending(self) -> None:
        """Write the pending rows now, each its own copy (without a step's upload to carry them)."""
        for dest, values in self.pending:
            dest.copy_(torch.from_numpy(values).view(dest.shape))
        self.pending.clear()

    def clear(self, slot: int) -> None:
        """Forget ``slot``'s capture and steering (its operations and pool rows are free again)."""
        self.pending = [(d, v) for d, v in self.pending if not _in_slot(d, self, slot)]
        if self.rec[slot]:
            self.cap_off[slot].fill_(-1)
            self.cap_rec[slot] = 0
            self.rec[slot] = 0
            self.spans[slot] = None
            self.capturing -= 1
        if self.steered[slot]:
            self.st_count[slot].zero_()
            self.steered[slot] = False
            self.steering -= 1
        held = self._held.pop(slot, None)
        if held is not None:
            self._ops.give(held[0], held[1])
            self._pool.give(held[2], held[3])

    def any_steers(self, slots: Sequence[int] | np.ndarray) -> bool:
        """True when any of ``slots`` steers."""
        return self.steering > 0 and bool(self.steered[slots].any())

    # ---- per step ----------------------------------------------------------------------------
    def prologue(self, row_slot: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor) -> None:
        """Each row's place in ``cap_out`` (``row_base``; device ops only, graph-safe): see the module docstring.
        A graph step computes the same in one kernel (``tapllm.kernels.triton_tap.prologue``).

        ``last_rows`` ``[T]`` is nonzero on the last row of each request's chunk."""
        t = row_slot.shape[0]
        if last_rows.dtype != torch.bool:
            last_rows = last_rows != 0
        rec = self.cap_rec.index_select(0, row_slot)
        inside = (positions >= self.cap_lo.index_select(0, row_slot)) & \
            (positions < self.cap_hi.index_select(0, row_slot)) & \
            (last_rows | ~self.cap_last.index_select(0, row_slot))
        numbers = torch.where(inside, rec, 0)
        ends = torch.cumsum(numbers, 0)
        self.row_base[:t].copy_(torch.where(numbers > 0, ends - numbers, -1))

    def places(self, row_slot: np.ndarray, positions: np.ndarray, last_rows: np.ndarray | None
               ) -> tuple[np.ndarray, int]:
        """What :meth:`prologue` computes, on the host: ``row_base`` per row and the numbers captured in all.
        ``last_rows`` None: every row is its chunk's last (a decode step)."""
        rec = self.rec[row_slot]
        inside = (positions >= self.lo[row_slot]) & (positions < self.hi[row_slot])
        if last_rows is not None:
            inside &= last_rows.astype(np.bool_, copy=False) | ~self.last[row_slot]
        numbers = rec * inside
        ends = np.cumsum(numbers)
        base = ends - numbers
        base[numbers == 0] = -1
        return base, int(ends[-1]) if len(ends) else 0


    def chunk_places(self, slots: Sequence[int], starts: Sequence[int], sizes: Sequence[int] | None = None
                     ) -> tuple[list[tuple[int, int, int]], int]:
        """:meth:`places` by chunk: chunk ``i`` runs positions ``[starts[i], starts[i] + sizes[i])`` in slot
        ``slots[i]`` (``sizes`` None: one position each, a decode step). Returns ``(i, number of its first
        captured row, rows captured)`` for each chunk that captures, and the numbers captured in all. A
        chunk's captured rows are consecutive, and so are their places, one record apart."""
        spans = self.spans
        out: list[tuple[int, int, int]] = []
        total = 0
        if sizes is None:  # one position a chunk: it captures when it lies in the span (last_only too)
            for i, slot in enumerate(slots):
                span = spans[slot]
                if span is not None and span[1] <= starts[i] < span[2]:
                    out.append((i, total, 1))
                    total += span[0]
            return out, total
        for i, slot in enumerate(slots):
            span = spans[slot]
            if span is None:
                continue
            rec, lo, hi, last_only = span
            start = starts[i]
            end = start + sizes[i]
            if last_only:
                count = 1 if lo <= end - 1 < hi else 0
            else:
                count = min(end, hi) - max(start, lo)
            if count > 0:
                out.append((i, total, count))
                total += count * rec
        return out, total


def _in_slot(dest: torch.Tensor, tables: TapTables, slot: int) -> bool:
    """Whether a pending write goes to one of ``slot``'s per-slot rows (dropped when the slot is cleared)."""
    for t in (tables.cap_off, tables.st_first, tables.st_count):
        if dest.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and \
                dest.storage_offset() == t[slot].storage_offset():
            return True
    return False
