"""Causal attention over a paged KV cache, in plain PyTorch.

The batch is ragged: rows ``[0, num_decodes)`` are single-token decodes, answered together
by two batched matmuls over their gathered (padded, masked) contexts. Prefill chunks with no
cached context (fresh prompts) of similar lengths share one SDPA call over a right-padded
``[count, length]`` batch (causal masking alone keeps real rows off the padding), so many
short prompts do not cost one call each per layer; a chunk that continues a cached context
gets its own SDPA call against that context plus itself. The same code runs on CPU and CUDA
(where SDPA picks its flash or memory-efficient kernels).

Per layer, :class:`AttentionOptions` may add a sliding window (a query at position i sees
keys i - window < j <= i, as transformers masks it) and logit soft-capping (Gemma-2:
``tanh(s / cap) * cap`` before the softmax, computed without SDPA, which cannot do it).
Blocks whose keys have all left every layer's window stay in the cache: the prefix cache may
still serve them, and a model with global layers needs them anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tapllm.backends.ops import AttentionOps
from tapllm.layers.row_attention import attend_rows, row_probs


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens, at rows ``[start, start + length)`` of the batch."""

    start: int
    length: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # blocks holding context and chunk; None when context_len == 0


@dataclass(slots=True)
class PrefillGroup:
    """Fresh prompts attended in one SDPA call, right-padded to ``[count, length]``."""

    count: int
    length: int
    gather: torch.Tensor  # [count * length] batch row feeding each padded slot (padding repeats a real row)
    valid: torch.Tensor  # [n] padded slots holding real rows
    rows: torch.Tensor  # [n] batch rows those real slots go back to


@dataclass(slots=True)
class PrefillBatch:
    """Every prefill chunk of a step as tensors, for the fused prefill-attention kernel."""

    starts: torch.Tensor  # [chunks] first batch row of each chunk
    lens: torch.Tensor  # [chunks] its tokens
    contexts: torch.Tensor  # [chunks] tokens cached before it
    tables: torch.Tensor  # [chunks, blocks] its sequence's blocks, zero-padded
    max_len: int  # the longest chunk (sizes a kernel's grid without reading ``lens``)

    @classmethod
    def build(cls, chunks: list[PrefillChunk], tables: list[list[int]], device: torch.device,
              max_len: int | None = None) -> PrefillBatch:
        """From the step's chunks and each one's block table (covering context and chunk)."""
        width = max(len(t) for t in tables)
        return cls(torch.tensor([c.start for c in chunks], device=device),
                   torch.tensor([c.length for c in chunks], device=device),
                   torch.tensor([c.context_len for c in chunks], device=device),
                   torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
                   max(c.length for c in chunks) if max_len is None else max_len)


@dataclass(slots=True)
class UnifiedBatch:
    """A graph step's sequences for the attention kernel that serves decodes and prefill chunks in one launch.

    Sequence ``s`` owns batch rows ``cu_q[s] .. cu_q[s + 1] - 1``, its row ``j`` at position ``ctx[s] + j``;
    its blocks are row ``seq_rows[s]`` of ``table`` (the engine's block table, read in place).
    """

    cu_q: torch.Tensor  # [S + 1]
    ctx: torch.Tensor  # [S]
    seq_rows: torch.Tensor  # [S]
    table: torch.Tensor  # [slots, width]


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """How one layer attends: its score scale, sliding window and logit soft-cap."""

    scale: float
    window: int | None = None  # a query at position i sees keys i - window < j <= i
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap before the softmax
    invariant: bool = False  # batch_invariant: PyTorch attends (and patterns) one row at a time (row_attention.py)
    # gpt-oss: a learned logit per query head [H] joining every softmax's denominator (a "sink" no value reads);
    # the PyTorch paths only (a model with sinks runs the eager step)
    sinks: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query row may attend to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, max_blocks * block_size]: True where masked
    prefills: list[PrefillChunk]  # chunks attended one by one
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    decode_lens: torch.Tensor | None = None  # [num_decodes] context length of each decode row
    prompt_lens: torch.Tensor | None = None  # [T] prompt length of each row's request (models that ask)
    attn: AttentionOps | None = None  # the backend's paged-attention kernels; None: the PyTorch code here
    prefill_batch: PrefillBatch | None = None  # the prefill chunks as tensors, when ``attn`` attends them
    unified: UnifiedBatch | None = None  # a graph step's sequences: one kernel attends every row
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_mask_for(self, window: int | None) -> torch.Tensor:
        """The decode mask, plus keys that left ``window`` (made once per step and window)."""
        if window is None:
            return self.decode_mask
        mask = self._window_masks.get(window)
        if mask is None:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            old = keys[None, :] <= (self.decode_lens[:, None] - 1 - window)
            mask = self._window_masks[window] = self.decode_mask | old[:, None, :]
        return mask


# Padding costs attention work (quadratic in the padded length); below this length a prompt's
# attention is so cheap that the saved per-call overhead always wins.
_ALWAYS_GROUP = 64
_MAX_PADDING_WORK = 1.3  # a group may do at most this much more attention work than its prompts need


