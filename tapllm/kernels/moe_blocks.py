"""A step's (token, choice) pairs sorted by expert on the device, in blocks of one expert each, with
static shapes: what the fused mixture-of-experts kernels (:mod:`tapllm.kernels.triton_moe`) read.

No value goes to the host (a CUDA graph can hold it): every shape depends on the pair count
``T * top_k``, the expert count and the block size only. Each expert's rows are padded up to a
multiple of ``block_m``, so a block of rows belongs to one expert; the padding holds the sentinel
``T * top_k`` (no pair), and the blocks past the last expert's rows belong to none (-1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PairBlocks(NamedTuple):
    """The pairs of a step in expert blocks (see the module docstring)."""

    sorted_pairs: torch.Tensor  # [max_padded] int32: the pair (``t * top_k + j``) at each slot, or the sentinel
    block_expert: torch.Tensor  # [max_padded // block_m] int32: each block's expert, -1 for an unused block
    pair_slot: torch.Tensor  # [T * top_k] int64: each pair's slot


def max_padded(pairs: int, num_experts: int, block_m: int) -> int:
    """The slots any routing of ``pairs`` pairs can need: every expert padded by up to ``block_m - 1``."""
    return -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m


def pair_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """The ``[T, top_k]`` chosen expert ``ids`` as :class:`PairBlocks`: the pairs of each expert in
    token order (a stable sort), from a slot that starts a block; the experts in ascending order."""
    flat = ids.reshape(-1)
    n = flat.numel()
    experts = torch.arange(num_experts, device=ids.device)
    hits = (flat[:, None] == experts[None, :]).to(torch.int32)  # [n, E]: a one-hot row per pair
    counts = hits.sum(0, dtype=torch.int64)
    # a pair's rank among its expert's pairs: how many earlier pairs chose it (exact integer sums)
    rank = (hits.cumsum(0, dtype=torch.int64) - hits).gather(1, flat[:, None]).squeeze(1)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    pair_slot = (ends - padded)[flat] + rank
    size = max_padded(n, num_experts, block_m)
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, pair_slot, torch.arange(n, dtype=torch.int32, device=ids.device))
    starts = torch.arange(0, size, block_m, device=ids.device)
    owner = torch.searchsorted(ends, starts, right=True)  # the first expert whose padded rows end past the block
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return PairBlocks(sorted_pairs, block_expert, pair_slot)
