"""The router of a mixture-of-experts block seen through the tap: its points, and its steers applied.

When a step's tap touches a sparse block, :func:`tapped_route` replaces :func:`~tapllm.models.moe.route`
and passes the router's tensors through the tap, each ``[T, n_experts]``:

* ``router_logits`` (before it is called here: the block taps them as the router computes them) may
  carry steers: ``ban`` leaves -inf at an expert (never chosen), ``force`` +inf (always chosen;
  its weight comes from its logit as the router computed it, ``raw``);
* ``router_probs``: the softmax over every expert in float32 (capture only). For the families
  that take the top-k of these probabilities (Mixtral, Qwen-MoE, OLMoE) it is exactly what they
  rank; gpt-oss ranks its logits and takes a softmax over the chosen ones only, so there it is
  the softmax over all experts that transformers' load-balancing loss reads;
* ``routing_weights``: each expert's weight in the token's output, 0 where not chosen, in the
  dtype the experts are scaled in; a steer there (``scale``, ``ablate``) changes what the chosen
  experts' outputs are multiplied by;
* ``experts_chosen``: 1 where the token is routed, else 0 (capture only).

Without steers the result is bit for bit :func:`~tapllm.models.moe.route`'s. A dense block of an MoE
model (:func:`dense_router_points`) taps the same points as NaN rows, so a capture over every block
keeps its shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tapllm.tap import Tap

if TYPE_CHECKING:
    from tapllm.models.moe import Routing

ROUTER_POINTS = ("router_logits", "router_probs", "routing_weights", "experts_chosen")


def tapped_route(raw: torch.Tensor, logits: torch.Tensor, routing: Routing, tap: Tap, layer: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` ``[T, top_k]`` from the tapped ``logits`` (``raw``: before its steers), the other
    router points passed through ``tap`` at block ``layer`` (see the module docstring)."""
    forced = torch.isposinf(logits)
    eff = torch.where(forced, raw, logits)  # a forced expert's weight: from its logit as computed
    probs = tap("router_probs", layer, torch.softmax(eff, dim=-1, dtype=torch.float32))
    k = routing.top_k
    if routing.topk_first:
        ids = torch.topk(eff.masked_fill(forced, float("inf")), k, dim=-1).indices
        top = eff.gather(1, ids)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    else:
        ids = torch.topk(probs.masked_fill(forced, 2.0), k, dim=-1).indices  # forced first: a probability is <= 1
        weights = probs.gather(1, ids)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not routing.float_weights:
            weights = weights.to(logits.dtype)
    dense = torch.zeros(logits.shape, dtype=weights.dtype, device=logits.device).scatter_(1, ids, weights)
    weights = tap("routing_weights", layer, dense).gather(1, ids)
    tap("experts_chosen", layer, torch.zeros_like(logits).scatter_(1, ids, 1.0))
    return weights, ids


def dense_router_points(x: torch.Tensor, num_experts: int, tap: Tap, layer: int) -> None:
    """Tap every router point of a dense block ``layer`` as NaN rows (it has no router)."""
    nan = x.new_full((x.shape[0], num_experts), float("nan"))
    for point in ROUTER_POINTS:
        tap(point, layer, nan.clone())