@dataclass(slots=True)
class GroupPlan:
    """A :class:`PrefillGroup` as host lists, before the step's upload turns them into tensors."""

    count: int
    length: int
    gather: list[int]
    valid: list[int]
    rows: list[int]


def group_prefills(chunks: list[PrefillChunk]) -> tuple[list[GroupPlan], list[PrefillChunk]]:
    """Split prefill chunks into padded groups of fresh prompts and chunks attended alone."""
    fresh = sorted((c for c in chunks if c.context_len == 0), key=lambda c: -c.length)
    alone = [c for c in chunks if c.context_len != 0]
    groups: list[GroupPlan] = []
    i = 0
    while i < len(fresh):
        longest = fresh[i].length
        members, work = [fresh[i]], longest * longest
        for c in fresh[i + 1 :]:
            if longest > _ALWAYS_GROUP and (len(members) + 1) * longest**2 > _MAX_PADDING_WORK * (work + c.length**2):
                break
            members.append(c)
            work += c.length**2
        i += len(members)
        if len(members) == 1:
            alone.append(members[0])
            continue
        gather, valid, rows = [], [], []
        for m, c in enumerate(members):
            span = list(range(c.start, c.start + c.length))
            gather.extend(span + [span[-1]] * (longest - c.length))
            valid.extend(range(m * longest, m * longest + c.length))
            rows.extend(span)
        groups.append(GroupPlan(len(members), longest, gather, valid, rows))
    return groups, alone


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    opts: AttentionOptions,
    write_kv: bool = True,
) -> torch.Tensor:
    """Store the new ``k``/``v`` [T, Hkv, D] in the cache and attend ``q`` [T, H, D]; returns [T, H, D].

    ``k_cache``/``v_cache`` are head-major, ``[Hkv, num_blocks, block_size, D]``, so that
    gathering a sequence's blocks yields a contiguous ``[S, D]`` matrix per head.
    ``write_kv=False``: the caller has already stored ``k``/``v`` at ``meta.slot_mapping`` as
    ``meta.attn.kv_write`` would (rotary fused with the write); only with ``meta.attn``.
    """
    num_kv, dim = k.shape[1], k.shape[2]
    if not write_kv:
        if meta.attn is None:
            raise ValueError("paged_attention: write_kv=False needs meta.attn (kernels that read the cache in place)")
    elif meta.attn is not None:
        meta.attn.kv_write(k, v, k_cache, v_cache, meta.slot_mapping)  # zeroes non-finite V as below
    else:
        k_cache.view(num_kv, -1, dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        # A freed block keeps its values, and padded or partly filled blocks are read with zero
        # attention weight; 0 * NaN is NaN, so a value that is not finite (one request's overflow)
        # must never reach the cache where another request could read it that way.
        v_cache.view(num_kv, -1, dim).index_copy_(1, meta.slot_mapping, _finite(v).transpose(0, 1))
    if opts.sinks is not None and (meta.attn is not None or opts.invariant):
        raise ValueError("attention sinks are computed by the PyTorch attention only (the eager step)")
    if meta.attn is None and opts.invariant:
        return attend_rows(q, k_cache, v_cache, _sequences(meta), opts.scale, opts.window, opts.softcap)
    if meta.unified is not None:
        u = meta.unified
        return meta.attn.unified_attention(q, k_cache, v_cache, u.table, u.seq_rows, u.cu_q, u.ctx, opts.scale,
                                           opts.window or 0, opts.softcap or 0.0)
    nd = meta.num_decodes
    if nd == q.shape[0]:
        return _decode_attention(q, k_cache, v_cache, meta, opts)
    if meta.prefill_batch is not None:  # the fused kernel reads every chunk's keys from the cache in place
        pb = meta.prefill_batch
        out = meta.attn.prefill_attention(q, k_cache, v_cache, pb.starts, pb.lens, pb.contexts, pb.tables,
                                          opts.scale, opts.window or 0, opts.softcap or 0.0, pb.max_len)
        if nd:
            out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, opts)
        return out
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, opts)
    for g in meta.prefill_groups:
        def padded(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, g.gather).view(g.count, g.length, x.shape[1], dim).transpose(1, 2)

        og = _attend(padded(q), padded(k), padded(v), 0, opts)  # [count, H, length, D]
        og = og.transpose(1, 2).reshape(g.count * g.length, q.shape[1], dim).index_select(0, g.valid)
        out.index_copy_(0, g.rows, og)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_len == 0:
            kc = k[rows].transpose(0, 1).unsqueeze(0)
            vc = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            total = chunk.context_len + chunk.length
            table = chunk.block_table.unsqueeze(0)
            kc = _gather(k_cache, table)[:, :, :total].transpose(0, 1)  # [1, Hkv, total, D]
            vc = _gather(v_cache, table)[:, :, :total].transpose(0, 1)
        out[rows] = _attend(qc, kc, vc, chunk.context_len, opts).squeeze(0).transpose(0, 1)
    return out


