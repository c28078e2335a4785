"""Attention one query row at a time, in plain PyTorch: the eager step's ``batch_invariant`` path.

A batched matmul or SDPA call reduces over a padded key length and picks its kernel by the batch's
shapes, so a row's result depends on what shares its call. Here each row is computed alone over
exactly the keys it sees (its cached context up to its own position, inside its window), with shapes
that depend on that row only: the same token gets the same bits in a prefill chunk of any size and
in a decode step. It is slow (a few small calls per row and layer): the reference, not the fast path
(the CPU backend's kernels keep the same property at speed, see ``tapllm.kernels.invariance``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tapllm.layers.attention import AttentionMetadata, AttentionOptions


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
    """Every row of the step's ``q`` ``[T, H, D]`` over its sequence's cached keys (written already): ``[T, H, D]``.

    Needs the block table of every prefill chunk (``PrefillChunk.block_table``), fresh prompts' too.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        lens = meta.decode_lens.tolist()
        for r in range(nd):
            keys, values = _sequence(k_cache, v_cache, meta.decode_block_tables[r], lens[r])
            out[r] = _row(q[r], keys, values, lens[r] - 1, opts)
    for chunk in meta.prefills:
        keys, values = _sequence(k_cache, v_cache, chunk.block_table, chunk.context_len + chunk.length)
        for j in range(chunk.length):
            out[chunk.start + j] = _row(q[chunk.start + j], keys, values, chunk.context_len + j, opts)
    return out


def row_probs(q: torch.Tensor, keys: torch.Tensor, first: int, opts: AttentionOptions) -> torch.Tensor:
    """:func:`~tapllm.layers.attention.attention_probs` row by row: float32 ``[n, H, S]`` of queries at
    positions ``first..`` over ``keys`` ``[Hkv, S, D]``, each softmax over exactly the keys its row sees."""
    n, h, _ = q.shape
    keys = keys.repeat_interleave(h // keys.shape[0], dim=0).float()
    out = q.new_zeros((n, h, keys.shape[1]), dtype=torch.float32)
    for i in range(n):
        lo, hi = _seen(first + i, opts)
        scores = torch.einsum("hd,hkd->hk", q[i].float().contiguous(), keys[:, lo:hi].contiguous()) * opts.scale
        if opts.softcap is not None:
            scores = torch.tanh(scores / opts.softcap) * opts.softcap
        out[i, :, lo:hi] = scores.softmax(-1)
    return out


def _seen(pos: int, opts: AttentionOptions) -> tuple[int, int]:
    """The keys ``[lo, hi)`` a query at ``pos`` attends to."""
    return (0 if opts.window is None else max(0, pos - opts.window + 1)), pos + 1


def _sequence(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``length`` cached keys and values, ``[Hkv, length, D]`` each."""
    blocks = table[: -(-length // k_cache.shape[2])]
    h, d = k_cache.shape[0], k_cache.shape[3]
    return tuple(c.index_select(1, blocks).reshape(h, -1, d)[:, :length] for c in (k_cache, v_cache))


def _row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, opts: AttentionOptions) -> torch.Tensor:
    """One query row ``[H, D]`` at ``pos`` over the keys it sees, as the eager decode attention computes it
    (scores in float32, probabilities rounded to the dtype), with shapes that depend on ``pos`` alone."""
    lo, hi = _seen(pos, opts)
    k, v = keys[:, lo:hi].contiguous(), values[:, lo:hi].contiguous()
    qg = q.reshape(k.shape[0], -1, q.shape[-1]).contiguous()  # [Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * opts.scale
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    return torch.matmul(scores.softmax(-1).to(q.dtype), v).reshape(q.shape)
