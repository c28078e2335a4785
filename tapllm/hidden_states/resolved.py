"""A hidden-state spec resolved against the model and one request: what it captures, and how big."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tapllm.hidden_states.spec import (DTYPES, LENS_POINTS, PSEUDO_POINTS, QUERY_HEAD_POINTS,
                                       HiddenStatesSpec)
from tapllm.sae.features import DeviceSAEs, FeatureSelection
from tapllm.tap import PSEUDO_LAYER, resolve_indices, resolve_layers
from tapllm.tap.points import EXPERT_POINTS, HIDDEN_ROW_POINTS, PART_POINTS


@dataclass(slots=True)
class Selection:
    """What one request captures, resolved: points, block indices, positions, shapes, dtype."""

    points: tuple[str, ...]
    layers: tuple[int, ...]
    lo: int  # first position captured
    hi: int  # one past the last position the request can reach (an upper bound)
    last_only: bool  # positions="last": only the latest computed position is kept
    shapes: dict[str, tuple[int, ...]]  # per point, the shape of one layer's row (after heads / project)
    dtype: torch.dtype
    reduce: str | None
    lens_k: int = 0  # logit lens: top tokens kept per state (0: no lens)
    lens_targets: int = 0  # logit lens: target tokens reported per state
    heads: tuple[int, ...] | None = None  # query heads kept for q, z and attn_pattern (None: all)
    experts: tuple[int, ...] | None = None  # experts kept for expert_out
    features: FeatureSelection | None = None  # SAE features (tapllm.sae.features), set by the input processor

    def on_device(self, saes: DeviceSAEs) -> Selection:
        """This selection with its SAE features (if any) on the engine's device."""
        return self if self.features is None else replace(self, features=self.features.on_device(saes))

    def layer_keys(self, point: str) -> tuple[int, ...]:
        """The model's layer keys of ``point``: block indices, or the pseudo-layer."""
        return (PSEUDO_LAYER,) if point in PSEUDO_POINTS else self.layers

    def tap_points(self) -> tuple[str, ...]:
        """The points the step records for this request: the captured ones, then the SAE's inputs."""
        extra = [p for p, _ in self.features.inputs()] if self.features is not None else []
        return tuple(dict.fromkeys([*self.points, *extra]))

    def tap_keys(self, point: str) -> tuple[int, ...]:
        """The layer keys of ``point`` the step records: the captured layers, then the SAE's."""
        keys = self.layer_keys(point) if point in self.points else ()
        extra = [k for p, k in self.features.inputs() if p == point] if self.features is not None else []
        return tuple(dict.fromkeys([*keys, *extra]))

    @property
    def max_positions(self) -> int:
        """Most positions this request can capture."""
        return 1 if self.last_only else self.hi - self.lo

    def row_size(self, point: str) -> int:
        """Numbers in one position's row of ``point`` (all its layers)."""
        return len(self.layer_keys(point)) * math.prod(self.shapes[point])

    @property
    def max_bytes(self) -> int:
        """Upper bound on the bytes of the result."""
        rows = 1 if self.reduce else self.max_positions
        states = rows * sum(self.row_size(p) for p in self.points) * torch.tensor([], dtype=self.dtype).element_size()
        lens_layers = sum(len(self.layer_keys(p)) for p in self.points if p in LENS_POINTS)
        features = self.max_positions * self.features.row_bytes() if self.features is not None else 0
        return states + rows * lens_layers * (12 * self.lens_k + 4 * self.lens_targets) + features  # int64 ids, f32


