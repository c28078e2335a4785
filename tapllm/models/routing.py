"""A mixture-of-experts block's routing: how a family turns its router's logits into the chosen experts
and their weights (:class:`Routing`, :func:`route`), and the same seen through the tap.

When a step's tap touches a sparse block, :func:`tapped_route` replaces :func:`route`
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

Without steers the result is bit for bit :func:`route`'s. A dense block of an MoE
model (:func:`dense_router_points`) taps the same points as NaN rows, so a capture over every block
keeps its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapllm.tap import Tap

ROUTER_POINTS = ("router_logits", "router_probs", "routing_weights", "experts_chosen")


@dataclass(frozen=True, slots=True)
class Routing:
    """How a family's router turns logits into the chosen experts and their weights."""

    num_experts: int
    top_k: int
    renormalize: bool  # divide the chosen experts' probabilities by their sum (``norm_topk_prob``; Mixtral always)
    float_weights: bool = False  # scale the experts' outputs by float32 weights (Mixtral), else in the model's dtype
    topk_first: bool = False  # gpt-oss: the top-k of the logits, then a softmax over them (in the logits' dtype)


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, each ``[T, top_k]``: the softmax over every expert (in float32), its top-k,
    renormalised over the chosen ones where the family does (or, ``topk_first``, the softmax of the top-k
    logits)."""
    if routing.topk_first:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if routing.float_weights else weights.to(logits.dtype)), ids


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
    """Tap every router and expert point of a dense block ``layer`` as NaN rows (it has no router, no
    experts): ``[T, n_experts]``, ``expert_out`` ``[T, n_experts, hidden]`` (only where the tap wants it) and
    ``shared_expert_out`` ``[T, hidden]``."""
    nan = x.new_full((x.shape[0], num_experts), float("nan"))
    for point in ROUTER_POINTS:
        tap(point, layer, nan.clone())
    if tap.wants("expert_out", layer):
        tap("expert_out", layer, x.new_full((x.shape[0], num_experts, x.shape[1]), float("nan")))
    if tap.wants("shared_expert_out", layer):
        tap("shared_expert_out", layer, torch.full_like(x, float("nan")))
