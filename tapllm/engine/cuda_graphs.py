"""Steps replayed from CUDA graphs: one graph per (kind, bucket, tapped), all captured at start-up.

A graph holds a whole step over the static :class:`~tapllm.engine.input_buffers.InputBuffers`:
the cache slots of its rows (looked up on the device from the block table), every block, the
final norm, the logits of the rows that sample and their greedy tokens. Two kinds:

* ``decode``: every row is one request's next token; the size is the number of rows, and decode
  attention reads each row's blocks in place;
* ``mixed``: prefill chunks and decodes in one ragged batch; the size is the number of tokens, and
  one attention launch (``unified_attention``) serves every sequence, described by the per-sequence
  inputs (``cu_q``, ``ctx``, ``seq_rows``).

Each exists plain and *tapped*: the tapped graph passes every site through
:class:`~tapllm.engine.table_tap.TableTap` (or the kernels it hands its sites to), which steers and
captures what each row's slot asked for in the slot tables, so one tapped graph serves every mix of
taps: the number of graphs is bounded by the buckets, and nothing is captured after start-up. A
step of ``n`` rows or tokens replays the graph of the next size up; its padding rows read the
padding slot and write to the padding block.

Every step graph samples its rows by their slots' parameters (``engine/graph_sampler.py``): the
greedy tokens always, then, inside a CUDA conditional node taken only when some row's slot has a
temperature, the drawn ones; so greedy steps pay for no sort, and sampling adds no graph. Where the
driver cannot capture a conditional node (before CUDA 12.4; probed at start-up), rows that draw are
sampled by a second, small graph per number of sampled rows (:meth:`GraphRunner.draw`), replayed
after the step's graph.

Without a GPU, ``capture=False`` makes :meth:`GraphRunner.run` call the very function a graph holds,
on the same buffers (the tests and ``benchmarks/step_budget.py`` count what it does).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from tapllm.backends.ops import AttentionOps
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.graph_sampler import SlotSampling
from tapllm.backends.policy import GraphKey
from tapllm.engine.input_buffers import InputBuffers, InputViews
from tapllm.engine.table_tap import TableTap
from tapllm.layers.attention import AttentionMetadata, UnifiedBatch
from tapllm.tap.tables import TapTables

logger = logging.getLogger("tapllm")


@dataclass(slots=True)
class GraphOutputs:
    """What a replay leaves in the graph's static tensors: the final hidden rows and the sampled rows' logits."""

    hidden: torch.Tensor  # [size, hidden]
    logits: torch.Tensor  # [rows that may sample, vocab]
    tokens: torch.Tensor  # [rows that may sample] float64: greedy tokens, or the drawn ones after draw()


class GraphRunner:
    """Captures every graph at start-up and replays them (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, tables: BlockTables, inputs: InputBuffers,
                 taps: TapTables | None, sampler: SlotSampling, attn: AttentionOps, keys: list[GraphKey],
                 device: torch.device, *, last_token: torch.Tensor, vocab_size: int, dtype: torch.dtype,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.tables = tables
        self.inputs = inputs
        self.taps = taps
        self.sampler = sampler
        self.last_token = last_token  # [slots]: each slot's latest sampled token (inputs read it where they say -1)
        self.attn = attn
        self.device = device
        self.capture = capture
        self.fuse_sites = True  # tapped graphs hand kernels their sites (TableTap(fuse=)); read when captured
        # Whether step graphs draw too (in a conditional node); else sampler graphs do. Decided at warm-up.
        self.draws_in_step = True
        self.keys = sorted(keys, key=lambda k: (k.kind, k.size, k.tapped))
        self.decode_sizes = sorted({k.size for k in keys if k.kind == "decode"})
        self.mixed_sizes = sorted({k.size for k in keys if k.kind == "mixed"})
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph | None, GraphOutputs | None]] = {}
        self.draw_sizes = sorted({self.extent(k)[1] for k in keys})
        self._draws: dict[int, torch.cuda.CUDAGraph | None] = {}
        most = self.draw_sizes[-1]
        # What a step graph leaves for the sampler graphs: the sampled rows' logits, slots and counters
        # (the index of the token each samples), and the tokens.
        self.logits = torch.zeros((most, vocab_size), dtype=dtype, device=device)
        self.sample_slots = torch.full((most,), inputs.padding_slot, dtype=torch.int64, device=device)
        self.counters = torch.zeros(most, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(most, dtype=torch.float64, device=device)
        self._pool = None
        self._capturing: torch.cuda.CUDAGraph | None = None  # the step graph being captured
        self.warm = False
        self.captures_after_warmup = 0
        self.capture_seconds = 0.0
        self.replays: Counter[GraphKey] = Counter()

    # ---- which graph --------------------------------------------------------------------------
    def bucket(self, kind: str, n: int) -> int | None:
        """The smallest size of ``kind`` holding ``n`` rows (decode) or tokens (mixed), or None."""
        return next((b for b in (self.decode_sizes if kind == "decode" else self.mixed_sizes) if b >= n), None)

    @property
    def buckets(self) -> int:
        """How many (kind, size) buckets there are (each has a plain and a tapped graph)."""
        return len(self.decode_sizes) + len(self.mixed_sizes)

    @property
    def distinct_graphs(self) -> int:
        """Step graphs (each bucket plain and tapped) and sampler graphs (one per number of sampled rows,
        only where step graphs cannot draw)."""
        return len(self._graphs) + len(self._draws)

    # ---- capture ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Capture every graph (largest first, so smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        if self.capture and self.draws_in_step and not conditional_nodes_work(self.device):
            self.draws_in_step = False
            logger.info("CUDA graphs: this driver captures no conditional node; drawing rows run sampler graphs")
        for key in sorted(self.keys, key=lambda k: -k.size):
            self._graphs[key] = self._record(key)
        if not self.draws_in_step:
            for size in reversed(self.draw_sizes):
                self._draws[size] = self._record_draw(size)
        self.capture_seconds += time.perf_counter() - t0
        self.warm = True

    def _record(self, key: GraphKey) -> tuple[torch.cuda.CUDAGraph | None, GraphOutputs | None]:
        if not self.capture:
            return None, None
        self._pad(key)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # kernel selection and first-use allocations, outside the graph
            for _ in range(2):
                self.body(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self._capturing = graph  # the body opens its conditional draw node in it
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.body(key)
        finally:
            self._capturing = None
        if self._pool is None:
            self._pool = graph.pool()
        return graph, outputs

    def _record_draw(self, size: int) -> torch.cuda.CUDAGraph | None:
        if not self.capture:
            return None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.draw_body(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.draw_body(size)
        return graph

    def _pad(self, key: GraphKey) -> None:
        """Every row and sequence padding: what capturing may run without harm."""
        rows, seqs = self.extent(key)
        host = torch.zeros(self.inputs.size, dtype=torch.int64)
        self.inputs.fill(host.numpy(), rows, seqs, ids=[], positions=[], row_slot=[], last_rows=[], cu_q=[0], ctx=[],
                         seq_rows=[], sample_rows=[], sample_slot=[])
        self.inputs.load(host.to(self.device))

    # ---- replay -------------------------------------------------------------------------------
    def run(self, key: GraphKey) -> GraphOutputs:
        """Replay ``key``'s graph over the inputs already uploaded."""
        if key not in self._graphs:
            if self.warm:
                self.captures_after_warmup += 1
                logger.warning("CUDA graph %s captured after start-up", key)
            self._graphs[key] = self._record(key)
        graph, outputs = self._graphs[key]
        self.replays[key] += 1
        if graph is None:
            return self.body(key)
        graph.replay()
        return outputs

    def draw(self, rows: int) -> torch.Tensor:
        """Replay the sampler graph over the first ``rows`` sampled rows of the step just replayed (some of
        them draw at random); returns the tokens (float64, the sampler graph's size). Only where step
        graphs do not draw (:attr:`draws_in_step` is False)."""
        size = next(s for s in self.draw_sizes if s >= rows)
        graph = self._draws.get(size)
        if graph is None:
            self.draw_body(size)
        else:
            graph.replay()
        return self.tokens[:size]

    def draw_body(self, size: int) -> None:
        """What a sampler graph holds: every row's token by its slot's parameters."""
        self.tokens[:size].copy_(self.sampler.sample(self.logits[:size], self.sample_slots[:size],
                                                     self.counters[:size], draw=True))
        self.last_token.index_copy_(0, self.sample_slots[:size], self.tokens[:size].clamp(min=0).long())

    def extent(self, key: GraphKey) -> tuple[int, int]:
        """(rows, sequences) of ``key``'s inputs."""
        seqs = key.size if key.kind == "decode" else min(key.size, self.inputs.seqs)
        return key.size, seqs

    def views(self, key: GraphKey) -> InputViews:
        return self.inputs.view(*self.extent(key))

    def body(self, key: GraphKey) -> GraphOutputs:
        """The step a graph of ``key`` holds, over the input buffers."""
        v = self.views(key)
        table, bs = self.tables.table, self.tables.block_size
        slots = table[v.row_slot, torch.div(v.positions, bs, rounding_mode="floor")] * bs + v.positions % bs
        if key.kind == "decode":
            meta = AttentionMetadata(slot_mapping=slots, num_decodes=key.size,
                                     decode_block_tables=table.index_select(0, v.row_slot), decode_mask=None,
                                     prefills=[], decode_lens=v.positions + 1, attn=self.attn)
        else:
            meta = AttentionMetadata(slot_mapping=slots, num_decodes=0, decode_block_tables=None, decode_mask=None,
                                     prefills=[], attn=self.attn,
                                     unified=UnifiedBatch(v.cu_q, v.ctx, v.seq_rows, table))
        tap = None
        if key.tapped:
            tap = TableTap(self.taps, v.row_slot, v.positions, v.last_rows, fuse=self.fuse_sites)
            tap.begin()
        ids = torch.where(v.ids < 0, self.last_token.index_select(0, v.row_slot), v.ids)
        hidden = self.model(ids, v.positions, self.kv_caches, meta, tap)
        if key.kind == "decode":  # every row samples
            rows, slots, positions = hidden, v.row_slot, v.positions
        else:
            rows = hidden.index_select(0, v.sample_rows)
            slots, positions = v.sample_slot, v.positions.index_select(0, v.sample_rows)
        n = rows.shape[0]
        logits = self.logits[:n]
        logits.copy_(self.model.compute_logits(rows))
        self.sample_slots[:n].copy_(slots)
        torch.add(positions, 1, out=self.counters[:n])
        self.tokens[:n].copy_(self.sampler.sample(logits, self.sample_slots[:n], self.counters[:n], draw=False))
        self.last_token.index_copy_(0, self.sample_slots[:n], self.tokens[:n].clamp(min=0).long())
        if self.draws_in_step:
            self._draw_if_any(n)
        return GraphOutputs(hidden, logits, self.tokens[:n])

    def _draw_if_any(self, n: int) -> None:
        """Re-sample the ``n`` rows by their parameters when some row's slot has a temperature: in a
        conditional node while capturing; otherwise (warming up for a capture, or without graphs)
        always, which gives the same tokens (greedy rows keep their argmax) without reading a device
        value on the host."""
        graph = self._capturing
        if graph is not None:
            drawing = (self.sampler.temperature.index_select(0, self.sample_slots[:n]) > 0).any()
            graph.begin_capture_to_if_node(drawing)
            try:
                self.draw_body(n)
            finally:
                graph.end_capture_to_conditional_node()
        else:
            self.draw_body(n)


def conditional_nodes_work(device: torch.device) -> bool:
    """Whether this driver captures and replays a CUDA graph's conditional node (CUDA 12.4 and later):
    a one-kernel body, replayed with its predicate true then false."""
    try:
        flag = torch.ones((), dtype=torch.bool, device=device)
        x = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph.begin_capture_to_if_node(flag)
            try:
                x.add_(1)
            finally:
                graph.end_capture_to_conditional_node()
        graph.replay()
        flag.fill_(False)
        graph.replay()
        return float(x.item()) == 1.0
    except Exception as exc:  # noqa: BLE001 - any failure means: use sampler graphs
        logger.debug("conditional node probe failed: %s", exc)
        return False
