"""The one table of named points: what each means, its group, whether it steers, its row shape.

Names follow TransformerLens' hook names. A point means the same thing in every family:
``attn_out``/``mlp_out`` are exactly what the sublayer adds to the residual stream, ``embed``
is the residual stream entering block 0 and ``final`` what the unembedding reads. The row
shape of one position at one layer is written with the model's dimensions (``hidden``,
``heads``, ``kv_heads``, ``head_dim``, ``d_mlp``, ``n_experts``; ``keys`` for the attention
pattern's key axis); :func:`row_shapes` fills them in from numbers read off the model's modules.
A point whose row is made of dimensions every model has may still need a part some models lack
(``shared_expert_out``: a shared expert): ``needs`` names it, and a model exposes the point only
where it has that part (:func:`row_shapes`' ``parts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Point:
    """One named point of a model's forward."""

    name: str
    group: str  # "pseudo" (one pseudo-layer), "residual", "attention" or "mlp"
    meaning: str
    shape: tuple[str, ...]  # one position's row at one layer, in model dimensions
    steerable: bool
    heads: str | None = None  # "query" or "kv": dim 0 of the row is a head; None: not per head
    lens: bool = False  # a residual-stream state the logit lens can read
    moe: bool = False  # only mixture-of-experts models have it
    needs: str | None = None  # a part of the model the point needs beyond its dimensions ("shared_expert")


TABLE: tuple[Point, ...] = (
    Point("embed", "pseudo", "the residual stream entering block 0", ("hidden",), False, lens=True),
    Point("resid_pre", "residual", "the residual stream entering the block", ("hidden",), True, lens=True),
    Point("attn_out", "residual", "what the attention sublayer adds to the residual stream", ("hidden",), True),
    Point("resid_mid", "residual", "resid_pre + attn_out", ("hidden",), True, lens=True),
    Point("mlp_out", "residual", "what the MLP sublayer adds to the residual stream", ("hidden",), True),
    Point("resid_post", "residual", "the residual stream leaving the block", ("hidden",), True, lens=True),
    Point("final", "pseudo", "the final norm of the last block's output: what the LM head reads", ("hidden",), False,
          lens=True),
    Point("q", "attention", "queries after norms and rotary, per query head", ("heads", "head_dim"), True, "query"),
    Point("k", "attention", "keys after norms and rotary, per KV head", ("kv_heads", "head_dim"), True, "kv"),
    Point("v", "attention", "values, per KV head", ("kv_heads", "head_dim"), True, "kv"),
    Point("z", "attention", "per-head attention output before the output projection", ("heads", "head_dim"), True,
          "query"),
    Point("attn_pattern", "attention", "softmax weights per query head over the keys", ("heads", "keys"), False,
          "query"),
    Point("mlp_post", "mlp", "neuron activations (times the gate in gated MLPs)", ("d_mlp",), True),
    Point("router_logits", "mlp", "the router's logit per expert, before its softmax (NaN in a dense block)",
          ("n_experts",), True, moe=True),
    Point("router_probs", "mlp", "softmax of the router's logits over every expert, before top-k (NaN in a dense "
          "block)", ("n_experts",), False, moe=True),
    Point("routing_weights", "mlp", "each expert's weight in the token's MLP output, 0 where not chosen (NaN in a "
          "dense block)", ("n_experts",), True, moe=True),
    Point("experts_chosen", "mlp", "1 for each expert the token is routed to, else 0 (NaN in a dense block)",
          ("n_experts",), False, moe=True),
    Point("expert_out", "mlp", "each expert's output (after its down projection, before its routing weight) where "
          "the token is routed to it, 0 where not (NaN in a dense block); only the experts a request names "
          "(experts=); capture only", ("n_experts", "hidden"), False, moe=True),
    Point("shared_expert_out", "mlp", "what the shared expert adds to the MLP output, after its sigmoid gate (NaN in "
          "a dense block); only models with a shared expert (Qwen2-MoE); steering it edits that contribution",
          ("hidden",), True, moe=True, needs="shared_expert"),
)
BY_NAME: dict[str, Point] = {p.name: p for p in TABLE}

POINTS = tuple(p.name for p in TABLE)
PSEUDO_POINTS = tuple(p.name for p in TABLE if p.group == "pseudo")
RESIDUAL_POINTS = tuple(p.name for p in TABLE if p.group == "residual")
HIDDEN_POINTS = tuple(p.name for p in TABLE if p.shape == ("hidden",) and p.needs is None)  # every model's hidden rows
HIDDEN_ROW_POINTS = tuple(p.name for p in TABLE if p.shape == ("hidden",))  # with those of a part (shared_expert_out)
HEAD_POINTS = tuple(p.name for p in TABLE if p.group in ("attention", "mlp"))  # inside attention and the MLP
QUERY_HEAD_POINTS = tuple(p.name for p in TABLE if p.heads == "query")  # what a head selection picks
BLOCK_POINTS = tuple(p.name for p in TABLE if p.group != "pseudo")
LENS_POINTS = tuple(p.name for p in TABLE if p.lens)
STEER_POINTS = tuple(p.name for p in TABLE if p.steerable)
HEAD_STEER_POINTS = tuple(p.name for p in TABLE if p.steerable and p.heads is not None)  # q/z query, k/v KV heads
RESIDUAL_STEER_POINTS = tuple(p for p in STEER_POINTS if p in RESIDUAL_POINTS)
MOE_POINTS = tuple(p.name for p in TABLE if p.moe)  # a dense model does not expose them
DENSE_POINTS = tuple(p.name for p in TABLE if not p.moe)  # what a dense model may expose
ROUTER_POINTS = tuple(p.name for p in TABLE if p.moe and p.shape == ("n_experts",))  # one number per expert
MOE_STEER_POINTS = tuple(p for p in STEER_POINTS if p in ROUTER_POINTS)  # the router's steering targets
EXPERT_POINTS = tuple(p.name for p in TABLE if p.shape[:1] == ("n_experts",) and len(p.shape) > 1)  # per expert
PART_POINTS = tuple(p.name for p in TABLE if p.needs is not None)  # exposed only by models with the part


def row_shapes(dims: Mapping[str, int], parts: frozenset[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """The row shape of every point whose dimensions ``dims`` gives and whose part (``Point.needs``) is in
    ``parts`` (``keys`` varies: left out)."""
    return {p.name: tuple(dims[d] for d in p.shape) for p in TABLE
            if all(d in dims for d in p.shape) and (p.needs is None or p.needs in parts)}


def describe(names: tuple[str, ...] = POINTS) -> str:
    """One line per point: its name and meaning (for command-line help)."""
    return "\n".join(f"{BY_NAME[n].name}: {BY_NAME[n].meaning}" for n in names)
