"""Causal attention over a paged KV cache, in plain PyTorch.

The batch is ragged: rows ``[0, num_decodes)`` are single-token decodes, answered together
by two batched matmuls over their gathered (padded, masked) contexts; each prefill chunk
after them gets its own SDPA call, against its cached context plus the chunk itself. The same
code runs on CPU and CUDA (where SDPA picks its flash or memory-efficient kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of new tokens, at rows ``[start, start + length)`` of the batch."""

    start: int
    length: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # blocks holding context and chunk; None when context_len == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query row may attend to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, max_blocks * block_size]: True where masked
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store the new ``k``/``v`` [T, Hkv, D] in the cache and attend ``q`` [T, H, D]; returns [T, H, D].

    ``k_cache``/``v_cache`` are head-major, ``[Hkv, num_blocks, block_size, D]``, so that
    gathering a sequence's blocks yields a contiguous ``[S, D]`` matrix per head.
    """
    num_kv, dim = k.shape[1], k.shape[2]
    k_cache.view(num_kv, -1, dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    # A freed block keeps its values, and padded or partly filled blocks are read with zero
    # attention weight; 0 * NaN is NaN, so a value that is not finite (one request's overflow)
    # must never reach the cache where another request could read it that way.
    v_cache.view(num_kv, -1, dim).index_copy_(1, meta.slot_mapping, _finite(v).transpose(0, 1))
    nd = meta.num_decodes
    if nd == q.shape[0]:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_len == 0:
            kc = k[rows].transpose(0, 1).unsqueeze(0)
            vc = v[rows].transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = chunk.context_len + chunk.length
            table = chunk.block_table.unsqueeze(0)
            kc = _gather(k_cache, table)[:, :, :total].transpose(0, 1)  # [1, Hkv, total, D]
            vc = _gather(v_cache, table)[:, :, :total].transpose(0, 1)
            qpos = torch.arange(chunk.context_len, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = oc.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query token per sequence, against its whole cached context; returns [B, H, D].

    Two batched matmuls with the query heads of each KV group folded together: on CPU this
    is several times faster than SDPA's flash kernel for a single query row (bfloat16 most).
    """
    b, h, d = q.shape
    kv_heads = k_cache.shape[0]
    kd = _gather(k_cache, meta.decode_block_tables)  # [Hkv, B, S, D], contiguous
    vd = _gather(v_cache, meta.decode_block_tables)
    qg = q.view(b, kv_heads, h // kv_heads, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * scale
    # masked_fill, not an added -inf bias: a stale key slot can make its score +inf or NaN.
    probs = scores.masked_fill_(meta.decode_mask, float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, vd).transpose(0, 1).reshape(b, h, d)


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
