"""Shuffled reads of a collected dataset for PyTorch, at the granularity a trainer shuffles at.

>>> ds = tapllm.datasets.open("acts/")
>>> reader = ShuffledBatches(ds, batch_size=4096, unit="context")          # SAELens' granularity
>>> reader = ShuffledBatches(ds, 4096, unit="block", block_rows=1024, shuffle_buffer=65536)
>>> reader = ShuffledBatches(ds, 4096, unit="token", columns=["resid_post"])
>>> for batch in DataLoader(reader, batch_size=None, num_workers=2): ...   # {column: tensor}

The unit is what is shuffled:

- ``"token"``: each row by itself; the batches together are one random permutation of all
  rows (memory: 8 bytes a row for the permutation).
- ``"block"``: runs of ``block_rows`` consecutive rows of a shard (fixed-size chunks).
- ``"context"``: the rows of one request, i.e. one ``--dataset`` context or one ``--input``
  prompt (SAELens caches one context a row and shuffles those).

Units are taken in a random order over all shards and cut into batches of ``batch_size`` rows
(a unit can end one batch and start the next). With ``shuffle_buffer=N`` the units stream into
a buffer of about N rows and every batch is a random draw from it (each drawn row is replaced
by the next units' rows), so a batch mixes rows of many units from many shards, as SAELens'
mixing buffer does; the pass still yields every row once.

Reads are numpy copies out of the shards' memory maps (one gather per column and shard for
tokens, one contiguous copy per unit otherwise): torch's CPU indexing is many times slower
than numpy's for gathering rows. For units, each batch's pieces are announced to the kernel
(``MADV_WILLNEED``) a few batches before they are copied, so a dataset that is not in the page
cache is read with large, parallel I/Os (``prefetch=False`` leaves the maps alone). Token
reads keep the kernel's default read-around: over a whole pass it brings in neighbouring rows
that later batches use, which ``MADV_RANDOM`` would fetch one page at a time.
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

Batch = dict[str, torch.Tensor]
UNITS = ("token", "block", "context")
READ_AHEAD = 2  # batches whose pages are requested (MADV_WILLNEED) before the current one is copied
INDEX_COLUMNS = ("token_id", "request_index", "position", "sae_error_norm", "loss_mask")


def _as_tensor(a: np.ndarray, bf16: bool) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if bf16 else t


def _layer_index(sel: Any) -> Any:
    """``sel`` (indices into a point's layers) as a slice where it is one, so reads stay views."""
    if sel is None:
        return slice(None)
    if len(sel) and list(sel) == list(range(sel[0], sel[-1] + 1)):
        return slice(sel[0], sel[-1] + 1)
    return np.asarray(sel)


class _Plan:
    """Which columns a reader returns, and how to allocate and fill them."""

    def __init__(self, ds: Any, columns: Sequence[str] | None, layers: Sequence[int] | None) -> None:
        view = ds.view(0)
        have = list(view.columns)
        self.columns = list(columns) if columns is not None else have
        missing = [c for c in self.columns if c not in have]
        if missing or not self.columns:
            raise ValueError(f"columns must name some of the dataset's columns {have}, got {list(self.columns)}")
        self.sel: Any = slice(None)
        self.every_layer = layers is None
        if layers is not None:
            bad = [k for k in layers if k not in ds.layers]
            if bad or not layers:
                raise ValueError(f"layers must name some of the dataset's layers {ds.layers}, got {list(layers)}")
            self.sel = _layer_index([ds.layers.index(k) for k in layers])
        self.spec = {}
        for c in self.columns:
            col = view.columns[c]
            tail = col.tail
            if c not in INDEX_COLUMNS and len(tail) == 2 and layers is not None:
                tail = (len(range(*self.sel.indices(tail[0]))) if isinstance(self.sel, slice) else len(self.sel),
                        tail[1])
            self.spec[c] = (tail, col.chunks[0].dtype, col.bf16)

    def empty(self, rows: int) -> dict[str, np.ndarray]:
        return {c: np.empty((rows, *tail), dtype=dt) for c, (tail, dt, _) in self.spec.items()}

    def tensors(self, out: dict[str, np.ndarray]) -> Batch:
        return {c: _as_tensor(a, self.spec[c][2]) for c, a in out.items()}

    def pick(self, c: str, arr: np.ndarray) -> np.ndarray:
        """``arr``'s rows restricted to the selected layers (a view when they are consecutive)."""
        if self.every_layer or c in INDEX_COLUMNS or arr.ndim != 3:
            return arr
        return arr[:, self.sel]


def _copy_rows(col: Any, a: int, b: int, out: np.ndarray, plan: _Plan, name: str) -> None:
    """Rows [a, b) of a mapped column into ``out`` (one contiguous copy per chunk)."""
    if len(col.chunks) == 1:
        np.copyto(out, plan.pick(name, col.chunks[0][a:b]))
        return
    o = 0
    for k in range(int(np.searchsorted(col.starts, a, side="right")) - 1, len(col.chunks)):
        s = int(col.starts[k])
        if s >= b:
            break
        lo, hi = max(a, s) - s, min(b, int(col.starts[k + 1])) - s
        np.copyto(out[o : o + hi - lo], plan.pick(name, col.chunks[k][lo:hi]))
        o += hi - lo


def _take_rows(col: Any, idx: np.ndarray, plan: _Plan, name: str) -> np.ndarray:
    """Rows ``idx`` (valid, any order) of a mapped column, gathered."""
    if len(col.chunks) == 1:
        chunk = col.chunks[0]
        if isinstance(plan.sel, slice):  # a view: gather only the layers kept
            return np.take(plan.pick(name, chunk), idx, axis=0, mode="clip")  # clip: no bounds buffer
        return plan.pick(name, np.take(chunk, idx, axis=0, mode="clip"))
    which = np.searchsorted(col.starts, idx, side="right") - 1
    out = np.empty((len(idx), *plan.pick(name, col.chunks[0][:0]).shape[1:]), dtype=col.chunks[0].dtype)
    for k in np.unique(which):
        m = which == k
        out[m] = plan.pick(name, col.chunks[k][idx[m] - col.starts[k]])
    return out


def advise(view: Any, pattern: int, start: int = 0, length: int = 0) -> None:
    """``madvise`` a shard's map (safetensors shards; a no-op where the map or the call is missing)."""
    m = getattr(getattr(view, "map", None), "_mmap", None)
    if m is None or not hasattr(m, "madvise"):
        return
    if length:  # the call wants a page-aligned start
        page = mmap.PAGESIZE
        length += start % page
        start -= start % page
    try:
        m.madvise(pattern, start, length) if length else m.madvise(pattern)
    except (OSError, ValueError):
        pass


def gather(ds: Any, idx: np.ndarray, columns: Sequence[str] | None = None, layers: Sequence[int] | None = None
           ) -> Batch:
    """Rows ``idx`` (valid, non-negative global row numbers, any order) of ``ds``, in that order:
    one numpy gather per shard and column, scattered into place."""
    plan = _Plan(ds, columns, layers)
    return plan.tensors(_gather(ds, row_starts(ds), idx, plan))


def row_starts(ds: Any) -> np.ndarray:
    """The first global row of each shard, and the row count at the end."""
    return np.cumsum([0] + [int(s["rows"]) for s in ds.shards]).astype(np.int64)


def _gather(ds: Any, starts: np.ndarray, idx: np.ndarray, plan: _Plan) -> dict[str, np.ndarray]:
    shard_of = np.searchsorted(starts, idx, side="right") - 1
    first = int(shard_of[0]) if len(idx) else 0
    if len(idx) == 0 or (shard_of == first).all():
        view = ds.view(first)
        local = idx - starts[first]
        return {c: _take_rows(view.columns[c], local, plan, c) for c in plan.columns}
    out = plan.empty(len(idx))
    order = np.argsort(shard_of, kind="stable")
    bounds = np.flatnonzero(np.diff(shard_of[order])) + 1
    for group in np.split(order, bounds):
        s = int(shard_of[group[0]])
        view = ds.view(s)
        local = idx[group] - starts[s]
        for c in plan.columns:
            out[c][group] = _take_rows(view.columns[c], local, plan, c)
    return out


def in_order(ds: Any, batch_size: int = 4096, columns: Sequence[str] | None = None,
             layers: Sequence[int] | None = None) -> Iterator[Batch]:
    """Batches of up to ``batch_size`` rows in input order (a batch never spans two shards),
    reading only ``columns`` (and of the point columns only ``layers``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    plan = _Plan(ds, columns, layers)
    for s in range(len(ds.shards)):
        view = ds.view(s)
        for a in range(0, view.rows, batch_size):
            b = min(a + batch_size, view.rows)
            out = plan.empty(b - a)
            for c in plan.columns:
                _copy_rows(view.columns[c], a, b, out[c], plan, c)
            yield plan.tensors(out)


def unit_table(ds: Any, unit: str, block_rows: int = 1024) -> np.ndarray:
    """The units of ``ds`` as rows ``(shard, start, end)`` (shard-local row ranges), in input order."""
    parts = []
    for s, meta in enumerate(ds.shards):
        n = int(meta["rows"])
        if n == 0:
            continue
        if unit == "block":
            a = np.arange(0, n, block_rows, dtype=np.int64)
            b = np.minimum(a + block_rows, n)
        else:
            req = np.concatenate(ds.view(s).columns["request_index"].chunks)
            inner = np.flatnonzero(np.diff(req)) + 1
            a = np.concatenate([[0], inner]).astype(np.int64)
            b = np.concatenate([inner, [n]]).astype(np.int64)
        parts.append(np.stack([np.full(len(a), s, dtype=np.int64), a, b], axis=1))
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)


class ShuffledBatches(IterableDataset):
    """Batches of a collected dataset in shuffled order (see the module docstring).

    ``ds``: a :class:`tapllm.datasets.ActivationDataset`. ``unit``: ``"token"``, ``"block"``
    or ``"context"``. ``columns``: the columns read (default all); ``layers``: keep only these
    blocks of the point columns. ``shuffle_buffer``: rows of the mixing buffer (0: none; not
    for ``"token"``, which is fully shuffled already). ``drop_last``: drop a last short batch.
    Each ``DataLoader`` worker reads its own share (every ``num_workers``-th batch or unit);
    :meth:`set_epoch` gives the next pass a new order. Yields ``{column: tensor}`` batches;
    use ``DataLoader(reader, batch_size=None)``.
    """

    def __init__(self, ds: Any, batch_size: int = 4096, unit: str = "context", *, block_rows: int = 1024,
                 shuffle_buffer: int = 0, columns: Sequence[str] | None = None, layers: Sequence[int] | None = None,
                 seed: int = 0, drop_last: bool = False, prefetch: bool = True) -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0 (0: no buffer), got {shuffle_buffer}")
        if shuffle_buffer and unit == "token":
            raise ValueError("shuffle_buffer applies to unit='block' or 'context' (unit='token' shuffles every row)")
        if not ds.shards:
            raise ValueError("the dataset has no rows")
        self.ds = ds
        self.batch_size = batch_size
        self.unit = unit
        self.block_rows = block_rows
        self.shuffle_buffer = shuffle_buffer
        self.plan = _Plan(ds, columns, layers)
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.prefetch = prefetch
        self._units: np.ndarray | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the order of pass ``epoch``."""
        self.epoch = epoch

    def units(self) -> np.ndarray:
        """The shuffling units as rows ``(shard, start, end)``, in input order."""
        if self._units is None:
            self._units = unit_table(self.ds, self.unit, self.block_rows) if self.unit != "token" else \
                np.empty((0, 3), dtype=np.int64)
        return self._units

    def __len__(self) -> int:
        """Batches in one pass (over all workers)."""
        n = len(self.ds)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = np.random.default_rng([self.seed, self.epoch, worker] if workers > 1 else [self.seed, self.epoch])
        if self.unit == "token":
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.ds))
            yield from self._tokens(order, worker, workers)
        elif self.shuffle_buffer:
            units = self.units()
            mine = units[np.random.default_rng([self.seed, self.epoch]).permutation(len(units))[worker::workers]]
            yield from self._buffered(mine, rng)
        else:
            units = self.units()
            mine = units[np.random.default_rng([self.seed, self.epoch]).permutation(len(units))[worker::workers]]
            yield from self._units_in_batches(mine)

    def _tokens(self, order: np.ndarray, worker: int, workers: int) -> Iterator[Batch]:
        starts = row_starts(self.ds)
        n = len(order)
        stop = n - n % self.batch_size if self.drop_last else n
        for k, a in enumerate(range(0, stop, self.batch_size)):
            if k % workers == worker:
                yield self.plan.tensors(_gather(self.ds, starts, order[a : a + self.batch_size], self.plan))

    def _pieces(self, units: np.ndarray, drop_last: bool) -> Iterator[list[tuple[int, int, int]]]:
        """Each batch as ``(shard, start, end)`` pieces: the units in order, cut at ``batch_size``."""
        pieces: list[tuple[int, int, int]] = []
        rows = 0
        for s, a, e in units.tolist():
            while a < e:
                take = min(e - a, self.batch_size - rows)
                pieces.append((s, a, a + take))
                rows += take
                a += take
                if rows == self.batch_size:
                    yield pieces
                    pieces, rows = [], 0
        if pieces and not drop_last:
            yield pieces

    def _prefetch(self, pieces: list[tuple[int, int, int]]) -> None:
        """Ask the kernel to read the pieces' pages now (a no-op for pages in memory)."""
        if not self.prefetch:
            return
        for s, a, e in pieces:
            view = self.ds.view(s)
            for c in self.plan.columns:
                chunk = view.columns[c].chunks[0]
                if len(view.columns[c].chunks) == 1 and view.map is not None:
                    row = chunk.strides[0]
                    advise(view, mmap.MADV_WILLNEED, chunk.ctypes.data - view.map.ctypes.data + a * row, (e - a) * row)

    def _read(self, pieces: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        rows = sum(e - a for _, a, e in pieces)
        out = self.plan.empty(rows)
        at, o = [], 0
        for p in pieces:
            at.append(o)
            o += p[2] - p[1]
        for k in sorted(range(len(pieces)), key=lambda k: pieces[k]):  # in file order
            s, a, e = pieces[k]
            view = self.ds.view(s)
            for c in self.plan.columns:
                _copy_rows(view.columns[c], a, e, out[c][at[k] : at[k] + e - a], self.plan, c)
        return out

    def _prefetched(self, units: np.ndarray, drop_last: bool) -> Iterator[list[tuple[int, int, int]]]:
        """:meth:`_pieces`, each batch's pages requested ``READ_AHEAD`` batches before it is handed out."""
        batches = self._pieces(units, drop_last)
        ahead: deque[list[tuple[int, int, int]]] = deque()
        while True:
            while len(ahead) <= READ_AHEAD:
                following = next(batches, None)
                if following is None:
                    break
                self._prefetch(following)
                ahead.append(following)
            if not ahead:
                return
            yield ahead.popleft()

    def _units_in_batches(self, units: np.ndarray) -> Iterator[Batch]:
        for pieces in self._prefetched(units, self.drop_last):
            yield self.plan.tensors(self._read(pieces))

    def _buffered(self, units: np.ndarray, rng: np.random.Generator) -> Iterator[Batch]:
        k = self.batch_size
        fill = max(self.shuffle_buffer, k)
        buf = self.plan.empty(fill + k)
        n = 0
        for pieces in self._prefetched(units, False):  # k rows at a time, then draws until below ``fill``
            for s, a, e in pieces:
                view = self.ds.view(s)
                for c in self.plan.columns:
                    _copy_rows(view.columns[c], a, e, buf[c][n : n + e - a], self.plan, c)
                n += e - a
            while n >= fill:
                yield self.plan.tensors(self._draw(buf, n, k, rng))
                n -= k
        perm = rng.permutation(n)
        stop = n - n % k if self.drop_last else n
        for a in range(0, stop, k):
            yield self.plan.tensors({c: v[perm[a : a + k]] for c, v in buf.items()})

    @staticmethod
    def _draw(buf: dict[str, np.ndarray], n: int, k: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``k`` random rows of the first ``n``; the rows past ``n - k`` that were not drawn fill the holes."""
        pick = rng.choice(n, size=k, replace=False)
        out = {c: v[pick] for c, v in buf.items()}
        tail = n - k
        taken = np.zeros(k, dtype=bool)
        taken[pick[pick >= tail] - tail] = True
        holes = pick[pick < tail]
        survivors = np.arange(tail, n)[~taken]
        for v in buf.values():
            v[holes] = v[survivors]
        return out
