"""A scheduled step turned into the model's inputs: batch rows, cache slots, attention metadata.

:func:`build_step` lays the step out on the host (decodes first, then prefill chunks, one
row per token), writes every number into the step's staging buffer, uploads it in one copy
and builds the :class:`StepBatch` from the device views. The sampling plan's numbers go in
the same upload.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class StepBatch:
    """One step's batch tensors, attention metadata, the rows that sample, and the tap's row spans."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[tuple[int, Request]]  # (batch row, request) of each request that samples
    sample_index: torch.Tensor | None  # batch rows of sample_rows on the device (None: every row, in order)
    sampling: SamplingPlan | None
    captures: list[CaptureSpan]  # chunks of requests that capture
    steers: list[SteerSpan]  # chunks of requests that steer
    prompt_logprob_rows: list[tuple[ScheduledItem, int]]  # chunks (and first rows) of prompt-logprob requests


def build_step(items: list[ScheduledItem], staging: Staging, tables: BlockTables, *, attn: AttentionOps | None,
               prompt_lengths: bool, vocab_size: int, device: torch.device) -> StepBatch:
    """The model's inputs for ``items`` (decodes first), uploaded in one copy; ``attn`` is the
    backend's attention kernels (None: the PyTorch attention, which wants other metadata)."""
    bs = tables.block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    diff: list[int] = []
    sample_rows: list[tuple[int, Request]] = []
    prefills: list[PrefillChunk] = []
    prefill_rows: list[int] = []  # each chunk's table row
    width = 0  # the longest table a chunk reads
    decode_rows: list[int] = []
    decode_lens: list[int] = []
    decode_width = 0
    captures: list[CaptureSpan] = []
    steers: list[SteerSpan] = []
    prompt_lp_rows: list[tuple[ScheduledItem, int]] = []
    for it in items:
        req, start, n = it.request, it.start, it.num_tokens
        row = len(ids)
        ids.extend(req.token_ids[start : start + n])
        table = req.block_table
        trow = tables.row(req, start // bs, diff)
        if n == 1:
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            decode_rows.append(trow)
            decode_lens.append(start + 1)
            decode_width = max(decode_width, start // bs + 1)
        else:
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            prefills.append(PrefillChunk(row, n, start, None))
            prefill_rows.append(trow)
            width = max(width, -(-(start + n) // bs))
        if it.samples and not req.encode_only:
            sample_rows.append((row + n - 1, req))
            # Samples waiting for this prompt draw their first tokens from the same logits.
            sample_rows.extend((row + n - 1, child) for child in req.forks)
        if req.capture is not None:
            captures.append((RowSpan(row, start, n), req.capture, req.block_table))
        if req.steering is not None:
            steers.append((RowSpan(row, start, n), req.steering))
        if req.prompt_lp is not None:
            prompt_lp_rows.append((it, row))

    staging.begin()
    s_ids = staging.add(ids, torch.int64)
    s_pos = staging.add(pos, torch.int64)
    s_slots = staging.add(slots, torch.int64)
    s_diff = staging.add(diff, torch.int64, (len(diff) // 3, 3))
    nd = len(decode_rows)
    s_drows = staging.add(decode_rows, torch.int64)
    s_lens = staging.add(decode_lens, torch.int64)
    s_batch = None
    groups = []
    alone = prefills
    s_groups: list[tuple[int, int, int]] = []
    s_prows = staging.add(prefill_rows, torch.int64)
    if prefills and attn is not None:  # one kernel call attends every chunk, reading the cache in place
        s_batch = (staging.add([c.start for c in prefills], torch.int64),
                   staging.add([c.length for c in prefills], torch.int64),
                   staging.add([c.context_len for c in prefills], torch.int64))
        alone = []
    elif prefills:
        groups, alone = group_prefills(prefills)
        s_groups = [(staging.add(g.gather, torch.int64), staging.add(g.valid, torch.int64),
                     staging.add(g.rows, torch.int64)) for g in groups]
    s_prompt = None
    if prompt_lengths:
        s_prompt = staging.add([it.request.num_prompt_tokens for it in items for _ in range(it.num_tokens)],
                               torch.int64)
    s_sample = None
    if sample_rows and [r for r, _ in sample_rows] != list(range(len(ids))):
        s_sample = staging.add([r for r, _ in sample_rows], torch.int64)
    sampling = SamplingPlan([r for _, r in sample_rows], vocab_size, staging, device) if sample_rows else None

    views = staging.upload()
    tables.apply(views[s_diff])
    if sampling is not None:
        sampling.bind(views)
    decode_bt = decode_mask = lens = None
    if nd:
        lens = views[s_lens]
        decode_bt = tables.gather(views[s_drows], decode_width)
        if attn is None:  # the PyTorch decode attention masks the padded keys
            decode_mask = (torch.arange(decode_width * bs, device=device)[None, :] >= lens[:, None])[:, None, :]
    prefill_batch = None
    if prefills:
        prefill_tables = tables.gather(views[s_prows], width)
        if s_batch is not None:
            prefill_batch = PrefillBatch(*(views[i] for i in s_batch), prefill_tables,
                                         max(c.length for c in prefills))
        else:
            for i, c in enumerate(prefills):
                if c.context_len:  # attends its cached context too: read back from its blocks
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
    return StepBatch(views[s_ids], views[s_pos], meta, sample_rows, views[s_sample] if s_sample is not None else None,
                     sampling, captures, steers, prompt_lp_rows)
