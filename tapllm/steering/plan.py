"""Steering resolved for a request, and the per-step plan the step's tap applies at each point.

The plan lists, per (point, block), the batch rows of steered requests and what to do to
them. The tap applies it right after the model computes each steerable tensor, before that
tensor is recorded or used, so the rest of the forward (and any captured state) sees the
steered value. Rows of other requests are never touched; a step without steered requests
has no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tapllm.steering.spec import HEAD_STEER_POINTS, Steer

if TYPE_CHECKING:
    from tapllm.engine.tap import RowSpan


@dataclass(slots=True)
class ResolvedSteer:
    """A ``Steer`` checked against the model, its tensors on the device.

    ``payload[block]``: ``add`` the scaled vector (model dtype), ``ablate``/``clamp`` the unit
    direction (float32), ``set`` the values ``[len(positions), *row]`` (model dtype);
    ``index`` the heads or neurons the operation is limited to (dim 1 of the point's tensor).
    """

    point: str
    op: str
    blocks: list[int]
    payload: dict[int, torch.Tensor]
    positions: str | list[int]
    index: torch.Tensor | None = None
    factor: float = 1.0  # scale's factor
    value: float = 0.0  # clamp's coefficient
    sae: Any = None  # an SAE clamp/set/ablate (tapllm.sae.steer.SaeEdit)
    _position_set: dict[int, int] = field(default_factory=dict)  # explicit position -> its row in payload

    def __post_init__(self) -> None:
        if not isinstance(self.positions, str):
            self._position_set = {p: i for i, p in enumerate(self.positions)}

    def window(self, num_prompt: int, start: int, n: int) -> tuple[int, int] | list[int] | None:
        """The positions of a chunk ``[start, start + n)`` this steer touches: a range ``(a, b)``, a
        sorted list (explicit positions), or None."""
        if not isinstance(self.positions, str):
            hit = [p for p in self.positions if start <= p < start + n]
            return hit or None
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
        if isinstance(w, tuple):
            touched.append(f"{k}:{w[0] - first}-{w[1] - first}")
        elif w:
            touched.append(f"{k}:" + "+".join(str(p - first) for p in w))
    if not touched:
        return b""
    return digest + ",".join(touched).encode()


def resolve_steering(steers: Sequence[Steer], num_layers: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device, max_steers: int,
                     point_shapes: dict[str, tuple[int, ...]] | None = None, saes: Any = None
                     ) -> list[ResolvedSteer]:
    """Check steers against the model; ``ValueError`` names the steer and field.

    ``point_shapes`` gives the row shape of the points inside attention and the MLP (``q``,
    ``k``, ``v``, ``z``, ``mlp_post``), as ``ModelConfig.point_shapes`` does.
    """
    if len(steers) > max_steers:
        raise ValueError(f"steering: {len(steers)} steers, more than max_steers_per_request={max_steers}")
    shapes = point_shapes or {}
    out = []
    for i, s in enumerate(steers):
        where = f"steering[{i}]"
        row, index = _row(s, hidden_size, shapes, where)
        blocks = []
        for layer in s.layers:
            if not -num_layers <= layer < num_layers:
                raise ValueError(f"{where}.layers: layer {layer} is out of range for a {num_layers}-block "
                                 f"model (valid: {-num_layers}..{num_layers - 1})")
            block = layer % num_layers
            if block in blocks:
                raise ValueError(f"{where}.layers names block {block} twice")
            blocks.append(block)
        if s.sae is not None and s.op != "add":  # SAE latents set on the device; the SAE is moved once
            from tapllm.sae.steer import resolve_sae_edit

            out.append(ResolvedSteer(s.point, s.op, blocks, {}, s.positions,
                                     sae=resolve_sae_edit(s, saes, device, hidden_size, where)))
            continue
        payload = {}
        if s.op == "set":
            values = _set_values(s, row, where)
            for k, block in enumerate(blocks):
                payload[block] = _finite_in(values[:, k], dtype, where).to(device, dtype)
        elif s.op != "scale":
            for layer, block in zip(s.layers, blocks):
                v = _fit(s.vector_for(layer), row, where, s.point in HEAD_STEER_POINTS or s.point == "mlp_post")
                if s.op == "add":
                    payload[block] = _finite_in(s.scale * v, dtype, where, f"scale * vector at layer {layer}"
                                                ).to(device, dtype)
                else:
                    payload[block] = (v / v.norm(dim=-1, keepdim=True)).to(device, torch.float32)
        elif not abs(s.scale) <= torch.finfo(dtype).max:
            raise ValueError(f"{where}.scale {s.scale:g} overflows the model's {dtype}")
        out.append(ResolvedSteer(s.point, s.op, blocks, payload, s.positions,
                                 torch.tensor(index, device=device) if index is not None else None,
                                 factor=float(s.scale), value=float(s.value)))
    return out


def _row(s: Steer, hidden: int, shapes: dict[str, tuple[int, ...]], where: str
         ) -> tuple[tuple[int, ...], list[int] | None]:
    """The shape of one position's row the steer acts on (after heads/neurons), and that index."""
    if s.point not in HEAD_STEER_POINTS and s.point != "mlp_post":
        return (hidden,), None
    if s.point not in shapes:
        raise ValueError(f"{where}.point: this model does not expose {s.point!r}")
    full = shapes[s.point]
    chosen = s.heads if s.point in HEAD_STEER_POINTS else s.neurons
    if chosen is None:
        return full, None
    n = full[0]
    bad = [c for c in chosen if not -n <= c < n]
    if bad:
        what = "heads" if s.point in HEAD_STEER_POINTS else "neurons"
        raise ValueError(f"{where}.{what}: {bad[0]} is out of range for {n} {what}")
    index = [c % n for c in chosen]
    return (len(index), *full[1:]), index


def _fit(v: torch.Tensor, row: tuple[int, ...], where: str, inside: bool) -> torch.Tensor:
    """A direction shaped like ``row`` (a ``[row[-1]]`` vector is broadcast over heads)."""
    if tuple(v.shape) == tuple(row) or tuple(v.shape) == tuple(row[-1:]):
        return v
    if not inside:
        raise ValueError(f"{where}.vector has width {v.shape[-1]}, but the model's hidden size is {row[0]}")
    raise ValueError(f"{where}.vector has shape {tuple(v.shape)}; this point takes {list(row)} or [{row[-1]}]")


def _set_values(s: Steer, row: tuple[int, ...], where: str) -> torch.Tensor:
    """``set``'s values as ``[len(positions), len(layers), *row]``."""
    v = s.values
    n, layers = len(s.positions), len(s.layers)
    if tuple(v.shape) == (n, *row):
        return v[:, None].expand(n, layers, *row)
    if tuple(v.shape) == (n, layers, *row):
        return v
    raise ValueError(f"{where}.values has shape {tuple(v.shape)}; it must be [{n}, {', '.join(map(str, row))}] "
                     f"or [{n}, {layers}, {', '.join(map(str, row))}] (positions, layers, row)")


def _finite_in(t: torch.Tensor, dtype: torch.dtype, where: str, what: str = "values") -> torch.Tensor:
    limit = torch.finfo(dtype).max
    if not torch.isfinite(t).all() or float(t.abs().max()) > limit:
        raise ValueError(f"{where}: {what} overflows (largest |entry| {float(t.abs().max()):g}); the model's "
                         f"{dtype} holds at most {limit:.3g}")
    return t


@dataclass(slots=True)
class _AddRows:
    """Add ``delta`` [n, hidden] to batch rows ``rows`` [n]: every plain addition at a point, merged."""

    rows: torch.Tensor
    delta: torch.Tensor

    def apply(self, t: torch.Tensor) -> None:
        t.index_add_(0, self.rows, self.delta)


@dataclass(slots=True)
class _Op:
    """One steer's operation on batch rows ``rows`` (a slice, or an index for explicit positions),
    limited to ``index`` along dim 1 when given."""

    op: str
    rows: slice | torch.Tensor
    index: torch.Tensor | None
    payload: torch.Tensor | None  # vector / unit direction / set values (rows of values for these rows)
    factor: float = 1.0
    value: float = 0.0

    def apply(self, t: torch.Tensor) -> None:
        key = (self.rows,) if self.index is None else (self.rows, self.index)
        if self.index is not None and isinstance(self.rows, torch.Tensor):
            key = (self.rows[:, None], self.index)  # both advanced: a grid, not a zip
        if self.op == "set":
            t[key] = self.payload
            return
        x = t[key]
        if self.op == "add":
            t[key] = x + self.payload
        elif self.op == "scale":
            t[key] = x * self.factor
        else:
            xf = x.float()
            coef = (xf * self.payload).sum(-1, keepdim=True)
            target = 0.0 if self.op == "ablate" else self.value
            t[key] = (xf + (target - coef) * self.payload).to(t.dtype)


SteerOp = Any  # _AddRows, _Op, or an SAE edit (tapllm.sae.steer.SaeEditOp): each has apply(t)


class SteeringPlan:
    """The steering of one step: per (point, block), the operations on the planned rows.

    Built from the step's row spans of steered requests; :meth:`apply` modifies a point's
    tensor in place, on those rows only, in the order the request listed its steers.
    """

    def __init__(self, spans: Sequence[RowSpan], device: torch.device) -> None:
        found: dict[tuple[str, int], list[SteerOp]] = {}
        plain_adds: dict[tuple[str, int], list[tuple[int, int, torch.Tensor]]] = {}
        for span in spans:
            req = span.request
            for s in req.steering or ():
                w = s.window(req.num_prompt_tokens, span.start, span.num_tokens)
                if w is None:
                    continue
                if isinstance(w, tuple):
                    rows: slice | torch.Tensor = slice(span.row + w[0] - span.start, span.row + w[1] - span.start)
                    picked = None
                else:
                    rows = torch.tensor([span.row + p - span.start for p in w], device=device)
                    picked = torch.tensor([s._position_set[p] for p in w], device=device)
                for block in s.blocks:
                    if s.sae is not None:
                        found.setdefault((s.point, block), []).append(s.sae.op(rows))
                        continue
                    payload = s.payload.get(block)
                    if s.op == "set":
                        payload = payload[picked] if picked is not None else payload
                    key = (s.point, block)
                    op = _Op(s.op, rows, s.index, payload, s.factor, s.value)
                    found.setdefault(key, []).append(op)
                    if s.op == "add" and s.index is None and isinstance(rows, slice):
                        plain_adds.setdefault(key, []).append((rows.start, rows.stop, payload))
        self.ops: dict[tuple[str, int], list[SteerOp]] = {}
        for key, ops in found.items():
            adds = plain_adds.get(key, [])
            if len(ops) > 1 and len(adds) == len(ops):
                # Plain additions commute: one index_add_ for every steered row at this point.
                rows = torch.cat([torch.arange(r0, r1, device=device) for r0, r1, _ in adds])
                delta = torch.cat([v.expand(r1 - r0, *v.shape) for r0, r1, v in adds])
                self.ops[key] = [_AddRows(rows, delta)]
            else:
                self.ops[key] = list(ops)

    def __bool__(self) -> bool:
        return bool(self.ops)

    def apply(self, point: str, layer: int, t: torch.Tensor) -> torch.Tensor:
        """Steer ``t`` at ``point`` of block ``layer`` in place; returns it."""
        for op in self.ops.get((point, layer), ()):
            op.apply(t)
        return t


__all__ = ["ResolvedSteer", "SteeringPlan", "resolve_steering", "steering_block_salt"]
