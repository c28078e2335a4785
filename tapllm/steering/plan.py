"""Steering resolved for a request, and the per-step plan the step's tap applies at each point.

The plan lists, per (point, block), the batch rows of steered requests and what to do to
them. The tap applies it right after the model computes each steerable tensor, before that
tensor is recorded or used, so the rest of the forward (and any captured state) sees the
steered value. Rows of other requests are never touched; a step without steered requests
has no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tapllm.steering.spec import Steer

if TYPE_CHECKING:
    from tapllm.engine.tap import RowSpan


@dataclass(slots=True)
class ResolvedSteer:
    """A ``Steer`` checked against the model, with its vectors on the device."""

    point: str
    op: str
    vectors: dict[int, torch.Tensor]  # block -> add: scale * vector (model dtype); ablate: unit (float32)
    positions: str

    def window(self, num_prompt: int, start: int, n: int) -> tuple[int, int] | None:
        """The part ``[a, b)`` of a chunk of positions ``[start, start + n)`` this steer applies to."""
        lo, hi = {"all": (0, None), "prompt": (0, num_prompt), "generated": (num_prompt, None)}[self.positions]
        a, b = max(start, lo), start + n if hi is None else min(start + n, hi)
        return (a, b) if a < b else None


def steering_block_salt(steers: Sequence[ResolvedSteer], digest: bytes, num_prompt: int, first: int,
                        size: int) -> bytes:
    """The prefix-cache salt of the KV block holding positions ``[first, first + size)``.

    A block's KV depends on the steering of its own positions (earlier positions enter
    through the hash chain), so the salt names the steers and exactly which of the block's
    positions each one touches: a steer limited to the prompt or to generated positions
    touches different positions of the same tokens when the prompt ends elsewhere (a
    continuation). A block none of whose positions is steered gets no salt, and stays
    shareable as long as every block before it is.
    """
    touched = []
    for k, s in enumerate(steers):
        w = s.window(num_prompt, first, size)
        if w is not None:
            touched.append(f"{k}:{w[0] - first}-{w[1] - first}")
    if not touched:
        return b""
    return digest + ",".join(touched).encode()


def resolve_steering(steers: Sequence[Steer], num_layers: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device, max_steers: int) -> list[ResolvedSteer]:
    """Check steers against the model; ``ValueError`` names the steer and field."""
    if len(steers) > max_steers:
        raise ValueError(f"steering: {len(steers)} steers, more than max_steers_per_request={max_steers}")
    out = []
    for i, s in enumerate(steers):
        vectors = {}
        for layer in s.layers:
            if not -num_layers <= layer < num_layers:
                raise ValueError(f"steering[{i}].layers: layer {layer} is out of range for a {num_layers}-block "
                                 f"model (valid: {-num_layers}..{num_layers - 1})")
            v = s.vector_for(layer)
            if v.shape[0] != hidden_size:
                raise ValueError(f"steering[{i}].vector has width {v.shape[0]}, but the model's hidden size is "
                                 f"{hidden_size}")
            block = layer % num_layers
            if block in vectors:
                raise ValueError(f"steering[{i}].layers names block {block} twice")
            if s.op == "add":
                scaled = s.scale * v
                limit = torch.finfo(dtype).max
                if not torch.isfinite(scaled).all() or float(scaled.abs().max()) > limit:
                    raise ValueError(f"steering[{i}]: scale * vector overflows at layer {layer} (scale {s.scale:g}, "
                                     f"largest |entry| {float(v.abs().max()):g}); the model's {dtype} holds at most "
                                     f"{limit:.3g}")
                vectors[block] = scaled.to(device, dtype)
            else:
                vectors[block] = (v / v.norm()).to(device, torch.float32)
        out.append(ResolvedSteer(s.point, s.op, vectors, s.positions))
    return out


@dataclass(slots=True)
class _AddRows:
    """Add ``delta`` [n, hidden] to batch rows ``rows`` [n]: every addition at a point, merged."""

    rows: torch.Tensor
    delta: torch.Tensor

    def apply(self, t: torch.Tensor) -> None:
        t.index_add_(0, self.rows, self.delta)


@dataclass(slots=True)
class _AddSpan:
    """Add ``vector`` to the contiguous batch rows ``rows``."""

    rows: slice
    vector: torch.Tensor

    def apply(self, t: torch.Tensor) -> None:
        t[self.rows] += self.vector


@dataclass(slots=True)
class _AblateSpan:
    """Remove the component along the unit ``direction`` (float32) from batch rows ``rows``."""

    rows: slice
    direction: torch.Tensor

    def apply(self, t: torch.Tensor) -> None:
        x = t[self.rows].float()
        t[self.rows] = (x - (x @ self.direction)[:, None] * self.direction).to(t.dtype)


SteerOp = _AddRows | _AddSpan | _AblateSpan


class SteeringPlan:
    """The steering of one step: per (point, block), the operations on the planned rows.

    Built from the step's row spans of steered requests; :meth:`apply` modifies a point's
    tensor in place, on those rows only, in the order the request listed its steers.
    """

    def __init__(self, spans: Sequence[RowSpan], device: torch.device) -> None:
        found: dict[tuple[str, int], list[tuple[int, int, ResolvedSteer, torch.Tensor]]] = {}
        for span in spans:
            req = span.request
            for s in req.steering or ():
                w = s.window(req.num_prompt_tokens, span.start, span.num_tokens)
                if w is None:
                    continue
                r0, r1 = span.row + w[0] - span.start, span.row + w[1] - span.start
                for block, vec in s.vectors.items():
                    found.setdefault((s.point, block), []).append((r0, r1, s, vec))
        self.ops: dict[tuple[str, int], list[SteerOp]] = {}
        for key, entries in found.items():
            if len(entries) > 1 and all(s.op == "add" for _, _, s, _ in entries):
                # Additions commute: one index_add_ for every steered row at this point.
                rows = torch.cat([torch.arange(r0, r1, device=device) for r0, r1, _, _ in entries])
                delta = torch.cat([v.expand(r1 - r0, -1) for r0, r1, _, v in entries])
                self.ops[key] = [_AddRows(rows, delta)]
            else:
                self.ops[key] = [_AddSpan(slice(r0, r1), v) if s.op == "add" else _AblateSpan(slice(r0, r1), v)
                                 for r0, r1, s, v in entries]

    def __bool__(self) -> bool:
        return bool(self.ops)

    def apply(self, point: str, layer: int, t: torch.Tensor) -> torch.Tensor:
        """Steer ``t`` ([tokens, hidden]) at ``point`` of block ``layer`` in place; returns it."""
        for op in self.ops.get((point, layer), ()):
            op.apply(t)
        return t
