"""The per-step capture plan: which batch rows to record at which (point, layer).

Built from the step's row spans, each with its request's capture and KV block table; each
capture's ``window`` says which of its positions this step captures. The step's tap calls
:func:`record_at` at each named point (after steering); per point it gathers the rows of
every request that wants that point into one step tensor (on the model's device), one layer
slot per call. After the forward, ``finish``
hands each request its slice (projection, reduction and the copy to CPU happen there) and
advances its high-water mark. A step without capturing requests builds no plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.sink import CopySink
from tapllm.layers.attention import AttentionOptions, attention_probs, gather_keys
from tapllm.sae.batch import FeatureBatch, gather_each
from tapllm.tap import RowSpan, rows_tensor


@dataclass(slots=True)
class CaptureEntry:
    """Capture positions ``[a, b)`` of ``capture``'s request, found at batch rows ``row..row + b - a``."""

    capture: RequestCapture
    row: int
    a: int
    b: int
    block_table: list[int] = field(default_factory=list)  # the request's KV blocks (for attention patterns)


@dataclass(slots=True)
class _PatternPlan:
    """One entry's attention patterns: filled layer by layer during the forward, delivered at ``finish``."""

    entry: CaptureEntry
    slots: dict[int, int]  # block -> its slot in the entry's own layers
    stage: torch.Tensor | None = None  # [b - a, layers, heads, b] float32


@dataclass(slots=True)
class _PointPlan:
    point: str
    keys: list[int]  # union of the layer keys wanted, in recording order
    entries: list[tuple[CaptureEntry, int, torch.Tensor | None]]  # (entry, stage offset, layer subset)
    rows: slice | torch.Tensor  # batch rows gathered into the stage
    num_rows: int
    stage: torch.Tensor | None = field(default=None)
    folds: Folds | None = None  # each entry's chunk folded to one row (CapturePlan.fold): the stage holds those


@dataclass(frozen=True, slots=True)
class Folds:
    """Each entry's rows ``[row, row + n)`` of a step, and how they fold to one row (``fold_kind``)."""

    spans: tuple[tuple[int, int], ...]
    kinds: tuple[str, ...]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """``[len(spans), *t.shape[1:]]`` float32: each span of ``t``'s rows folded to one."""
        out = torch.empty((len(self.spans), *t.shape[1:]), dtype=torch.float32, device=t.device)
        for i, ((row, n), kind) in enumerate(zip(self.spans, self.kinds, strict=True)):
            rows = t[row : row + n].float()
            if kind == "sum":
                out[i] = rows.sum(0)
            elif kind == "max":
                out[i] = rows.amax(0)
            elif kind == "min":
                out[i] = rows.amin(0)
            else:
                out[i] = rows[0 if kind == "first" else -1]
        return out


Target = tuple[_PointPlan, int]  # the point's stage, and the layer's slot in it


