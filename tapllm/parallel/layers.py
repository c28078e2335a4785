"""The layers whose output needs the other ranks: row-parallel linears, the vocabulary-parallel
embedding and LM head, norms over every head. Column-parallel projections (q/k/v, gate/up) need no layer of their own:
a rank's :class:`~tapllm.layers.linear.Linear` simply holds its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.layers.linear import Linear
from tapllm.layers.norm import RMSNorm
from tapllm.parallel.group import TPGroup


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the inputs (o_proj, down_proj): partial sums all-reduced,
    then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: TPGroup) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.project(x, None).contiguous())
        return y if self.bias is None else y + self.bias


class GatheredHead(Linear):
    """The LM head over this rank's vocabulary rows; the logits of every rank gathered in vocabulary order
    (``sizes``: every rank's rows, where they differ)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: TPGroup,
                 sizes: list[int] | None = None) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.group = group
        self.sizes = sizes if sizes is not None and len(set(sizes)) > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.project(x, self.bias), dim=-1, sizes=self.sizes)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the embedding table; each token's row comes from
    the rank that holds it (the others add zeros in the all-reduce)."""

    def __init__(self, rows: int, dim: int, start: int, dtype: torch.dtype, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype), requires_grad=False)
        self.start, self.rows = start, rows
        self.embedding_dim = dim
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x.contiguous())


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a width split across the ranks (OLMo-2's q/k norms over every head): each rank
    scales its part by the mean square of the whole, its sum of squares all-reduced and divided by
    ``width``, the sum of every rank's width. Where KV heads are replicated, each rank's part counts
    as many times as it is held, and so does its width, so the quotient is still the mean over the
    distinct heads. Float32 arithmetic, as :class:`~tapllm.layers.norm.RMSNormScaledInFloat32`."""

    def __init__(self, norm: RMSNorm, group: TPGroup, width: int) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.group = group
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = self.group.all_reduce(h.pow(2).sum(-1, keepdim=True).contiguous())
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * h).to(x.dtype)
