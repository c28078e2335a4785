"""Steps run from CUDA graphs: each running request's slot tables, the step's inputs, the replay, its captures.

A request that captures or steers writes its slot's rows of the tap tables when it first runs in
its slot (again after a preemption, when its capture resumes elsewhere) and clears them when it
leaves (:meth:`GraphStep.release`); a step then only says which slot and position each row has.
What a table cannot hold (attention patterns, SAE feature edits, operands past the tables' size)
is remembered per request, and the steps holding it run eagerly with that reason.

After a replay, :meth:`GraphStep.deliver` hands each capturing request its rows: the host worked
out, from its mirror of the tables, where every captured row went in the capture buffer; the part
used is copied to the host once, and a request that keeps its rows as captured takes a view of
its block of it. A request that reduces, projects, selects heads or reads the lens takes its block
on the device and goes through its usual consumer. SAE features are computed for every request of
an SAE at once, from their blocks on the device, and come back in one copy per SAE
(:class:`tapllm.sae.batch.FeatureBatch`, with the fused kernel where it applies).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tapllm.backends.policy import GraphKey, GraphSizes, StepShape
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.cuda_graphs import GraphOutputs, GraphRunner
from tapllm.engine.graph_decode import FAR, DecodePlan, How, SteadyPlacement, decode_plan, deliver_groups, rows_at
from tapllm.engine.graph_memory import OPS_PER_SEQ, POOL_ROWS_PER_SEQ, capture_numbers
from tapllm.engine.graph_sampler import SlotSampling
from tapllm.engine.input_buffers import InputBuffers
from tapllm.engine.request import Request
from tapllm.engine.slot_taps import RecordLayout, slot_capture, slot_ops
from tapllm.engine.step_inputs import StepLayout
from tapllm.hidden_states.capture import RequestCapture, RowViews, defer_rows
from tapllm.hidden_states.sink import CopySink
from tapllm.sae.batch import FeatureBatch, PackLayouts
from tapllm.sae.features import FeatureSelection
from tapllm.tap.points import BY_NAME
from tapllm.tap.sites import Sites
from tapllm.tap.tables import TapTables

logger = logging.getLogger("tapllm")


@dataclass(slots=True)
class _Joined:
    request: Request
    slot: int
    preemptions: int
    layout: RecordLayout | None = None
    blocked: str | None = None
    delivery: How | None = None  # GraphStep._delivery, made once


@dataclass(slots=True)
class _Delivery:
    """One request's block of a step's capture buffer: positions ``[a, b)`` at numbers ``[start, start + n*rec)``."""

    capture: RequestCapture
    layout: RecordLayout
    a: int
    b: int
    start: int
    features: bool = False


class GraphStep:
    """The graph path of the model runner (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, tables: BlockTables, sizes: GraphSizes,
                 attn: object, shapes: dict[str, tuple[int, ...]], num_layers: int, dtype: torch.dtype,
                 vocab_size: int, last_token: torch.Tensor, device: torch.device, *, capture: bool) -> None:
        self.device = device
        self.block_tables = tables
        rows = max(sizes.mixed[-1] if sizes.mixed else 0, sizes.decode[-1] if sizes.decode else 0)
        self.sites = Sites(num_layers, shapes)
        slots = tables.table.shape[0]
        hidden = shapes["resid_post"][0]
        decode_rows = sizes.decode[-1] if sizes.decode else 0
        self.taps = TapTables(self.sites, slots, rows, device, dtype, max_ops=OPS_PER_SEQ * slots,
                              pool_rows=POOL_ROWS_PER_SEQ * slots,
                              capture_numbers=capture_numbers(hidden, rows, decode_rows, num_layers))
        self.inputs = InputBuffers(rows, sizes.max_seqs, tables.padding_slot, device)
        self.sampler = SlotSampling(slots, vocab_size, device)
        self.graphs = GraphRunner(model, kv_caches, tables, self.inputs, self.taps, self.sampler, attn, sizes.keys(),
                                  device, last_token=last_token, vocab_size=vocab_size, dtype=dtype, capture=capture)
        self._generation = tables.generation
        self._joined: dict[Request, _Joined] = {}
        self.pending: list[tuple[torch.Tensor, np.ndarray]] = []  # sampling rows of slots joined this step
        # The step's captured chunks, by shape(): (item, number of its first captured row, rows captured, its
        # _Joined on a decode step, else None) for each chunk that captures, and the numbers captured in all.
        self._placed: tuple[list[tuple[int, int, int, _Joined | None]], int] | None = None
        self._pack_layouts = PackLayouts()
        self._plan: DecodePlan | None = None  # the last decode step's
        self._steady: SteadyPlacement | None = None

    def warm_up(self) -> None:
        """Capture every graph (start-up)."""
        self.graphs.warm_up()

    # ---- slots ---------------------------------------------------------------------------------
    def shape(self, lay: StepLayout) -> StepShape:
        """The step's shape for the decider; requests new to their slot write their tables first."""
        blocked = None
        known = self._joined
        decode = lay.decode_only
        # A steady decode step places its captured rows in the same pass (what TapTables.chunk_places does,
        # with each row's _Joined for the delivery); a pass that joined a slot places them again after it.
        spans = self.taps.spans if decode and self.taps.capturing else None
        steady = self._steady
        if spans is not None and steady is not None and steady.holds(lay):
            spans = None  # placed as the step before, unless a slot joins
        else:
            steady = None
        placed: list[tuple[int, int, int, _Joined]] = []
        total = 0
        joins = False
        left = FAR  # steps until a row crosses its span's edge
        for i, (it, slot) in enumerate(zip(lay.items, lay.item_slots)):
            req = it.request
            joined = known.get(req)
            if joined is None or joined.slot != slot or joined.preemptions != req.num_preemptions:
                joined = self._join(req, slot)
                joins = True
            if joined.blocked is not None and blocked is None:
                blocked = joined.blocked
            if spans is not None:
                span = spans[slot]
                if span is not None:
                    p = it.start
                    if span[1] <= p < span[2]:  # one position: in the span or not
                        placed.append((i, total, 1, joined))
                        total += span[0]
                        left = min(left, span[2] - p)
                    elif p < span[1]:
                        left = min(left, span[1] - p)
        self._steady = None
        if joins:
            steady = None
        elif steady is not None:
            placed, total = steady.next()
            self._steady = steady
        elif spans is not None:
            self._steady = SteadyPlacement(list(lay.item_slots), sum(lay.pos), left, placed, total)
        if self.block_tables.generation != self._generation:
            blocked = "the block table moved"
        self._placed = None
        if self.taps.capturing and blocked is None:
            if decode and (joins or (spans is None and steady is None)):
                rows, total = self.taps.chunk_places(lay.item_slots, lay.pos)
                placed = [(i, first, n, known[lay.items[i].request]) for i, first, n in rows]
            elif not decode:
                rows, total = self.taps.chunk_places(lay.item_slots, [it.start for it in lay.items],
                                                     [it.num_tokens for it in lay.items])
                placed = [(i, first, n, None) for i, first, n in rows]
            if placed:
                self._placed = placed, total
            # The site kernel writes each captured row where the prologue places it, unchecked: a step
            # whose captures all together overrun the buffer must not replay.
            if total > self.taps.cap_out.numel():
                blocked = "the step's captures exceed the capture buffer"
        tapped = self._placed is not None or self.taps.any_steers(lay.item_slots)
        return StepShape(decode, len(lay.ids), len(lay.items), len(lay.sample_rows), tapped, blocked)

    def _join(self, req: Request, slot: int) -> _Joined:
        joined = self._joined.get(req)
        if joined is not None and joined.slot == slot and joined.preemptions == req.num_preemptions:
            return joined
        if joined is not None and joined.slot != slot:
            self.taps.clear(joined.slot)
        joined = self._joined[req] = _Joined(req, slot, req.num_preemptions)
        self.pending.append(self.sampler.pending_write(slot, req.params, req.seed))
        if req.capture is None and req.steering is None:
            return joined
        capture = layout = None
        ops: list = []
        if req.capture is not None:
            capture, layout, joined.blocked = slot_capture(req.capture, self.sites)
        if joined.blocked is None and req.steering is not None:
            ops, joined.blocked = slot_ops(req.steering, self.sites)
        if joined.blocked is None:
            joined.blocked = self.taps.write(slot, capture, ops)
        if joined.blocked is not None:
            self.taps.clear(slot)
        joined.layout = layout
        return joined

    def release(self, req: Request) -> None:
        """Forget ``req``'s slot tables (it finished, was aborted or preempted)."""
        joined = self._joined.pop(req, None)
        if joined is not None:
            self.taps.clear(joined.slot)

    # ---- the step ------------------------------------------------------------------------------
    def fill(self, lay: StepLayout, key: GraphKey, host: np.ndarray) -> None:
        """Write ``lay``'s rows, padded to ``key``'s graph, into ``host`` (the step's upload section)."""
        rows, seqs = self.graphs.extent(key)
        last = []
        row_slot = []
        for it, slot in zip(lay.items, lay.item_slots):
            row_slot.extend([slot] * it.num_tokens)
            last.extend([0] * (it.num_tokens - 1) + [1])
        kw = {}
        if key.kind == "mixed":
            cu, ctx = [0], []
            for it in lay.items:
                cu.append(cu[-1] + it.num_tokens)
                ctx.append(it.start)
            kw = dict(cu_q=cu, ctx=ctx, seq_rows=lay.item_slots, sample_rows=[r for r, _ in lay.sample_rows],
                      sample_slot=[row_slot[r] for r, _ in lay.sample_rows])
        self.inputs.fill(host, rows, seqs, ids=lay.ids, positions=lay.pos, row_slot=row_slot, last_rows=last, **kw)

    def writes(self) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The table rows written since the last step (slots joined), for the step's upload; then forgotten."""
        out = self.pending + self.taps.pending
        self.pending, self.taps.pending = [], []
        return out

    def run(self, key: GraphKey, uploaded: torch.Tensor) -> GraphOutputs:
        """Copy the step's uploaded inputs into the graph's buffers and replay ``key``'s graph."""
        self.inputs.load(uploaded)
        return self.graphs.run(key)

    def deliver(self, lay: StepLayout, sink: CopySink, stopped: set[Request] | frozenset = frozenset()
                ) -> dict[RequestCapture, str]:
        """Hand each capturing request its rows of the step just replayed (see the module docstring), except
        requests in ``stopped`` (they ended at the step before: these rows are past their end); returns the
        captures that failed alone."""
        if self._placed is None:  # no row of the step captured
            return {}
        # The last step's copies land before this step's rows are handed out (a last-position capture keeps
        # only the newest row), and before this step's copies start: settling after them would wait for them.
        sink.settle()
        failed: dict[RequestCapture, str] = {}
        if lay.decode_only:
            entries, host = self._deliver_decode(lay, sink, stopped, failed)
        else:
            entries, host = self._deliver_chunks(lay, sink, stopped)
        for e in entries:
            cap = e.capture
            if not cap.sel.points:  # a request of SAE features only keeps no rows
                continue
            if cap.takes_host_rows:
                cap.defer(self._views(e.layout, cap), host, e.start, e.a, e.b)
                continue
            n, size = e.b - e.a, e.layout.size
            block = self.taps.cap_out[e.start : e.start + n * size].view(n, size)
            for point in cap.sel.points:
                rows = self._recorded(e.layout, cap, block, point)
                try:
                    cap.consume(point, rows, e.a, e.b, sink)
                except Exception as exc:  # noqa: BLE001 - belongs to this request alone
                    failed[cap] = f"hidden_states: capturing {point!r} failed: {type(exc).__name__}: {exc}"
                    break
        features = [e for e in entries if e.features and e.capture not in failed]
        if features:
            failed.update(FeatureBatch(features, kernel=True, layouts=self._pack_layouts).run(self._gather, sink,
                                                                                            failed))
        self._pack_layouts.end_step()
        sink.flush()
        for e in entries:
            if e.capture not in failed:
                e.capture.advance(e.a, e.b)
        return failed

    def _deliver_decode(self, lay: StepLayout, sink: CopySink, stopped: set[Request] | frozenset,
                        failed: dict[RequestCapture, str]) -> tuple[list[_Delivery], torch.Tensor | None]:
        """:meth:`deliver` for a step of single-token decodes, by the :class:`DecodePlan` of the step's
        placement (made again only when it changed, or for this step alone when a request in it has
        ended); the SAE feature groups are handed out here. Returns the requests that take their rows on
        the device, and the step's host copy (None: none made)."""
        placed, total = self._placed
        plan = self._plan
        if plan is None or plan.placed != placed or plan.buffer is not self.taps.cap_out:
            plan = self._plan = self._decode_plan(placed, frozenset())
        if plan.has_ended(stopped):
            plan = self._decode_plan(placed, stopped)
        pos = lay.pos
        host = None
        if plan.host_copy:
            host = _to_host(self.taps.cap_out[:total], sink)
            defer_rows(plan.kept, host, pos)
        if plan.groups:
            deliver_groups(plan, pos, sink, failed)
        return [_Delivery(cap, layout, pos[r], pos[r] + 1, first, f) for cap, layout, r, first, f in plan.device], host

    def _decode_plan(self, placed: list[tuple[int, int, int, _Joined]], ended: set[Request] | frozenset
                     ) -> DecodePlan:
        """:func:`decode_plan` of ``placed``, leaving out requests that ended (finished, or in ``ended``)."""
        def how(joined: _Joined) -> How:
            cap = joined.request.capture
            if joined.delivery is None or joined.delivery.capture is not cap:
                joined.delivery = self._delivery(joined.layout, cap)
            return joined.delivery
        return decode_plan(placed, ended, self.taps.cap_out, how, lambda point, key: self.sites.of(point, key).width)

    def _deliver_chunks(self, lay: StepLayout, sink: CopySink, stopped: set[Request] | frozenset
                        ) -> tuple[list[_Delivery], torch.Tensor | None]:
        """:meth:`deliver` for a step with prompt chunks: each request's window of its chunk (returns as
        :meth:`_deliver_decode`)."""
        entries: list[_Delivery] = []
        kept: list[tuple[RequestCapture, RowViews, int, int, int]] = []
        placed = {i: (first, count) for i, first, count, _ in self._placed[0]}
        end = 0  # the host copy covers the rows of requests that keep them as captured
        known = self._joined
        for i, it in enumerate(lay.items):
            req, n = it.request, it.num_tokens
            cap = req.capture
            if cap is None or req.finished or (stopped and req in stopped):
                continue
            window = cap.window(it.start, n)
            if window is None:
                continue
            a, b = window
            first, count = placed.get(i, (-1, 0))
            if count != b - a:
                raise RuntimeError(f"request {req.request_id}: the graph captured {count} rows where its "
                                   f"window holds {b - a}")
            joined = known[req]
            how = joined.delivery
            if how is None or how.capture is not cap:
                how = joined.delivery = self._delivery(joined.layout, cap)
            size, views = how.size, how.views
            if size:
                end = max(end, first + (b - a) * size)
            if views is not None:
                kept.append((cap, views, first, a, b))
            else:
                entries.append(_Delivery(cap, joined.layout, a, b, first, cap.sel.features is not None))
        host = None
        if end:
            host = _to_host(self.taps.cap_out[:end], sink)
        for cap, views, first, a, b in kept:
            cap.defer(views, host, first, a, b)
        return entries, host

    def _delivery(self, layout: RecordLayout, cap: RequestCapture) -> How:
        """How a step hands ``cap`` its rows (see :meth:`deliver`)."""
        fs = cap.sel.features
        host_rows = cap.takes_host_rows and bool(cap.sel.points)
        views = self._views(layout, cap) if host_rows and fs is None else None
        only_features = None
        if fs is not None and not cap.sel.points:
            only_features = (id(fs.sae), fs, layout.at[(fs.point, fs.key)],
                             layout.at[fs.out] if fs.out is not None else None)
        return How(cap, layout.size if host_rows else 0, views, only_features)

    def _views(self, layout: RecordLayout, cap: RequestCapture) -> RowViews:
        """``cap``'s :data:`RowViews` over a step's host block, by ``layout`` (cut when its result is read)."""
        def views(host: torch.Tensor, start: int, n: int) -> dict[str, torch.Tensor]:
            block = host[start : start + n * layout.size].view(n, layout.size)
            return {point: self._recorded(layout, cap, block, point) for point in cap.sel.points}
        return views

    def _recorded(self, layout: RecordLayout, cap: RequestCapture, block: torch.Tensor, point: str) -> torch.Tensor:
        """``e``'s rows of ``point`` as the tap recorded them, ``[b - a, layers, *row]``: the site's full row
        (every head, no projection: the capture selects and projects them) of the layers the request
        captures, which come first in the record; the layers only its SAE reads follow them."""
        keys, start, _ = layout.part(point)
        site = self.sites.of(point, keys[0])
        row = (site.groups, site.group_width) if BY_NAME[point].heads is not None else (site.width,)
        layers = len(cap.sel.layer_keys(point))
        return block[:, start : start + layers * site.width].view(block.shape[0], layers, *row)

    def _gather(self, entries: list[_Delivery], point: str, key: int) -> torch.Tensor:
        """The entries' rows of ``point`` at layer ``key`` in the capture buffer, one after another:
        ``[rows, width]``, in one gather whatever the number of entries (:data:`tapllm.sae.batch.Gather`)."""
        starts: list[int] = []
        for e in entries:
            first = e.start + e.layout.at[(point, key)]
            if e.b - e.a == 1:
                starts.append(first)
            else:
                starts.extend(range(first, first + (e.b - e.a) * e.layout.size, e.layout.size))
        return self._rows_at(starts, point, key)

    def _rows_at(self, starts: Sequence[int], point: str, key: int) -> torch.Tensor:
        """The rows of ``point`` at layer ``key`` that start at numbers ``starts`` of the capture buffer."""
        return rows_at(self.taps.cap_out, self.sites.of(point, key).width, starts)


def _to_host(t: torch.Tensor, sink: CopySink) -> torch.Tensor:
    """A host copy of ``t``, for requests to keep views of: pinned and asynchronous on CUDA (the sink
    waits for it before any result is read), a plain copy on the CPU."""
    return t.clone() if t.device.type == "cpu" else sink.host_copy(t)
