"""Taps on a sharded model: a point keeps the meaning it has on one device.

Residual-stream points are whole on every rank (after the all-reduce), so the step's tap runs
there as it would on one device: steering identically on every rank, capture on rank 0. A
sharded point (``q``, ``k``, ``v``, ``z`` by head, ``mlp_post`` by neuron) that some request of
the step steers or captures is gathered from the ranks into the whole tensor, the step's tap
runs on that, and each rank keeps its own part of the result; points nobody asked for are never
gathered. A point captured only by requests whose reductions fold (a mean, a max, ...: see
:meth:`~tapllm.hidden_states.plan.CapturePlan.fold`) is folded on each rank first, so one row per
request moves, not one per position. Attention patterns are computed on rank 0 from the gathered queries and key cache.

Rank 0 runs the engine's tap inside :class:`ShardTap`; the other ranks run :class:`StepSteering`
(the same steering operations, no capture). Operations that cannot travel to the other ranks (an SAE
edit holds its SAE) run on rank 0, which then broadcasts the point's steered tensor. An error raised by the inner tap (a request's capture
failing) is held until the forward ends, so no rank leaves the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tapllm.hidden_states.plan import Folds, record_folded
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layout import ShardLayout
from tapllm.tap import Tap

# Sharded points and the dim of their tensor that the ranks split.
SHARDED_DIMS: dict[str, int] = {"q": 1, "k": 1, "v": 1, "z": 1, "mlp_post": -1}
_KV_POINTS = ("k", "v")


class StepSteering:
    """A non-zero rank's tap: the step's steering operations, per (point, layer), and nothing else."""

    def __init__(self, ops: Mapping[tuple[str, int], list[Any]], pattern_layers: Iterable[int] = ()) -> None:
        self.ops = dict(ops)
        self.pattern_layers = frozenset(pattern_layers)
        self.layers = {layer for _, layer in self.ops}

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        for op in self.ops.get((point, layer), ()):
            op.apply(x)
        return x

    def steers(self, point: str, layer: int) -> bool:
        return bool(self.ops.get((point, layer)))

    def touches(self, layer: int) -> bool:
        return layer in self.layers or layer in self.pattern_layers

    def wants(self, point: str, layer: int) -> bool:
        return bool(self.ops.get((point, layer)))

    def wants_pattern(self, layer: int) -> bool:
        return layer in self.pattern_layers

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None:
        return None


class ShardTap:
    """Wraps a step's tap for a sharded model (see the module docstring).

    ``gathered``: the (point, layer) pairs of sharded points some request steers or captures this
    step, each with the batch rows those requests own there (``None``: every row), the same on every
    rank: only those rows are gathered, the tap sees the whole point on them (other rows zero) and
    only they are written back; ``from_rank0``: the points steered by operations that only rank 0
    holds (an SAE edit, which holds its SAE): rank 0 applies them and broadcasts the result;
    ``layers``: the blocks any request touches (the same on every rank as well, so every rank's model
    takes the same path).
    """

    def __init__(self, inner: Tap, layout: ShardLayout, group: TPGroup,
                 gathered: Mapping[tuple[str, int], torch.Tensor | None], layers: Iterable[int],
                 pattern_layers: Iterable[int], from_rank0: Iterable[tuple[str, int]] = (),
                 folded: Mapping[tuple[str, int], Folds] | None = None,
                 heads: Mapping[tuple[str, int], tuple[int, ...]] | None = None) -> None:
        self.inner, self.layout, self.group = inner, layout, group
        self.gathered = dict(gathered)
        self.folded = dict(folded or {})
        self.heads = dict(heads or {})
        self.from_rank0 = frozenset(from_rank0)
        self.layers = frozenset(layers) | frozenset(pattern_layers)
        self.pattern_layers = frozenset(pattern_layers)
        self.error: BaseException | None = None  # the first error of the inner tap, raised after the forward

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        key = (point, layer)
        if key in self.folded:  # captured only, by reductions that fold: each rank folds its part, then gathers
            self._record_folded(key, self.gather(point, self.folded[key].apply(x)))
            return x
        sharded = point in SHARDED_DIMS and key in self.gathered
        rows = self.gathered.get(key) if sharded else None
        if key in self.heads:  # captured only, of some query heads: those are gathered, nothing is written back
            self._run(point, layer, self.gather_heads(x, rows, self.heads[key]))
            return x
        y = self._run(point, layer, self.gather(point, x, rows) if sharded else x)
        if key in self.from_rank0:  # steered by operations only rank 0 holds: its result for all
            y = self.group.broadcast(y, src=0)
        if not sharded:
            return y
        mine = self.local(point, y)
        if rows is None:
            x.copy_(mine)
        else:
            x.index_copy_(0, rows, mine.index_select(0, rows))
        return x

    def _run(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:  # the step fails anyway; the forward goes on only to keep the ranks together
            return x
        try:
            return self.inner(point, layer, x)
        except Exception as exc:  # noqa: BLE001 - raised again by raise_held(), after the last collective
            self.error = exc
            return x

    def _record_folded(self, key: tuple[str, int], whole: torch.Tensor) -> None:
        targets = getattr(self.inner, "targets", None)  # rank 0's step tap; the other ranks record nothing
        if not targets or self.error is not None:
            return
        try:
            record_folded(targets[key][1], whole)
        except Exception as exc:  # noqa: BLE001 - see _run
            self.error = exc

    def raise_held(self) -> None:
        """Raise the inner tap's error, if it raised during the forward."""
        if self.error is not None:
            raise self.error

    # ---- gathering a sharded point ---------------------------------------------------------
    def gather(self, point: str, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The whole point from every rank's part (KV heads held by several ranks kept once); with
        ``rows``, only those rows are gathered and the others are zero."""
        dim = SHARDED_DIMS[point]
        whole = self.group.all_gather(x if rows is None else x.index_select(0, rows), dim, self.sizes(point))
        if point in _KV_POINTS and self.layout.kv_replicas > 1:
            n = x.shape[dim]
            whole = torch.cat([whole.narrow(dim, r * n, n) for r in self.layout.kv_owner_ranks()], dim=dim)
        if rows is None:
            return whole
        full = whole.new_zeros((x.shape[0], *whole.shape[1:]))
        return full.index_copy_(0, rows, whole)

    def gather_heads(self, x: torch.Tensor, rows: torch.Tensor | None, heads: tuple[int, ...]) -> torch.Tensor:
        """The whole ``q`` or ``z`` (``[T, heads, head_dim]``) with only query ``heads`` (sorted) gathered from
        the ranks that hold them, on ``rows`` (None: every row); every other head and row is zero."""
        lay = self.layout
        counts = lay.head_counts
        starts = [sum(counts[:r]) for r in range(lay.size)]
        per_rank = [sum(1 for h in heads if s <= h < s + c) for s, c in zip(starts, counts, strict=True)]
        mine = torch.tensor([h - lay.head_start for h in heads if lay.head_start <= h < lay.head_start + lay.heads],
                            dtype=torch.long)
        part = (x if rows is None else x.index_select(0, rows)).index_select(1, mine)
        got = self.group.all_gather(part, 1, per_rank if len(set(per_rank)) > 1 else None)
        asked = x.new_zeros((got.shape[0], lay.num_heads, *x.shape[2:])).index_copy_(
            1, torch.tensor(heads, dtype=torch.long), got)
        if rows is None:
            return asked
        return x.new_zeros((x.shape[0], *asked.shape[1:])).index_copy_(0, rows, asked)

    def sizes(self, point: str) -> list[int] | None:
        """Every rank's length of ``point`` along its split dim where the split is uneven (None: even)."""
        lay = self.layout
        counts = {"q": lay.head_counts, "z": lay.head_counts, "k": lay.kv_head_counts, "v": lay.kv_head_counts,
                  "mlp_post": lay.neuron_counts}[point]
        return counts if len(set(counts)) > 1 else None

    def local(self, point: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole point."""
        lay = self.layout
        if point in ("q", "z"):
            return whole.narrow(1, lay.head_start, lay.heads)
        if point in _KV_POINTS:
            return whole.narrow(1, lay.kv_head_start, lay.kv_heads)
        return whole.narrow(-1, lay.neuron_start, lay.neurons)

    # ---- the rest of the Tap protocol ------------------------------------------------------
    def steers(self, point: str, layer: int) -> bool:
        # Every rank alike: a point rank 0 alone steers is steered on the others too (by the broadcast).
        return (point, layer) in self.from_rank0 or self.inner.steers(point, layer)

    def touches(self, layer: int) -> bool:
        return layer in self.layers

    def wants(self, point: str, layer: int) -> bool:
        # Every rank alike (each takes the same path): any block some request touches.
        return layer in self.layers

    def wants_pattern(self, layer: int) -> bool:
        return layer in self.pattern_layers

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None:
        """Gather the queries and this layer's key cache (every rank), then let rank 0's tap compute."""
        q_all = self.gather("q", q)
        k_all = self.gather("k", k_cache.transpose(0, 1)).transpose(0, 1)  # the cache is [kv_heads, blocks, ...]
        self.inner_pattern(layer, q_all, k_all, opts)

    # ---- what another pipeline stage relays to rank 0 (tapllm.parallel.relay) ----------------
    def run_inner(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The step's tap on a whole point (an error held until the forward ends)."""
        return self._run(point, layer, x)

    def inner_pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None:
        """The step's attention patterns from whole queries and key cache (an error held)."""
        if self.error is None:
            try:
                self.inner.pattern(layer, q, k_cache, opts)
            except Exception as exc:  # noqa: BLE001 - see _run
                self.error = exc
