"""Streaming reductions over positions: the protocol, the built-ins, and plugin discovery.

A reducer sees a request's selected rows chunk by chunk, in increasing position order, on
the device the model runs on, and keeps only its running state there::

    r = factory()                       # a fresh reducer per request and point
    r.start(num_layers, width, device)
    r.update(rows, positions)           # rows: float32 [n, num_layers, width]; positions: int64 [n]
    ...                                 # once per chunk; a chunk never repeats a position
    result = r.finish()                 # a tensor whose first dimension is num_layers

A reducer may also take a chunk already folded to one row (tensor parallelism folds each rank's
part of a chunk before the ranks' parts are gathered, so only that row moves): its ``fold_kind``
(``"sum"``, ``"max"``, ``"min"``, ``"first"`` or ``"last"``) says how a chunk folds, and
``fold_in(row, count)`` takes the folded ``[num_layers, width]`` row of ``count`` positions. The
built-ins all have both; a reducer without them gets every row.

``finish`` may come without any ``update`` when the selection turned out empty (a request
that stopped at its first generated token has no generated positions); the built-ins then
return NaN.

How the prompt was chunked must not change the result: a reducer may not assume a chunk holds
the whole prompt, or that chunks have any particular size. The built-ins give the same bits
however the rows were chunked (sums add fixed blocks of rows in arrival order), which
``batch_invariant`` relies on.

Plugins are found through the entry-point group ``tapllm.reducers``; the entry point's name
is the reducer's name and its object is the factory (usually the class). In code, use
``register_reducer(name, factory)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

import torch

logger = logging.getLogger("tapllm")

ENTRY_POINT_GROUP = "tapllm.reducers"


@runtime_checkable
class Reducer(Protocol):
    """The streaming reducer protocol (see the module docstring)."""

    def start(self, num_layers: int, width: int, device: torch.device) -> None:
        """Prepare state for ``[num_layers, width]`` rows on ``device``."""

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Fold in a chunk: ``rows`` float32 ``[n, num_layers, width]``, ``positions`` int64 ``[n]``."""

    def finish(self) -> torch.Tensor:
        """The result, first dimension ``num_layers``."""


ReducerFactory = Callable[[], Reducer]


class _Fold:
    """Shared state handling of the built-ins: a running ``[layers, width]`` float32 tensor."""

    def start(self, num_layers: int, width: int, device: torch.device) -> None:
        self.acc: torch.Tensor | None = None
        self.empty = (num_layers, width, device)

    def finish(self) -> torch.Tensor:
        if self.acc is None:  # nothing was selected (e.g. EOS came first): NaN, as numpy's mean of nothing
            layers, width, device = self.empty
            return torch.full((layers, width), float("nan"), device=device)
        return self.acc


_SUM_BLOCK = 64  # rows a sum adds at once


class SumReducer(_Fold):
    """Sum over positions (float32 accumulation).

    The rows are summed in blocks of 64 in arrival order, each block's sum added to the running
    total, so the result is the same bits however the rows came chunked (a sum over each chunk would
    depend on where the chunks start).
    """

    def start(self, num_layers: int, width: int, device: torch.device) -> None:
        super().start(num_layers, width, device)
        # The block being filled, copied: a step's rows may be views of buffers the next step reuses
        # (a CUDA graph's outputs), so none is kept past ``update``.
        self.block: torch.Tensor | None = None
        self.pending_rows = 0

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        i = 0
        while i < rows.shape[0]:
            if self.block is None:
                self.block = rows.new_empty((_SUM_BLOCK, *rows.shape[1:]))
            take = min(_SUM_BLOCK - self.pending_rows, rows.shape[0] - i)
            self.block[self.pending_rows : self.pending_rows + take].copy_(rows[i : i + take])
            self.pending_rows += take
            i += take
            if self.pending_rows == _SUM_BLOCK:
                self._fold()

    fold_kind = "sum"

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        """Add a chunk's sum ``[num_layers, width]`` (after the rows pending in a block)."""
        if self.pending_rows:
            self._fold()
        self.acc = row.clone() if self.acc is None else self.acc.add_(row)

    def _fold(self) -> None:
        s = self.block[: self.pending_rows].sum(0)  # one block of one shape: its sum does not depend on the chunks
        self.acc = s if self.acc is None else self.acc.add_(s)
        self.pending_rows = 0

    def finish(self) -> torch.Tensor:
        if self.pending_rows:
            self._fold()
        return super().finish()


