"""A scheduled step turned into the model's inputs: batch rows, cache slots, attention metadata.

:func:`lay_out` lays the step out on the host (decodes first, then prefill chunks, one row
per token) as plain lists and row spans; :func:`upload` writes every number into the step's
staging buffer, sends it in one copy and builds the :class:`StepBatch` from the device
views. A step replayed from a CUDA graph is laid out the same way; its rows go to the graph's
input buffers and :func:`upload_sampling` sends the rest. The sampling plan's numbers go in the
same upload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tapllm.backends.ops import AttentionOps
from tapllm.engine.block_tables import BlockTables
from tapllm.engine.request import Request
from tapllm.engine.sampler import SamplingPlan
from tapllm.engine.scheduler import ScheduledItem
from tapllm.engine.staging import Staging
from tapllm.engine.step_tap import CaptureSpan, SteerSpan
from tapllm.layers.attention import AttentionMetadata, PrefillBatch, PrefillChunk, PrefillGroup, group_prefills
from tapllm.tap import RowSpan


_DTYPES = {np.dtype(np.int64).str: torch.int64, np.dtype(np.int32).str: torch.int32,
           np.dtype(np.float32).str: torch.float32}


@dataclass(slots=True)
class StepLayout:
    """A step's rows on the host: what :func:`upload` sends."""

    items: list[ScheduledItem]
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    diff: list[int] = field(default_factory=list)  # block-table entries to send: (row, column, block) triples
    sample_rows: list[tuple[int, Request]] = field(default_factory=list)  # (batch row, request) that sample
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_rows: list[int] = field(default_factory=list)  # each chunk's block-table row
    prefill_width: int = 0  # the longest table a chunk reads
    decode_rows: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    decode_width: int = 0
    prompt_logprob_rows: list[tuple[ScheduledItem, int]] = field(default_factory=list)
    item_slots: list[int] = field(default_factory=list)  # each item's slot (its block-table row)

    @property
    def decode_only(self) -> bool:
        """True when every row is a single-token decode."""
        return not self.prefills

    def tap_spans(self) -> tuple[list[CaptureSpan], list[SteerSpan]]:
        """The chunks of requests that capture and that steer, for the eager step's tap (a graph step reads
        its requests' slot tables instead, so it makes none)."""
        captures: list[CaptureSpan] = []
        steers: list[SteerSpan] = []
        row = 0
        for it in self.items:
            req, n = it.request, it.num_tokens
            if req.capture is not None:
                captures.append((RowSpan(row, it.start, n), req.capture, req.block_table))
            if req.steering is not None:
                steers.append((RowSpan(row, it.start, n), req.steering))
            row += n
        return captures, steers


