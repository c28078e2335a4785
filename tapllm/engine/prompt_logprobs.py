"""Prompt logprobs (vLLM's ``prompt_logprobs=N``), gathered chunk by chunk into preallocated CPU buffers.

For a prompt t_0..t_{p-1}, entry i (1 <= i < p) is the logprob of t_i given t_0..t_{i-1},
plus the N most likely tokens there: it comes from the logits at position i - 1. Each step
computes the rows of the positions it ran (``window``), in slices, on the model's device, and
copies the few numbers per position to the request's buffers; a high-water mark makes the
result exact after a prefix-cache hit (those positions are recomputed for this request: see
``first_needed``) and through preemption (a recomputed position is not written twice).
"""

from __future__ import annotations

import torch

from tapllm.outputs import Logprob

_SLICE = 256  # positions whose full-vocabulary logits exist at once


class PromptLogprobs:
    """One request's prompt logprobs: ``[p - 1]`` chosen logprobs and ranks, ``[p - 1, N]`` top ids and logprobs."""

    def __init__(self, prompt_token_ids: list[int], top: int) -> None:
        self.targets = torch.tensor(prompt_token_ids[1:], dtype=torch.long)
        n = len(self.targets)
        self.top = top
        self.chosen = torch.empty(n, dtype=torch.float32)
        self.rank = torch.empty(n, dtype=torch.long)
        self.top_ids = torch.empty((n, top), dtype=torch.long)
        self.top_lp = torch.empty((n, top), dtype=torch.float32)
        self.next_pos = 0  # logits positions below this are done

    @property
    def end(self) -> int:
        """One past the last logits position needed (the prompt's second-to-last token)."""
        return len(self.targets)

    def first_needed(self, num_tokens: int) -> int:
        """The first position this request still has to run for its prompt logprobs (``num_tokens``: none)."""
        return self.next_pos if self.next_pos < self.end else num_tokens

    def window(self, start: int, num_tokens: int) -> tuple[int, int] | None:
        """Logits positions ``[a, b)`` to use from a chunk running ``[start, start + num_tokens)``."""
        a, b = max(start, self.next_pos), min(start + num_tokens, self.end)
        return (a, b) if a < b else None

    def consume(self, hidden: torch.Tensor, a: int, b: int, logits_fn) -> None:
        """Fold in the final hidden rows ``[b - a, hidden]`` of positions ``[a, b)``."""
        for lo in range(a, b, _SLICE):
            hi = min(b, lo + _SLICE)
            lp = logits_fn(hidden[lo - a : hi - a]).float().log_softmax(-1)
            targets = self.targets[lo:hi].to(lp.device)
            chosen = lp.gather(1, targets[:, None])
            self.chosen[lo:hi].copy_(chosen[:, 0])
            self.rank[lo:hi].copy_((lp > chosen).sum(-1) + 1)
            if self.top:
                vals, ids = lp.topk(self.top, dim=-1)
                self.top_lp[lo:hi].copy_(vals)
                self.top_ids[lo:hi].copy_(ids)
        self.next_pos = max(self.next_pos, b)

    def result(self) -> list[dict[int, Logprob] | None]:
        """vLLM's form: ``None`` for the first prompt token, then ``{token_id: Logprob}`` per token."""
        out: list[dict[int, Logprob] | None] = [None]
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        top_ids, top_lp = self.top_ids.tolist(), self.top_lp.tolist()
        for i, target in enumerate(self.targets.tolist()):
            entry = {target: Logprob(chosen[i], rank[i])}
            for r, (tid, v) in enumerate(zip(top_ids[i], top_lp[i]), start=1):
                entry.setdefault(tid, Logprob(v, r))
            out.append(entry)
        return out
