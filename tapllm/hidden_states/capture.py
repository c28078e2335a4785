"""One request's capture: its rows as they arrive, chunk by chunk, or on-device reducers.

Each step hands the request the rows of the positions ``[a, b)`` it captured, as one chunk per
point; the chunks are joined in position order when the request finishes. A high-water mark
(``next_pos``) records how far capture has got, so a request that is preempted and recomputed,
or whose prefix came from the cache, ends with exactly one row per position. A chunk is either
copied for the request (:meth:`RequestCapture.consume`: rows on the model's device, through the
step's copy sink) or is already a host tensor the step made for many requests at once
(:meth:`RequestCapture.take`: a graph step's capture buffer, copied back once; the request keeps
a view of its part).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields

import torch

from tapllm.hidden_states.lens import Lens, LensBuffers, LensFn, LensResult
from tapllm.hidden_states.reducers import Reducer, get_reducer
from tapllm.hidden_states.resolved import Selection
from tapllm.hidden_states.result import HiddenStates
from tapllm.hidden_states.sink import CopySink
from tapllm.hidden_states.spec import QUERY_HEAD_POINTS, HiddenStatesSpec
from tapllm.sae.features import FeatureBuffers
from tapllm.tap.points import EXPERT_POINTS

# Cuts ``n`` positions of a step's host block from number ``start`` into each point's rows
# ``[n, layers, *shape]`` (the graph step's record layout of one request).
RowViews = Callable[[torch.Tensor, int, int], dict[str, torch.Tensor]]


class RequestCapture:
    """One request's capture state: its chunks of rows, or on-device reducers (see the module docstring)."""

    def __init__(self, sel: Selection, spec: HiddenStatesSpec, device: torch.device,
                 lens_fn: LensFn | None = None, row_exact: bool = False) -> None:
        self.sel = sel
        self.spec_dict = spec.to_dict()
        self.device = device
        # where the result lives: the host, or the model's device (HiddenStatesSpec.device)
        self.out_device = torch.device(spec.device) if spec.device is not None else torch.device("cpu")
        self.next_pos = 0  # every position below this has been captured (or is not selected)
        self.last_pos = -1  # positions="last": the position held in the one-row buffer
        self.proj = spec.project.to(device) if spec.project is not None else None
        self.row_exact = row_exact  # batch_invariant: a row's projection must not depend on its chunk
        self.heads = torch.tensor(sel.heads, device=device) if sel.heads is not None else None
        self.experts = torch.tensor(sel.experts, device=device) if sel.experts is not None else None
        self.reducers: dict[str, Reducer] | None = None
        if sel.reduce and not sel.last_only:
            self.reducers = {p: self._new_reducer(p) for p in sel.points}
        # per point, (first position, rows [positions, layers, *shape]) in the order they arrived
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {p: [] for p in sel.points}
        self.lens: LensBuffers | None = None
        if sel.lens_k:
            if lens_fn is None:
                raise ValueError("hidden_states.lens: this model gives no lens function")
            layers = {p: len(sel.layer_keys(p)) for p in sel.points}
            self.lens = LensBuffers(sel.points, layers, sel.lens_k, spec.lens_targets, lens_fn, device)
        self.features = FeatureBuffers(sel.features, sel.last_only) if sel.features is not None else None
        # True when the request keeps its rows exactly as captured (no reduction, projection, lens, head
        # selection, other dtype or device), so a step's host copy of them can be handed over as is.
        self.takes_host_rows = (self.reducers is None and self.proj is None and self.lens is None
                                and self.heads is None and self.experts is None and self.out_device.type == "cpu"
                                and "attn_pattern" not in sel.points)
        # Steps' host blocks whose rows are this request's, not yet cut into views (:meth:`defer`).
        self.deferred: list[tuple[RowViews, torch.Tensor, int, int, int]] = []

    def _new_reducer(self, point: str) -> Reducer:
        r = get_reducer(self.sel.reduce)()
        r.start(len(self.sel.layer_keys(point)), math.prod(self.sel.shapes[point]), self.device)
        return r

    def first_needed(self, num_tokens: int) -> int:
        """The first position this request still has to run to capture what it asked for."""
        if self.sel.last_only:
            return num_tokens - 1
        pos = max(self.sel.lo, self.next_pos)
        return pos if pos < self.sel.hi else num_tokens

    def window(self, start: int, num_tokens: int) -> tuple[int, int] | None:
        """Positions ``[a, b)`` to capture from a chunk running ``[start, start + num_tokens)``."""
        end = start + num_tokens
        if self.sel.last_only:
            return (end - 1, end) if end - 1 >= max(self.sel.lo, self.next_pos) else None
        a, b = max(start, self.sel.lo, self.next_pos), min(end, self.sel.hi)
        return (a, b) if a < b else None

    def consume(self, point: str, rows: torch.Tensor, a: int, b: int, sink: CopySink) -> None:
        """Take the rows ``[b - a, layers, *shape]`` (device, model dtype) of positions ``[a, b)``.

        Per-head points arrive with every head, ``expert_out`` with every expert; the request's ``heads``
        and ``experts`` are kept here.
        An ``attn_pattern`` row holds the keys the step computed; the rest stay zero.
        """
        if self.lens is not None and self.reducers is None:  # a reduction's lens comes at the end
            self.lens.consume(point, rows[-1:] if self.sel.last_only else rows,
                              0 if self.sel.last_only else a - self.sel.lo)
        rows = self._select(point, rows)
        if self.proj is not None:
            rows = project(rows, self.proj, self.row_exact)
        if self.reducers is not None:
            if point == "attn_pattern" and rows.shape[-1] < self.sel.shapes[point][-1]:
                rows = torch.nn.functional.pad(rows, (0, self.sel.shapes[point][-1] - rows.shape[-1]))
            positions = torch.arange(a, b, device=rows.device)
            self.reducers[point].update(rows.float().reshape(*rows.shape[:2], -1), positions)
            return
        if self.sel.last_only:
            rows, a = rows[-1:], b - 1
        dest = torch.empty(rows.shape, dtype=self.sel.dtype, device=self.out_device)
        sink.write(dest, rows)
        self._keep(point, a, dest)

    def _select(self, point: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[n, layers, ...]`` with only the request's heads (per-head points) or experts (``expert_out``)."""
        if self.heads is not None and point in QUERY_HEAD_POINTS:
            return rows.index_select(2, self.heads)
        if self.experts is not None and point in EXPERT_POINTS:
            return rows.index_select(2, self.experts)
        return rows

    def fold_kind(self, point: str) -> str | None:
        """How a chunk of ``point`` may be folded to one row before it reaches :meth:`consume_folded` (its
        reducer's ``fold_kind``), or None: the request needs every row (no reduction, a projection, a lens,
        SAE features, or a reducer that does not fold)."""
        if (self.reducers is None or self.proj is not None or self.lens is not None or self.features is not None
                or point not in self.sel.points or point == "attn_pattern"):
            return None
        return getattr(self.reducers[point], "fold_kind", None)

    def consume_folded(self, point: str, row: torch.Tensor, a: int, b: int) -> None:
        """Take positions ``[a, b)`` of ``point`` folded (:meth:`fold_kind`) to one row ``[1, layers, *shape]``
        (every head and expert: the request's ``heads`` and ``experts`` are kept here)."""
        row = self._select(point, row)
        self.reducers[point].fold_in(row[0].float().reshape(row.shape[1], -1), b - a)

    def take(self, point: str, rows: torch.Tensor, a: int, b: int) -> None:
        """Keep host rows ``[b - a, layers, *shape]`` of positions ``[a, b)`` as they are (a view of a step's
        host buffer, filled by the time the engine reads results); only when :attr:`takes_host_rows`."""
        if self.sel.last_only:
            rows, a = rows[-1:], b - 1
        self._keep(point, a, rows if rows.dtype == self.sel.dtype else rows.to(self.sel.dtype))

    def defer(self, views: RowViews, host: torch.Tensor, start: int, a: int, b: int) -> None:
        """Keep positions ``[a, b)`` as they lie in a step's host block ``host`` from number ``start``;
        ``views(host, start, n)`` cuts them into each point's rows when the result is read (only when
        :attr:`takes_host_rows`). A decode step then costs a request one append, not a view per point.
        Records the positions as captured (:meth:`advance`)."""
        if self.sel.last_only:
            self.deferred = [(views, host, start, a, b)]
            self.last_pos = b - 1
        else:
            self.deferred.append((views, host, start, a, b))
        if b > self.next_pos:
            self.next_pos = b

    def _settle(self) -> None:
        """Cut the deferred host blocks into chunks (:meth:`defer`)."""
        deferred, self.deferred = self.deferred, []
        for views, host, start, a, b in deferred:
            for point, rows in views(host, start, b - a).items():
                self.take(point, rows, a, b)

    def _keep(self, point: str, a: int, rows: torch.Tensor) -> None:
        if self.deferred:  # rows an earlier graph step deferred go first (an eager step may follow one)
            self._settle()
        if self.sel.last_only:
            self.chunks[point] = [(a, rows)]
        else:
            self.chunks[point].append((a, rows))

    def _joined(self, point: str, n: int, positions: torch.Tensor) -> torch.Tensor:
        """The kept chunks of ``point`` as one ``[n, layers, *shape]`` tensor (its rows at ``positions``)."""
        sel = self.sel
        shape = (n, len(sel.layer_keys(point)), *sel.shapes[point])
        chunks = self.chunks[point]
        if point == "attn_pattern" and n:  # a chunk holds the keys its step had computed; the rest stay zero
            out = torch.zeros(shape, dtype=sel.dtype, device=self.out_device)
            first = int(positions[0])
            for a, rows in chunks:
                out[a - first : a - first + rows.shape[0], ..., : rows.shape[-1]] = rows
            return out
        if not chunks:
            return torch.empty(shape, dtype=sel.dtype, device=self.out_device)
        out = torch.cat([rows for _, rows in chunks]) if len(chunks) > 1 else chunks[0][1]
        if out.shape[0] != n:
            raise RuntimeError(f"hidden_states: {out.shape[0]} rows of {point!r} were captured for {n} positions")
        return out

    def advance(self, a: int, b: int) -> None:
        """Record that positions ``[a, b)`` were captured this step."""
        self.next_pos = max(self.next_pos, b)
        if self.sel.last_only:
            self.last_pos = b - 1

    def fork(self) -> RequestCapture:
        """An independent copy of this capture's state (chunks, reducers, lens), for another sample
        that continues from the same positions: what was captured so far is captured once, and copied.

        Read-only parts (the projection, head indices, the model's lens function) stay shared.
        """
        self._settle()
        shared = [self.sel, self.sel.features, self.proj, self.heads, self.experts, self.device]  # the device SAE: shared
        if self.lens is not None:
            shared += [self.lens.fn, self.lens.targets]
        memo = {id(obj): obj for obj in shared if obj is not None}
        return copy.deepcopy(self, memo)

    def result(self) -> HiddenStates:
        """The request's ``HiddenStates`` (call once it has finished)."""
        self._settle()
        sel = self.sel
        if sel.last_only:
            positions = torch.tensor([self.last_pos] if self.last_pos >= 0 else [], dtype=torch.long)
            n = len(positions)
        else:
            n = max(0, self.next_pos - sel.lo)
            positions = torch.arange(sel.lo, sel.lo + n, dtype=torch.long)
        tensors: dict[str, torch.Tensor] = {}
        reduced: dict[str, torch.Tensor] = {}
        for point in sel.points:
            layers, shape = len(sel.layer_keys(point)), sel.shapes[point]
            if self.reducers is not None:
                out = reduced[point] = self.reducers[point].finish()
            elif sel.reduce:  # positions="last" with a reduction: reduce the one kept row
                r = self._new_reducer(point)
                if n:
                    r.update(self._joined(point, n, positions).float().reshape(n, layers, -1), positions)
                out = reduced[point] = r.finish()
            else:
                out = self._joined(point, n, positions)
            if sel.reduce and out.dim() == 2 and len(shape) > 1:  # [layers, prod(shape)] -> [layers, *shape]
                out = out.reshape(layers, *shape)
            if point == "attn_pattern" and not sel.reduce:  # keys 0..last captured position
                out = out[..., : int(positions[-1]) + 1 if n else 0]
            tensors[point] = out.to(self.out_device, sel.dtype).contiguous()
        lens = None
        if self.lens is not None:
            lens = self.lens.of_reduced(reduced) if sel.reduce else self.lens.result(n)
        features = self.features.result(positions) if self.features is not None else None
        if lens is not None:
            lens = Lens({p: LensResult(*(_ordinary(getattr(r, f.name)) for f in fields(r))) for p, r in lens.items()},
                        lens.targets)
        if features is not None:
            for name in ("positions", "error_norm", "ids", "values", "dense"):
                setattr(features, name, _ordinary(getattr(features, name)))
        return HiddenStates({p: _ordinary(t) for p, t in tensors.items()}, _ordinary(positions), list(sel.layers),
                            sel.reduce, self.spec_dict, lens=lens, features=features)


def _ordinary(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as an ordinary tensor, one autograd can save (a probe trains on it), for the results leaving the
    engine. The engine enters ``torch.inference_mode`` only to launch a step and makes every buffer a result
    comes from outside it, so this copies nothing unless the caller ran the engine inside inference mode."""
    if t is None or not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


_PROJECT_BLOCK = 64  # rows a row-exact projection computes at once (padded): one shape for every call


def project(rows: torch.Tensor, directions: torch.Tensor, row_exact: bool) -> torch.Tensor:
    """``rows [..., hidden]`` (float32) times ``directions [k, hidden]`` transposed: ``[..., k]``.

    ``row_exact``: a row's result does not depend on how many rows came with it (a GEMM's does, and so
    does a reduction whose split a library picks from the number of rows, as PyTorch's GPU one does):
    rows go in zero-padded blocks of 64, one direction at a time as a product and a sum over
    ``hidden``, so every reduction has the same shape whatever the step; costs ``k`` passes per block.
    """
    x = rows.float()
    if not row_exact:
        return x @ directions.T
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    padded = torch.nn.functional.pad(flat, (0, 0, 0, -n % _PROJECT_BLOCK))
    out = [torch.stack([(block * d).sum(-1) for d in directions.float()], dim=-1)
           for block in padded.split(_PROJECT_BLOCK)]
    done = torch.cat(out) if out else padded.new_zeros(0, directions.shape[0])
    return done[:n].reshape(*x.shape[:-1], directions.shape[0])


def defer_rows(rows: Iterable[tuple[RequestCapture, RowViews, int, int]], host: torch.Tensor,
               pos: Sequence[int]) -> None:
    """:meth:`RequestCapture.defer` of one position for each ``(capture, views, start, row)`` of a decode
    step (position ``pos[row]``), in one loop: a decode step makes it for every such request."""
    for cap, views, start, r in rows:
        a = pos[r]
        if cap.sel.last_only:
            cap.deferred = [(views, host, start, a, a + 1)]
            cap.last_pos = a
        else:
            cap.deferred.append((views, host, start, a, a + 1))
        if a >= cap.next_pos:
            cap.next_pos = a + 1


def take_features_rows(caps: Iterable[RequestCapture], pack: torch.Tensor, columns: Iterable[dict],
                       rows: Iterable[int], pos: Sequence[int]) -> None:
    """Each capture keeps its row (the first capture row 0, and so on) of a decode step's SAE pack as the
    features of its one position ``pos[row]`` (:meth:`tapllm.sae.features.FeatureBuffers.take`), and records
    the position as captured; in one loop, as :func:`defer_rows`."""
    for i, (cap, cols, r) in enumerate(zip(caps, columns, rows)):
        a = pos[r]
        if cap.sel.last_only:
            cap.features.take(pack, i, cols, a, a + 1)
            cap.last_pos = a
        else:  # FeatureBuffers.take of one row, inlined
            cap.features.chunks.append((a, pack, i, 1, cols))
        if a >= cap.next_pos:
            cap.next_pos = a + 1