@dataclass(slots=True)
class StepBatch:
    """One step's batch tensors, attention metadata, the rows that sample, and the prompt-logprob rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | None  # None for a graph step (its graph holds its own)
    sample_rows: list[tuple[int, Request]]  # (batch row, request) of each request that samples
    sample_index: torch.Tensor | None  # batch rows of sample_rows on the device (None: every row, in order)
    sampling: SamplingPlan | None
    prompt_logprob_rows: list[tuple[ScheduledItem, int]]  # chunks (and first rows) of prompt-logprob requests


def lay_out(items: list[ScheduledItem], tables: BlockTables) -> StepLayout:
    """The host side of a step of ``items`` (decodes first); assigns block-table rows and collects their diff."""
    bs = tables.block_size
    lay = StepLayout(items)
    ids, pos, slots, diff = lay.ids, lay.pos, lay.slots, lay.diff
    for it in items:
        req, start, n = it.request, it.start, it.num_tokens
        row = len(ids)
        chunk = req.token_ids[start : start + n]
        ids.extend(chunk if len(chunk) == n else chunk + [-1] * (n - len(chunk)))  # -1: still on the device
        table = req.block_table
        trow = tables.row(req, start // bs, diff)
        lay.item_slots.append(trow)
        if n == 1:
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            lay.decode_rows.append(trow)
            lay.decode_lens.append(start + 1)
            lay.decode_width = max(lay.decode_width, start // bs + 1)
        else:
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            lay.prefills.append(PrefillChunk(row, n, start, None))
            lay.prefill_rows.append(trow)
            lay.prefill_width = max(lay.prefill_width, -(-(start + n) // bs))
        if it.samples and not req.encode_only:
            lay.sample_rows.append((row + n - 1, req))
            # Samples waiting for this prompt draw their first tokens from the same logits.
            lay.sample_rows.extend((row + n - 1, child) for child in req.forks)
        if req.prompt_lp is not None:
            lay.prompt_logprob_rows.append((it, row))
    return lay


def upload(lay: StepLayout, staging: Staging, tables: BlockTables, *, attn: AttentionOps | None,
           prompt_lengths: bool, vocab_size: int, device: torch.device, last_token: torch.Tensor | None = None,
           invariant: bool = False) -> StepBatch:
    """The model's inputs for ``lay``, uploaded in one copy; ``attn`` is the backend's attention
    kernels (None: the PyTorch attention, which wants other metadata). A row whose token is not on the
    host yet (id -1: the host is a step ahead) reads its slot's entry of ``last_token`` on the device.
    ``invariant`` (batch_invariant): the PyTorch attention takes each row alone (no padded groups; every
    chunk's block table), and tied top logprobs come in token-id order."""
    bs = tables.block_size
    staging.begin()
    s_ids = staging.add(lay.ids, torch.int64)
    s_fed = None
    if last_token is not None and min(lay.ids, default=0) < 0:
        s_fed = staging.add([slot for it, slot in zip(lay.items, lay.item_slots) for _ in range(it.num_tokens)],
                            torch.int64)
    s_pos = staging.add(lay.pos, torch.int64)
    s_slots = staging.add(lay.slots, torch.int64)
    s_diff = staging.add(lay.diff, torch.int64, (len(lay.diff) // 3, 3))
    nd = len(lay.decode_rows)
    s_drows = staging.add(lay.decode_rows, torch.int64)
    s_lens = staging.add(lay.decode_lens, torch.int64)
    prefills = lay.prefills
    s_batch = None
    groups = []
    alone = prefills
    s_groups: list[tuple[int, int, int]] = []
    s_prows = staging.add(lay.prefill_rows, torch.int64)
    if prefills and attn is not None:  # one kernel call attends every chunk, reading the cache in place
        s_batch = (staging.add([c.start for c in prefills], torch.int64),
                   staging.add([c.length for c in prefills], torch.int64),
                   staging.add([c.context_len for c in prefills], torch.int64))
        alone = []
    elif prefills and not invariant:
        groups, alone = group_prefills(prefills)
        s_groups = [(staging.add(g.gather, torch.int64), staging.add(g.valid, torch.int64),
                     staging.add(g.rows, torch.int64)) for g in groups]
    s_prompt = None
    if prompt_lengths:
        s_prompt = staging.add([it.request.num_prompt_tokens for it in lay.items for _ in range(it.num_tokens)],
                               torch.int64)
    s_sample, sampling = _sampling_sections(lay, staging, vocab_size, device, len(lay.ids), invariant)

    views = staging.upload()
    tables.apply(views[s_diff])
    if sampling is not None:
        sampling.bind(views)
    ids = views[s_ids]
    if s_fed is not None:
        ids = torch.where(ids < 0, last_token.index_select(0, views[s_fed]), ids)
    decode_bt = decode_mask = lens = None
    if nd:
        lens = views[s_lens]
        decode_bt = tables.gather(views[s_drows], lay.decode_width)
        if attn is None:  # the PyTorch decode attention masks the padded keys
            width = lay.decode_width * bs
            decode_mask = (torch.arange(width, device=device)[None, :] >= lens[:, None])[:, None, :]
    prefill_batch = None
    if prefills:
        prefill_tables = tables.gather(views[s_prows], lay.prefill_width)
        if s_batch is not None:
            prefill_batch = PrefillBatch(*(views[i] for i in s_batch), prefill_tables,
                                         max(c.length for c in prefills))
        else:
            for i, c in enumerate(prefills):
                if c.context_len or invariant:  # attends its cached context too: read back from its blocks
                    c.block_table = prefill_tables[i, : -(-(c.context_len + c.length) // bs)]
    meta = AttentionMetadata(
        slot_mapping=views[s_slots],
        num_decodes=nd,
        decode_block_tables=decode_bt,
        decode_mask=decode_mask,
        prefills=alone,
        prefill_groups=[PrefillGroup(g.count, g.length, views[a], views[b], views[c])
                        for g, (a, b, c) in zip(groups, s_groups)],
        decode_lens=lens,
        prompt_lens=views[s_prompt] if s_prompt is not None else None,
        attn=attn,
        prefill_batch=prefill_batch,
    )
    return StepBatch(ids, views[s_pos], meta, lay.sample_rows,
                     views[s_sample] if s_sample is not None else None, sampling,
                     lay.prompt_logprob_rows)


def upload_graph(lay: StepLayout, staging: Staging, tables: BlockTables, fill: Callable[[np.ndarray], None],
                 size: int, *, vocab_size: int, device: torch.device, rows: int | None,
                 writes: list[tuple[torch.Tensor, np.ndarray]] | None = None, plan: bool = True
                 ) -> tuple[StepBatch, torch.Tensor]:
    """A graph step's upload, in one copy: its rows' inputs (``fill`` writes the ``size`` int64 numbers of
    ``tapllm.engine.input_buffers``), the block-table entries that changed, the sampling plan's numbers, and
    ``writes`` (device rows and their new host values: the slot tables of requests that joined), copied into
    place on the device after the upload. Returns the batch and the device view of the inputs. ``plan``
    False: the graph samples every row itself, and no sampling plan is made.

    ``rows``: a decode graph's logits are its batch rows, gathered when the sampled rows are not all of
    them in order; None: a mixed graph's logits are already the sampled rows.
    """
    staging.begin()
    s_inputs, host = staging.zeros(size, torch.int64)
    fill(host)
    s_writes = [(dest, staging.add(values, _DTYPES[values.dtype.str])) for dest, values in writes or ()]
    s_diff = staging.add(lay.diff, torch.int64, (len(lay.diff) // 3, 3))
    if not plan:
        s_sample, sampling = None, None
    elif rows is None:
        s_sample, sampling = None, (SamplingPlan([r for _, r in lay.sample_rows], vocab_size, staging, device)
                                    if lay.sample_rows else None)
    else:
        s_sample, sampling = _sampling_sections(lay, staging, vocab_size, device, rows)
    views = staging.upload()
    for dest, i in s_writes:
        dest.copy_(views[i].view(dest.shape))
    tables.apply(views[s_diff])
    if sampling is not None:
        sampling.bind(views)
    return StepBatch(None, None, None, lay.sample_rows, views[s_sample] if s_sample is not None else None, sampling,
                     lay.prompt_logprob_rows), views[s_inputs]


def _sampling_sections(lay: StepLayout, staging: Staging, vocab_size: int, device: torch.device, rows: int,
                       invariant: bool = False) -> tuple[int | None, SamplingPlan | None]:
    """The sampled rows' index (when they are not every one of ``rows``, in order) and the sampling plan."""
    if not lay.sample_rows:
        return None, None
    picked = [r for r, _ in lay.sample_rows]
    s_sample = staging.add(picked, torch.int64) if picked != list(range(rows)) else None
    return s_sample, SamplingPlan([r for _, r in lay.sample_rows], vocab_size, staging, device,
                                  canonical_ties=invariant)