class MeanReducer(SumReducer):
    """Mean over positions: a float32 sum and a count, divided at the end."""

    def start(self, num_layers: int, width: int, device: torch.device) -> None:
        super().start(num_layers, width, device)
        self.count = 0

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        super().update(rows, positions)
        self.count += rows.shape[0]

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        super().fold_in(row, count)
        self.count += count

    def finish(self) -> torch.Tensor:
        return super().finish() / self.count


class MaxReducer(_Fold):
    """Element-wise maximum over positions."""

    fold_kind = "max"

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        m = rows.amax(0)
        self.acc = m if self.acc is None else torch.maximum(self.acc, m)

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        self.acc = row.clone() if self.acc is None else torch.maximum(self.acc, row)


class MinReducer(_Fold):
    """Element-wise minimum over positions."""

    fold_kind = "min"

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        m = rows.amin(0)
        self.acc = m if self.acc is None else torch.minimum(self.acc, m)

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        self.acc = row.clone() if self.acc is None else torch.minimum(self.acc, row)


class FirstReducer(_Fold):
    """The row of the first selected position."""

    fold_kind = "first"

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        if self.acc is None:
            self.acc = rows[0].clone()

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        if self.acc is None:
            self.acc = row.clone()


class LastReducer(_Fold):
    """The row of the last selected position."""

    fold_kind = "last"

    def update(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        self.acc = rows[-1].clone()

    def fold_in(self, row: torch.Tensor, count: int) -> None:
        self.acc = row.clone()


BUILTIN_REDUCERS: dict[str, ReducerFactory] = {
    "mean": MeanReducer,
    "sum": SumReducer,
    "max": MaxReducer,
    "min": MinReducer,
    "first": FirstReducer,
    "last": LastReducer,
}
_registered: dict[str, ReducerFactory] = {}


def register_reducer(name: str, factory: ReducerFactory) -> None:
    """Make ``factory`` available as ``HiddenStatesSpec(reduce=name)`` in this process."""
    if not name or not isinstance(name, str):
        raise ValueError(f"reducer name must be a non-empty string, got {name!r}")
    if name in BUILTIN_REDUCERS:
        raise ValueError(f"reducer name {name!r} is taken by a built-in reducer")
    if not callable(factory):
        raise ValueError(f"reducer {name!r}: the factory must be callable")
    _registered[name] = factory


def _plugins() -> dict[str, object]:
    # Scanned on each lookup (cheap: only at request admission) so packages installed
    # after import are found too.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_reducers() -> list[str]:
    """Names of built-in, registered and installed plugin reducers."""
    return sorted({*BUILTIN_REDUCERS, *_registered, *_plugins()})


def get_reducer(name: str) -> ReducerFactory:
    """The factory for ``name``; raises ``ValueError`` naming the known reducers."""
    if name in BUILTIN_REDUCERS:
        return BUILTIN_REDUCERS[name]
    if name in _registered:
        return _registered[name]
    ep = _plugins().get(name)
    if ep is None:
        raise ValueError(f"hidden_states.reduce: unknown reducer {name!r}; available: {available_reducers()}")
    try:
        factory = ep.load()
    except Exception as exc:  # a broken plugin must not take the engine down
        raise ValueError(f"hidden_states.reduce: plugin {name!r} ({ep.value}) failed to load: {exc}") from exc
    if not callable(factory):
        raise ValueError(f"hidden_states.reduce: plugin {name!r} ({ep.value}) is not callable")
    _registered[name] = factory
    return factory
