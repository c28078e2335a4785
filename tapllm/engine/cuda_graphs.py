"""Decode steps replayed from CUDA graphs at batch buckets, taps included.

A decode step's forward (embedding, every block, the final norm and the logits) is captured
once per batch size of ``cuda_graph_sizes`` and per :class:`~tapllm.engine.graph_tap.TapShape`
(the plain one at start-up, largest first so the smaller ones reuse its memory; a tapped one
the first time a step needs it, kept in a bounded cache). A step of ``n`` decodes replays the
graph of the next size up: its inputs (token ids, positions, cache slots, context lengths,
block-table rows) are copied into the graph's input buffer from the step's one upload, and
the rows past ``n`` are padding that writes its key and value to a slot of a block no request
holds and attends to that slot alone. Sampling runs after the replay, on the real rows.

Steps with a prefill chunk, more rows than the largest graph, prompt logprobs, a model that
needs per-row prompt lengths, or a tap a graph cannot express run the eager step; each says
why in :attr:`GraphRunner.fallbacks` (served in ``/metrics``) and at debug level.

Where no GPU is at hand (``capture=False``) the runner calls the very function it would
capture, on the same buffers: the CPU tests check padding, taps and steering that way.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from tapllm.backends.ops import AttentionOps
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.graph_tap import NO_TAP, GraphTap, TapShape
from tapllm.hidden_states.plan import CapturePlan
from tapllm.layers.attention import AttentionMetadata
from tapllm.steering.plan import SteeringPlan

logger = logging.getLogger("tapllm")

MAX_TAPPED_GRAPHS = 32  # tapped graphs kept (the plain ones are always kept)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run the body itself (no capture)
    logits: torch.Tensor | None  # the captured forward's output


class GraphRunner:
    """Captures and replays decode steps (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, tables: BlockTables, sizes: tuple[int, ...],
                 attn: AttentionOps | None, row_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, trash_slot: int, *, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.tables = tables
        self.sizes = tuple(sorted(sizes))
        self.attn = attn
        self.row_shapes = row_shapes
        self.dtype = dtype
        self.device = device
        self.trash_slot = trash_slot
        self.capture = capture
        self.inputs = torch.zeros((5, self.sizes[-1]), dtype=torch.int64, device=device)  # what every graph reads
        self._graphs: OrderedDict[tuple[TapShape, int], _Graph] = OrderedDict()
        self._taps: dict[TapShape, GraphTap] = {}
        self._generation = tables.generation
        self._pool = None
        self.fallbacks: Counter[str] = Counter()  # eager steps, by reason
        self.replays = 0
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, rows: int) -> int | None:
        """The smallest graph size holding ``rows``, or None."""
        return next((b for b in self.sizes if b >= rows), None)

    def capture_plain(self) -> None:
        """Capture the untapped graph of every size (at start-up), largest first."""
        for b in reversed(self.sizes):
            self._get(NO_TAP, b)

    def fall_back(self, reason: str) -> None:
        """Count an eager step and say why (debug level)."""
        self.fallbacks[reason] += 1
        logger.debug("decode step runs eagerly: %s", reason)

    def run(self, shape: TapShape, rows: int, steering: SteeringPlan | None, capture: CapturePlan | None
            ) -> torch.Tensor:
        """Replay the graph for ``shape`` and the bucket of ``rows`` (its inputs already copied into
        :attr:`inputs`); returns its logits ``[bucket, vocab]`` (the rows past ``rows`` are padding)."""
        b = self.bucket(rows)
        graph = self._get(shape, b)
        tap = self._taps.get(shape)
        if tap is not None:
            tap.load(steering)
        if graph.graph is not None:
            graph.graph.replay()
            logits = graph.logits
        else:
            logits = self._forward(b, tap)
        if tap is not None and capture is not None:
            tap.fill_stages(capture)
        self.replays += 1
        return logits

    def inputs_for(self, rows: int) -> torch.Tensor:
        """The graph input buffer's columns the step of ``rows`` rows fills: ``[5, bucket]``."""
        return self.inputs[:, : self.bucket(rows)]

    # ---- capture ---------------------------------------------------------------------------
    def _get(self, shape: TapShape, b: int) -> _Graph:
        if self.tables.generation != self._generation:  # the block table moved: every graph reads the old one
            self._graphs.clear()
            self._generation = self.tables.generation
        key = (shape, b)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        tap = None
        if shape:
            tap = self._taps.get(shape)
            if tap is None:
                tap = self._taps[shape] = GraphTap(shape, self.max_size, self.row_shapes, self.dtype, self.device)
        graph = self._graphs[key] = self._capture(b, tap) if self.capture else _Graph(None, None)
        tapped = [k for k in self._graphs if k[0]]
        while len(tapped) > MAX_TAPPED_GRAPHS:
            old = tapped.pop(0)
            del self._graphs[old]
            if not any(k[0] == old[0] for k in self._graphs):
                self._taps.pop(old[0], None)
        return graph

    def _pad_inputs(self, b: int) -> None:
        """Every row padding: what capturing (and its warm-up runs) may write without harm."""
        grid = self.inputs[:, :b]
        grid[0].zero_()
        grid[1].zero_()
        grid[2].fill_(self.trash_slot)
        grid[3].fill_(1)
        grid[4].fill_(self.tables.pad_row)

    def _capture(self, b: int, tap: GraphTap | None) -> _Graph:
        """Capture the step of ``b`` rows; the inputs of a step that asked for it mid-run are kept."""
        t0 = time.perf_counter()
        step = self.inputs[:, :b].clone()
        self._pad_inputs(b)
        try:
            return self._record(b, tap)
        finally:
            self.inputs[:, :b].copy_(step)
            self.capture_seconds += time.perf_counter() - t0

    def _record(self, b: int, tap: GraphTap | None) -> _Graph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: kernel selection and first-use allocations outside the graph
            for _ in range(2):
                self._forward(b, tap)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b, tap)
        if self._pool is None:
            self._pool = graph.pool()
        return _Graph(graph, logits)

    def _forward(self, b: int, tap: GraphTap | None) -> torch.Tensor:
        """The step a graph holds: every block over the ``b`` rows of :attr:`inputs`, then the logits."""
        ids, pos, slots, lens, rows = self.inputs[:, :b]
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=b,
                                 decode_block_tables=self.tables.table.index_select(0, rows), decode_mask=None,
                                 prefills=[], decode_lens=lens, attn=self.attn)
        if self.attn is None:  # the PyTorch attention masks keys past each row's length
            width = meta.decode_block_tables.shape[1] * self.tables.block_size
            meta.decode_mask = (torch.arange(width, device=self.device)[None, :] >= lens[:, None])[:, None, :]
        hidden = self.model(ids, pos, self.kv_caches, meta, tap)
        return self.model.compute_logits(hidden)
