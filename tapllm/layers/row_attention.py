"""Attention one query row at a time, in plain PyTorch: the eager step's ``batch_invariant`` path.

A batched matmul or SDPA call reduces over a padded key length and picks its kernel by the batch's
shapes, so a row's result depends on what shares its call. Here each row is computed alone over
exactly the keys it sees (its cached context up to its own position, inside its window), with shapes
that depend on that row only: the same token gets the same bits in a prefill chunk of any size and
in a decode step. It is slow (a few small calls per row and layer): the reference, not the fast path
(the CPU backend's kernels keep the same property at speed, see ``tapllm.kernels.invariance``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# A sequence's rows in the step: (first batch row, its position, rows, block table covering them).
Rows = tuple[int, int, int, torch.Tensor]


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sequences: Iterable[Rows],
                scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Every row of ``sequences`` in the step's ``q`` ``[T, H, D]`` over its sequence's cached keys (written
    already), each alone: ``[T, H, D]``. ``window``, ``softcap``: as ``AttentionOptions`` has them."""
    out = torch.empty_like(q)
    for row, first, n, table in sequences:
        keys, values = _sequence(k_cache, v_cache, table, first + n)
        for j in range(n):
            out[row + j] = _row(q[row + j], keys, values, first + j, scale, window, softcap)
    return out


def row_probs(q: torch.Tensor, keys: torch.Tensor, first: int, scale: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    """:func:`~tapllm.layers.attention.attention_probs` row by row: float32 ``[n, H, S]`` of queries at
    positions ``first..`` over ``keys`` ``[Hkv, S, D]``, each softmax over exactly the keys its row sees."""
    n, h, _ = q.shape
    keys = keys.repeat_interleave(h // keys.shape[0], dim=0).float()
    out = q.new_zeros((n, h, keys.shape[1]), dtype=torch.float32)
    for i in range(n):
        lo, hi = _seen(first + i, window)
        scores = torch.einsum("hd,hkd->hk", q[i].float().contiguous(), keys[:, lo:hi].contiguous()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[i, :, lo:hi] = scores.softmax(-1)
    return out


def _seen(pos: int, window: int | None) -> tuple[int, int]:
    """The keys ``[lo, hi)`` a query at ``pos`` attends to."""
    return (0 if window is None else max(0, pos - window + 1)), pos + 1


def _sequence(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ``length`` cached keys and values, ``[Hkv, length, D]`` each."""
    blocks = table[: -(-length // k_cache.shape[2])]
    h, d = k_cache.shape[0], k_cache.shape[3]
    return tuple(c.index_select(1, blocks).reshape(h, -1, d)[:, :length] for c in (k_cache, v_cache))


def _row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float, window: int | None,
         softcap: float | None) -> torch.Tensor:
    """One query row ``[H, D]`` at ``pos`` over the keys it sees, as the eager decode attention computes it
    (scores in float32, probabilities rounded to the dtype), with shapes that depend on ``pos`` alone."""
    lo, hi = _seen(pos, window)
    k, v = keys[:, lo:hi].contiguous(), values[:, lo:hi].contiguous()
    qg = q.reshape(k.shape[0], -1, q.shape[-1]).contiguous()  # [Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.matmul(scores.softmax(-1).to(q.dtype), v).reshape(q.shape)
