"""Steers checked against the model and resolved for one request (``on_device``: its tensors for the step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from tapllm.steering.router import ROUTER_OPS, RouterLimits, check_routing
from tapllm.steering.spec import HEAD_STEER_POINTS, Steer
from tapllm.tap import resolve_indices, resolve_layers
from tapllm.tap.points import MOE_STEER_POINTS, PART_POINTS
from tapllm.utils.checks import real

if TYPE_CHECKING:
    from tapllm.sae.features import DeviceSAEs

INSIDE_POINTS = (*HEAD_STEER_POINTS, "mlp_post", *MOE_STEER_POINTS)  # rows other than [hidden]


@dataclass(slots=True)
class ResolvedSteer:
    """A ``Steer`` checked against the model (:meth:`on_device` moves its tensors to the engine's device).

    ``payload[block]``: ``add`` the scaled vector (model dtype), ``ablate``/``clamp`` the unit
    direction (float32), ``set`` the values ``[len(positions), *row]`` (model dtype);
    ``index`` the heads, neurons or experts the operation is limited to (dim 1 of the point's tensor);
    ``ban``/``force`` have no payload (their experts are ``index``), an ``ablate`` at ``routing_weights``
    is resolved to ``scale`` by 0.
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

    def on_device(self, device: torch.device, saes: DeviceSAEs) -> ResolvedSteer:
        """This steer with its tensors on ``device`` and its SAE (if any) among the engine's ``saes``."""
        return replace(self, payload={b: t.to(device) for b, t in self.payload.items()},
                       index=self.index.to(device) if self.index is not None else None,
                       sae=self.sae.on_device(saes) if self.sae is not None else None)

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


@dataclass(slots=True)
class RequestSteering:
    """One request's steering: its resolved steers, their digest, and where its prompt ends."""

    steers: list[ResolvedSteer]
    digest: bytes  # hash of the request's steers (see block_salt)
    num_prompt: int

    def block_salt(self, index: int, block_size: int) -> bytes:
        """What the KV of block ``index`` owes to steering (its part of the prefix-cache salt)."""
        return steering_block_salt(self.steers, self.digest, self.num_prompt, index * block_size, block_size)


def resolve_steering(steers: Sequence[Steer], num_layers: int, hidden_size: int, dtype: torch.dtype, max_steers: int,
                     point_shapes: dict[str, tuple[int, ...]] | None = None,
                     router: RouterLimits | None = None) -> list[ResolvedSteer]:
    """Check steers against the model; ``ValueError`` names the steer and field (nothing moves to a device).

    ``point_shapes`` gives the row shape of the points inside attention and the MLP (``q``,
    ``k``, ``v``, ``z``, ``mlp_post``, the router's), as read off the model's modules; ``router``
    the limits of a mixture-of-experts model's routers (checked when given).
    """
    if len(steers) > max_steers:
        raise ValueError(f"steering: {len(steers)} steers, more than max_steers_per_request={max_steers}")
    shapes = point_shapes or {}
    out = []
    for i, s in enumerate(steers):
        where = f"steering[{i}]"
        row, index = _row(s, hidden_size, shapes, where)
        blocks = list(resolve_layers(s.layers, num_layers, f"{where}.layers", unique=False))
        twice = next((b for i, b in enumerate(blocks) if b in blocks[:i]), None)
        if twice is not None:
            raise ValueError(f"{where}.layers names block {twice} twice")
        if s.sae is not None and s.op != "add":  # SAE latents set at the step
            from tapllm.sae.steer import resolve_sae_edit

            edit = resolve_sae_edit(s, hidden_size, where)
            out.append(ResolvedSteer(s.point, s.op, blocks, {}, s.positions, sae=edit))
            continue
        payload = {}
        op, factor = s.op, float(s.scale)
        if s.point == "routing_weights" and s.op == "ablate":
            op, factor = "scale", 0.0  # an ablated expert's output weighs nothing
        if s.op == "set":
            values = _set_values(s, row, where)
            for k, block in enumerate(blocks):
                payload[block] = _finite_in(values[:, k], dtype, where).to(dtype)
        elif s.op in ROUTER_OPS or op == "scale":
            real(f"{where}.scale", factor, dtype)  # scale's factor, in the model's dtype (ban/force: 1, unused)
        else:
            for layer, block in zip(s.layers, blocks):
                v = _fit(s.vector_for(layer), row, where, s.point in INSIDE_POINTS)
                if s.op == "add":
                    payload[block] = _finite_in(s.scale * v, dtype, where, f"scale * vector at layer {layer}"
                                                ).to(dtype)
                else:
                    payload[block] = (v / v.norm(dim=-1, keepdim=True)).to(torch.float32)
        if s.op == "clamp":
            real(f"{where}.value", s.value, dtype)  # the component the state is given, in the model's dtype
        out.append(ResolvedSteer(s.point, op, blocks, payload, s.positions,
                                 torch.tensor(index) if index is not None else None,
                                 factor=factor, value=float(s.value)))
    if router is not None:
        check_routing([(s.point, s.op, s.blocks, s.index.tolist() if s.index is not None else None) for s in out],
                      router)
    return out


def _row(s: Steer, hidden: int, shapes: dict[str, tuple[int, ...]], where: str
         ) -> tuple[tuple[int, ...], list[int] | None]:
    """The shape of one position's row the steer acts on (after heads/neurons/experts), and that index."""
    if s.point in MOE_STEER_POINTS:
        if s.point not in shapes:
            raise ValueError(f"{where}.point: this model does not expose {s.point!r} (it has no router)")
        n = shapes[s.point][0]
        if s.experts is None:
            return (n,), None
        return (len(s.experts),), list(resolve_indices(s.experts, n, f"{where}.experts", "experts", "expert "))
    if s.point in PART_POINTS and s.point not in shapes:
        raise ValueError(f"{where}.point: this model does not expose {s.point!r}")
    if s.point not in HEAD_STEER_POINTS and s.point != "mlp_post":
        return (hidden,), None
    if s.point not in shapes:
        raise ValueError(f"{where}.point: this model does not expose {s.point!r}")
    full = shapes[s.point]
    chosen = s.heads if s.point in HEAD_STEER_POINTS else s.neurons
    if chosen is None:
        return full, None
    what = "heads" if s.point in HEAD_STEER_POINTS else "neurons"
    index = list(resolve_indices(chosen, full[0], f"{where}.{what}", what))
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
