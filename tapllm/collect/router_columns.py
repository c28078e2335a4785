"""Routing data in a collected dataset (``tapllm collect --router``, a mixture-of-experts model): per token
row, at each captured block, the experts the token was routed to and their weights, compact.

Columns (like the points' ``[layers, hidden]``, with ``top_k`` in place of ``hidden``):

* ``expert_ids`` ``[layers, top_k]`` int16: the chosen experts' ids, largest weight first (ties by id);
* ``expert_weights`` ``[layers, top_k]`` float32: the weight each one's output is multiplied by (the
  ``routing_weights`` point's nonzero entries, after the family's renormalisation and any steer).

A dense block of an MoE model (Qwen2-MoE's ``mlp_only_layers``) has no router: ids -1, weights NaN. They are
read off the ``experts_chosen`` and ``routing_weights`` points, which the run captures for them (and does
not store).
"""

from __future__ import annotations

from typing import Any

import torch

ROUTER_SOURCES = ("experts_chosen", "routing_weights")  # the points the columns are read from


def router_columns(hs: Any, top_k: int) -> dict[str, torch.Tensor]:
    """A request's ``HiddenStates`` (holding :data:`ROUTER_SOURCES`, ``[positions, layers, n_experts]``) as the
    dataset's ``expert_ids`` and ``expert_weights`` columns, ``[positions, layers, top_k]``."""
    chosen, weights = hs["experts_chosen"], hs["routing_weights"].float()
    dense = chosen.isnan().any(-1, keepdim=True)  # [positions, layers, 1]
    ranked = torch.where(chosen == 1, weights, float("-inf"))
    ids = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :top_k]
    return {"expert_ids": ids.masked_fill(dense, -1).to(torch.int16).contiguous(),
            "expert_weights": weights.gather(-1, ids).masked_fill(dense, float("nan")).contiguous()}
