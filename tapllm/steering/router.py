"""Steering at the router of a mixture-of-experts block: which ops go where, and the model's limits.

Two points of an MoE block steer (``tapllm.tap.points``), each ``[n_experts]`` per position:

* ``router_logits``, before the softmax and the top-k: ``ban`` sets the logits of ``experts`` to
  -inf (never chosen), ``force`` marks them +inf (always chosen: the top-k is taken among the
  other experts for the remaining slots, and a forced expert's weight is what the family gives its
  logit as the router computed it, renormalised over the chosen experts as the family does);
  ``add`` adds a bias vector ``[n_experts]`` (``scale``, ``set``, ``ablate`` and ``clamp`` act as
  on any point);
* ``routing_weights``, each expert's weight in the token's output (0 where not chosen), after the
  top-k: ``scale`` multiplies the chosen ``experts``' weights, which scales their outputs as the
  block adds them; ``ablate`` sets them to 0 (the experts still count as chosen, the others keep
  their weights: nothing is renormalised). ``experts=None``: every expert.

A model's limits (:class:`RouterLimits`) are checked when a request's steers are resolved: at most
``top_k`` experts forced, at least ``top_k`` left unbanned, never one expert both banned and
forced, and router steers only at blocks that have a router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tapllm.tap.points import MOE_STEER_POINTS

if TYPE_CHECKING:
    from tapllm.config import ModelConfig

# One resolved steer as the limits see it: its point, op, blocks and experts (None: every expert).
RouterSteer = tuple[str, str, Sequence[int], Sequence[int] | None]

ROUTER_OPS = ("ban", "force")  # the ops only router_logits takes
ROUTING_WEIGHT_OPS = ("scale", "ablate")  # the ops routing_weights takes


@dataclass(frozen=True, slots=True)
class RouterLimits:
    """What a mixture-of-experts model's routers allow: experts per block, experts per token, sparse blocks."""

    num_experts: int
    top_k: int
    sparse_layers: tuple[int, ...]


def router_limits(config: ModelConfig) -> RouterLimits | None:
    """The limits of the model ``config`` describes; None for a dense model."""
    from tapllm.models.shapes import experts_per_token, num_experts, sparse_layers  # the model code, on use

    n = num_experts(config)
    if not n:
        return None
    return RouterLimits(n, experts_per_token(config), sparse_layers(config))


def check_router_steer(point: str, op: str, experts: list[int] | None, vector: Any, values: Any) -> bool:
    """Check a steer that names a router point, a router op or ``experts``; ``ValueError`` names the field.

    Returns True when nothing else is to check but its layers (``ban``, ``force``, and the ops at
    ``routing_weights``), False when the steer is an ordinary op at ``router_logits`` (its vector or
    values are checked as at any point).
    """
    if op in ROUTER_OPS and point != "router_logits":
        raise ValueError(f"steering.op={op!r} applies at point 'router_logits' only, not {point!r}")
    if point not in MOE_STEER_POINTS:
        raise ValueError(f"steering.experts applies at 'router_logits' (op 'ban' or 'force') and at "
                         f"'routing_weights' (op 'scale' or 'ablate'), not at {point!r}")
    if point == "router_logits" and op not in ROUTER_OPS:
        if experts is not None:
            raise ValueError(f"steering.experts at 'router_logits' is for op 'ban' or 'force'; op={op!r} acts on "
                             "every expert's logit (give add a [n_experts] vector)")
        return False
    if point == "routing_weights" and op not in ROUTING_WEIGHT_OPS:
        raise ValueError(f"steering.op={op!r} is not valid at 'routing_weights': choose from "
                         f"{list(ROUTING_WEIGHT_OPS)}")
    if op in ROUTER_OPS and experts is None:
        raise ValueError(f"steering.experts is required for op={op!r}: the expert indices to {op}")
    if vector is not None or values is not None:
        field = "vector" if vector is not None else "values"
        raise ValueError(f"steering.{field} is not used by op={op!r} at {point!r}: experts= names the experts")
    return True


def check_routing(steers: Sequence[RouterSteer], limits: RouterLimits) -> None:
    """Check one request's resolved steers together against the model's routers (``steers[i]`` is steer
    ``i``'s point, op, blocks and experts, see :data:`RouterSteer`); ``ValueError`` names the steer."""
    banned: dict[int, set[int]] = {}
    forced: dict[int, set[int]] = {}
    for i, (point, op, blocks, experts) in enumerate(steers):
        if point not in MOE_STEER_POINTS:
            continue
        where = f"steering[{i}]"
        dense = [b for b in blocks if b not in limits.sparse_layers]
        if dense:
            raise ValueError(f"{where}.layers: block {dense[0]} has a dense MLP, no router (the blocks with one: "
                             f"{list(limits.sparse_layers)})")
        if op not in ROUTER_OPS:
            continue
        for block in blocks:
            ban, force = banned.setdefault(block, set()), forced.setdefault(block, set())
            (ban if op == "ban" else force).update(experts or ())
            both = sorted(ban & force)
            if both:
                raise ValueError(f"{where}.experts: expert {both[0]} is both banned and forced at block {block}")
            if len(force) > limits.top_k:
                raise ValueError(f"{where}.experts: {len(force)} experts forced at block {block}, more than the "
                                 f"{limits.top_k} each token is routed to (top_k)")
            if limits.num_experts - len(ban) < limits.top_k:
                raise ValueError(f"{where}.experts: {len(ban)} of {limits.num_experts} experts banned at block "
                                 f"{block}; at least top_k={limits.top_k} must stay")
