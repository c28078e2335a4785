"""Token frequencies of the supervised tokens and the draft-vocabulary mapping EAGLE-3 drafters use.

A drafter predicts over a smaller vocabulary: the ``draft_vocab_size`` tokens most frequent
among the loss-masked (assistant) tokens of its training data. Two tensors map between them:
``d2t[i]`` is the offset from draft id ``i`` to its target id (``target = i + d2t[i]``), and
``t2d`` is a boolean mask over the target vocabulary of the tokens kept. Built here as
speculators' ``build_vocab_mappings_from_distribution`` builds them: most frequent first, ties
to the smaller id, topped up with the smallest unused ids when fewer tokens were seen, kept
ids in increasing order.
"""

from __future__ import annotations

import torch


def count_tokens(counts: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Add the tokens ``ids`` where ``mask`` is set into ``counts`` (int64, one per vocabulary id)."""
    kept = ids[mask.bool()].long()
    if kept.numel() and int(kept.max()) >= counts.numel():
        raise ValueError(f"token id {int(kept.max())} is outside the vocabulary of {counts.numel()} tokens")
    counts += torch.bincount(kept, minlength=counts.numel())


def frequency_dict(counts: torch.Tensor) -> dict[int, int]:
    """``{token id: count}`` of the tokens seen (what speculators' ``token_freq.pt`` holds)."""
    seen = torch.nonzero(counts).flatten()
    return dict(zip(seen.tolist(), counts[seen].tolist()))


def draft_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for a draft vocabulary of ``draft_vocab_size`` tokens (see the module docstring)."""
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab}] (the target vocabulary), got {draft_vocab_size}")
    seen = torch.nonzero(counts).flatten()
    # most frequent first, ties to the smaller id: sort by id, then stably by count
    order = seen[torch.argsort(-counts[seen], stable=True)]
    chosen = order[:draft_vocab_size].tolist()
    if len(chosen) < draft_vocab_size:
        taken = set(chosen)
        chosen += [t for t in range(vocab) if t not in taken][: draft_vocab_size - len(chosen)]
    kept = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