def resolve(
    spec: HiddenStatesSpec,
    *,
    num_layers: int,
    hidden_size: int,
    model_dtype: torch.dtype,
    num_prompt: int,
    max_positions: int,
    encode: bool,
    vocab_size: int | None = None,
    point_shapes: dict[str, tuple[int, ...]] | None = None,
) -> Selection:
    """Check ``spec`` against the model and request; ``ValueError`` names the field.

    ``max_positions`` is how many positions the request can run through the model: the
    prompt for encode; the prompt plus up to ``max_tokens - 1`` generated tokens otherwise
    (the last sampled token is never run). ``point_shapes`` gives the model's row shape of
    the points inside attention and the MLP (``q``/``z`` ``(heads, head_dim)``, ``k``/``v``
    ``(kv_heads, head_dim)``, ``mlp_post`` ``(d_mlp,)``).
    """
    layers = _resolve_layers(spec.layers, num_layers)
    if all(p in PSEUDO_POINTS for p in spec.points):
        layers = ()  # only embed/final: no block index applies
    if spec.project is not None and spec.project.shape[1] != hidden_size:
        raise ValueError(
            f"hidden_states.project has width {spec.project.shape[1]}, "
            f"but the model's hidden size is {hidden_size}: it must be [k, {hidden_size}]"
        )
    p, end = num_prompt, max_positions
    what = "encode runs only the prompt" if encode else f"positions 0..{end - 1} can be computed"
    last_only = False
    if spec.positions == "prompt":
        lo, hi = 0, p
    elif spec.positions == "generated":
        lo, hi = p, end
        if lo >= hi:
            why = "encode generates no tokens" if encode else "with max_tokens=1 no generated token is run"
            raise ValueError(f"hidden_states.positions='generated' selects nothing: {why}")
    elif spec.positions == "all":
        lo, hi = 0, end
    elif spec.positions == "last_prompt":
        lo, hi = p - 1, p
    elif spec.positions == "last":
        lo, hi, last_only = p - 1, end, True
    else:
        lo, hi = spec.positions
        if hi > end:
            raise ValueError(
                f"hidden_states.positions: window [{lo}, {hi}) lies outside the sequence: {what} "
                f"(prompt of {p} tokens), so the window must end at or before {end}"
            )
    shapes, heads, experts = _point_shapes(spec, hidden_size, point_shapes or {}, hi)
    dtype = DTYPES[spec.dtype] if spec.dtype else model_dtype
    targets = list(spec.lens_targets or ())
    if vocab_size is not None and any(t >= vocab_size for t in targets):
        raise ValueError(f"hidden_states.lens_targets: token ids must be in [0, {vocab_size}), got {targets}")
    return Selection(tuple(spec.points), layers, lo, hi, last_only, shapes, dtype, spec.reduce, spec.lens or 0,
                     len(targets), heads, experts=experts)


def _point_shapes(spec: HiddenStatesSpec, hidden: int, model_shapes: dict[str, tuple[int, ...]], hi: int
                  ) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...] | None, tuple[int, ...] | None]:
    """Each point's row shape, after the head and expert selections and the projection."""
    heads = experts = None
    if spec.experts is not None and "expert_out" in model_shapes:
        n = model_shapes["expert_out"][0]
        if any(e >= n for e in spec.experts):
            raise ValueError(f"hidden_states.experts: expert {max(spec.experts)} is out of range for {n} experts "
                             f"(valid: 0..{n - 1})")
        experts = tuple(spec.experts)
    if spec.heads is not None:
        n = model_shapes.get("q", (0,))[0]
        heads = resolve_indices(spec.heads, n, "hidden_states.heads", "query heads", "head ")
        if len(set(heads)) != len(heads):
            raise ValueError(f"hidden_states.heads names a head twice: {list(spec.heads)}")
    shapes = {}
    for point in spec.points:
        if point in PART_POINTS and point not in model_shapes:
            raise ValueError(f"hidden_states.points: this model does not expose {point!r}")
        if point in HIDDEN_ROW_POINTS:
            shapes[point] = (spec.project.shape[0],) if spec.project is not None else (hidden,)
            continue
        if spec.project is not None:
            raise ValueError(f"hidden_states.project applies to hidden-size points only, not {point!r}")
        if point == "attn_pattern":
            n = model_shapes["q"][0]
            shapes[point] = (len(heads) if heads is not None else n, hi)
        elif point not in model_shapes:
            raise ValueError(f"hidden_states.points: this model does not expose {point!r}")
        elif point in QUERY_HEAD_POINTS and heads is not None:
            shapes[point] = (len(heads), *model_shapes[point][1:])
        elif point in EXPERT_POINTS:
            shapes[point] = (len(experts), *model_shapes[point][1:])
        else:
            shapes[point] = model_shapes[point]
    return shapes, heads, experts


def _resolve_layers(layers: list[int] | str, n: int) -> tuple[int, ...]:
    return tuple(range(n)) if layers == "all" else resolve_layers(layers, n, "hidden_states.layers")