def _sequences(meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor]]:
    """The step's rows as :func:`attend_rows` takes them: decode rows, then chunks (each with its block table)."""
    lens = meta.decode_lens.tolist() if meta.num_decodes else []
    out = [(r, lens[r] - 1, 1, meta.decode_block_tables[r]) for r in range(meta.num_decodes)]
    return out + [(c.start, c.context_len, c.length, c.block_table) for c in meta.prefills]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, opts: AttentionOptions) -> torch.Tensor:
    """Causal attention of queries at positions ``context..`` over keys ``0..``: [B, H, n, D] -> [B, H, n, D]."""
    n, total = q.shape[2], k.shape[2]
    plain = opts.softcap is None and opts.sinks is None
    if plain and context == 0 and opts.window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=opts.scale, enable_gqa=True)
    qpos = torch.arange(context, context + n, device=q.device)[:, None]
    keys = torch.arange(total, device=q.device)[None, :]
    allowed = keys <= qpos
    if opts.window is not None:
        allowed &= keys > qpos - opts.window
    if plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=opts.scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * opts.scale
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    sinks = opts.sinks.view(1, -1, 1, 1) if opts.sinks is not None else None
    probs = _softmax(scores.masked_fill_(~allowed, float("-inf")), sinks).to(q.dtype)
    return torch.matmul(probs, v)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last dimension of float32 ``scores``; with ``sinks`` (broadcast over the
    scores' rows) each row's sink logit joins the denominator and its weight is dropped."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, opts: AttentionOptions
) -> torch.Tensor:
    """One query token per sequence, against its whole cached context; returns [B, H, D].

    With the backend's kernels, one kernel reads each sequence's K/V blocks in place. Else two
    batched matmuls over the gathered context, with the query heads of each KV group folded
    together: on CPU several times faster than SDPA's flash kernel for a single query row.
    """
    if meta.attn is not None:
        return meta.attn.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                             opts.scale, opts.window or 0, opts.softcap or 0.0)
    b, h, d = q.shape
    kv_heads = k_cache.shape[0]
    kd = _gather(k_cache, meta.decode_block_tables)  # [Hkv, B, S, D], contiguous
    vd = _gather(v_cache, meta.decode_block_tables)
    qg = q.view(b, kv_heads, h // kv_heads, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * opts.scale
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    # masked_fill, not an added -inf bias: a stale key slot can make its score +inf or NaN.
    sinks = opts.sinks.view(kv_heads, 1, h // kv_heads, 1) if opts.sinks is not None else None
    probs = _softmax(scores.masked_fill_(meta.decode_mask_for(opts.window), float("-inf")), sinks).to(q.dtype)
    return torch.matmul(probs, vd).transpose(0, 1).reshape(b, h, d)


def gather_keys(k_cache: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached keys ``[Hkv, length, D]``, from its block table."""
    bs = k_cache.shape[2]
    table = torch.tensor(block_table[: -(-length // bs)], device=k_cache.device)
    return _gather(k_cache, table[None])[:, 0, :length]


def attention_probs(q: torch.Tensor, keys: torch.Tensor, first: int, opts: AttentionOptions) -> torch.Tensor:
    """Softmax attention weights (float32) of queries ``q`` ``[n, H, D]`` at positions ``first..`` over
    ``keys`` ``[Hkv, S, D]`` (positions ``0..S-1``), masked as the layer masks them: ``[n, H, S]``."""
    if opts.invariant:
        return row_probs(q, keys, first, opts.scale, opts.window, opts.softcap)
    n, h, _ = q.shape
    keys = keys.repeat_interleave(h // keys.shape[0], dim=0)  # one key head per query head
    scores = torch.einsum("nhd,hkd->nhk", q.float(), keys.float()) * opts.scale
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    qpos = torch.arange(first, first + n, device=q.device)[:, None]
    kpos = torch.arange(keys.shape[1], device=q.device)[None, :]
    allowed = kpos <= qpos
    if opts.window is not None:
        allowed &= kpos > qpos - opts.window
    sinks = opts.sinks.view(1, -1, 1) if opts.sinks is not None else None
    return _softmax(scores.masked_fill_(~allowed[:, None, :], float("-inf")), sinks)


def _finite(v: torch.Tensor) -> torch.Tensor:
    """``v`` with NaN and infinities replaced by 0 (``v`` itself when all are finite)."""
    return torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Gather blocks ``[B, nb]`` of a head-major cache into ``[Hkv, B, nb * block_size, D]``."""
    b, nb = block_tables.shape
    h, num_blocks, bs, d = cache.shape
    idx = block_tables.reshape(-1)
    out = cache.new_empty(h, b * nb, bs * d)
    # index_select along dim 0 of each head's 2-D view is several times faster than advanced
    # indexing, or than selecting along dim 1 of the whole cache.
    for head in range(h):
        torch.index_select(cache[head].view(num_blocks, bs * d), 0, idx, out=out[head])
    return out.view(h, b, nb * bs, d)