class CapturePlan:
    """Rows and points to record in one step (see the module docstring)."""

    def __init__(self, spans: Sequence[tuple[RowSpan, RequestCapture, list[int]]], device: torch.device,
                 sink: CopySink, *, sae_kernel: bool = False) -> None:
        entries = []
        for span, capture, block_table in spans:
            window = capture.window(span.start, span.num_tokens)
            if window is not None:
                entries.append(CaptureEntry(capture, span.row + window[0] - span.start, *window,
                                            block_table=block_table))
        self.entries = entries
        self.sink = sink
        self.patterns: dict[int, list[_PatternPlan]] = {}  # block -> the entries wanting its pattern
        self._pattern_plans: list[_PatternPlan] = []
        by_point: dict[str, list[CaptureEntry]] = {}
        for e in entries:
            for point in e.capture.sel.tap_points():
                if point == "attn_pattern":
                    layers = e.capture.sel.layer_keys(point)
                    pp_ = _PatternPlan(e, {k: i for i, k in enumerate(layers)})
                    self._pattern_plans.append(pp_)
                    for k in layers:
                        self.patterns.setdefault(k, []).append(pp_)
                    continue
                by_point.setdefault(point, []).append(e)
        self.targets: dict[tuple[str, int], Target] = {}
        self.points: list[_PointPlan] = []
        self._placed: dict[tuple[str, int], tuple[int, dict[int, int]]] = {}  # (point, entry) -> offset, slots
        self._stages: dict[str, _PointPlan] = {}
        self.features = FeatureBatch(entries, kernel=sae_kernel)
        for point, es in by_point.items():
            keys = sorted({k for e in es for k in e.capture.sel.tap_keys(point)})
            slot = {k: i for i, k in enumerate(keys)}
            placed = []
            offset = 0
            for e in es:
                own = e.capture.sel.layer_keys(point) if point in e.capture.sel.points else None  # None: SAE input only
                subset = None if own is None or list(own) == keys else rows_tensor([slot[k] for k in own], device)
                placed.append((e, offset, subset))
                self._placed[(point, id(e))] = (offset, slot)
                offset += e.b - e.a
            pp = _PointPlan(point, keys, placed, _rows(es, device), offset)
            self.points.append(pp)
            self._stages[point] = pp
            for k, i in slot.items():
                self.targets[(point, k)] = (pp, i)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def fold(self, points: Iterable[str]) -> dict[str, Folds]:
        """Fold each of ``points`` whose every entry's request reduces it with a reducer that folds
        (:meth:`RequestCapture.fold_kind`): from now on its stage holds one row per entry, the entry's chunk
        folded (:func:`record_folded` takes rows folded elsewhere, :func:`record_at` folds whole ones).
        Returns the points folded. Called before the forward records anything."""
        out = {}
        for pp in self.points:
            if pp.point not in points or pp.stage is not None:
                continue
            kinds = [e.capture.fold_kind(pp.point) for e, _, _ in pp.entries]
            if None in kinds:
                continue
            pp.folds = Folds(tuple((e.row, e.b - e.a) for e, _, _ in pp.entries), tuple(kinds))
            pp.num_rows = len(pp.entries)
            out[pp.point] = pp.folds
        return out

    def wants_pattern(self, layer: int) -> bool:
        """True when some entry captures block ``layer``'s attention pattern."""
        return layer in self.patterns

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: AttentionOptions) -> None:
        """Attention patterns of block ``layer`` for the entries that want them (after the layer's attention).

        ``q`` ``[T, heads, head_dim]`` are the step's queries, ``k_cache`` the layer's key
        cache, holding every key up to this step's positions.
        """
        for pp in self.patterns.get(layer, ()):
            e = pp.entry
            n = e.b - e.a
            keys = gather_keys(k_cache, e.block_table, e.b)  # [Hkv, b, D]
            rows = q[e.row : e.row + n]
            probs = attention_probs(rows, keys, e.a, opts)  # [n, heads, b]
            if pp.stage is None:
                pp.stage = probs.new_zeros((n, len(pp.slots), *probs.shape[1:]))
            pp.stage[:, pp.slots[layer]] = probs

    def finish(self) -> dict[RequestCapture, str]:
        """Deliver each request's rows, then mark their positions captured.

        A request whose delivery raises (e.g. its reducer plugin) is left out and returned
        with the error; the other requests' rows are delivered as usual.
        """
        self.sink.settle()  # the previous step's rows reach their buffers before any buffer is touched
        for pp in self.points:
            if pp.stage is None:
                raise RuntimeError(f"the model never recorded point {pp.point!r}")
        for pat in self._pattern_plans:
            if pat.stage is None:
                raise RuntimeError("the model never computed an attention pattern")
        failed: dict[RequestCapture, str] = {}
        for pat in self._pattern_plans:
            e = pat.entry
            try:
                e.capture.consume("attn_pattern", pat.stage, e.a, e.b, self.sink)
            except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                failed[e.capture] = f"hidden_states: capturing 'attn_pattern' failed: {type(exc).__name__}: {exc}"
        for pp in self.points:
            for i, (e, offset, subset) in enumerate(pp.entries):
                if e.capture in failed or pp.point not in e.capture.sel.points:
                    continue
                rows = pp.stage[offset : offset + e.b - e.a] if pp.folds is None else pp.stage[i : i + 1]
                if subset is not None:
                    rows = rows.index_select(1, subset)
                try:
                    if pp.folds is None:
                        e.capture.consume(pp.point, rows, e.a, e.b, self.sink)
                    else:
                        e.capture.consume_folded(pp.point, rows, e.a, e.b)
                except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                    failed[e.capture] = f"hidden_states: capturing {pp.point!r} failed: {type(exc).__name__}: {exc}"
        if self.features:
            failed.update(self.features.run(gather_each(self._rows_of), self.sink, failed))
        self.sink.flush()
        for e in self.entries:
            if e.capture not in failed:
                e.capture.advance(e.a, e.b)
        return failed

    def _rows_of(self, entry: CaptureEntry, point: str, key: int) -> torch.Tensor:
        """``entry``'s recorded rows of ``point`` at layer ``key``: ``[b - a, *shape]`` on the device."""
        offset, slot = self._placed[(point, id(entry))]
        return self._stages[point].stage[offset : offset + entry.b - entry.a, slot[key]]


def record_at(target: Target, t: torch.Tensor) -> None:
    """Copy the planned rows of ``t`` into ``target``'s slot of its point's stage tensor (a folded point's
    rows folded first)."""
    pp, slot = target
    if pp.folds is not None:
        record_folded(target, pp.folds.apply(t))
        return
    if pp.stage is None:
        pp.stage = t.new_empty((pp.num_rows, len(pp.keys), *t.shape[1:]))
    src = t[pp.rows] if isinstance(pp.rows, slice) else t.index_select(0, pp.rows)
    pp.stage[:, slot].copy_(src)


def record_folded(target: Target, folded: torch.Tensor) -> None:
    """Copy a folded point's rows ``[entries, *shape]`` (:meth:`Folds.apply` of the step's rows) into
    ``target``'s slot."""
    pp, slot = target
    if pp.stage is None:
        pp.stage = folded.new_empty((pp.num_rows, len(pp.keys), *folded.shape[1:]))
    pp.stage[:, slot].copy_(folded)


def _rows(entries: list[CaptureEntry], device: torch.device) -> slice | torch.Tensor:
    """The batch rows of ``entries``: a slice when they are contiguous, else an index."""
    contiguous = all(x.row + x.b - x.a == y.row for x, y in zip(entries, entries[1:]))
    if contiguous:
        first, last = entries[0], entries[-1]
        return slice(first.row, last.row + last.b - last.a)
    idx = [r for e in entries for r in range(e.row, e.row + e.b - e.a)]
    return rows_tensor(idx, device)
