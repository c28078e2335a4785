"""Causal attention over a paged KV cache, in plain PyTorch (SDPA).

The batch is ragged: rows ``[0, num_decodes)`` are single-token decodes, answered by one
padded SDPA call; each prefill chunk after them is answered by its own SDPA call against its
cached context plus the chunk itself. The same code runs on CPU and CUDA.
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
    block_table: torch.Tensor | None  # blocks holding the context, None when context_len == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query row may attend to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf
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

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]``.
    """
    num_kv, dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv, dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv, dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
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
            kc = _gather(k_cache, table)[:, :, :total]
            vc = _gather(v_cache, table)[:, :, :total]
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
    kv_heads = k_cache.shape[2]
    kd = _gather(k_cache, meta.decode_block_tables)  # [B, Hkv, S, D]
    vd = _gather(v_cache, meta.decode_block_tables)
    qg = q.view(b, kv_heads, h // kv_heads, d)
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * scale + meta.decode_bias
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, vd).view(b, h, d)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Gather blocks ``[B, nb]`` of ``cache`` into ``[B, Hkv, nb * block_size, D]``."""
    b, nb = block_tables.shape
    num_blocks, bs, h, d = cache.shape
    # index_select on a 2-D view is several times faster than advanced indexing here.
    flat = cache.view(num_blocks, bs * h * d).index_select(0, block_tables.reshape(-1))
    return flat.view(b, nb * bs, h, d).transpose(1, 2)
