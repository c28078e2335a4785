"""Capture and steering inside a CUDA graph: fixed points, operands in buffers allocated before capture.

A graph replays the same kernels on the same addresses, so what a step's tap does must be
decided when the graph is captured and fed through tensors whose addresses never change. A
:class:`TapShape` names what a decode step's tap touches: the (point, block) keys some
request captures, and the keys some request steers with the kind of operation. For each
shape, a :class:`GraphTap` owns, per key, buffers of the graph's largest batch:

* capture: ``x`` is copied whole into the key's buffer (every row; the capture plan then
  takes the rows of the requests that asked, after the replay);
* ``add``: ``x += delta``, ``delta`` zero on the rows nobody steers;
* ``scale``: ``x *= factor`` (in float32, as the eager op), ``factor`` 1 elsewhere;
* ``ablate``/``clamp``: ``x += (target - x . u) u``, ``u`` 0 elsewhere;
* ``set``: ``x = where(mask, value, x)``.

Before each replay :meth:`GraphTap.load` writes the step's operands from its steering plan
(device copies, no host read). A no-op operand leaves a row exactly as it was, so the rows
of requests that steer nothing are untouched. What a graph cannot express (attention
patterns, head- or neuron-indexed steers, SAE edits, two kinds of operation on one key)
makes :func:`tap_shape` say why, and the step runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapllm.hidden_states.plan import CapturePlan
from tapllm.steering.plan import SteeringPlan, _AddRows, _Op
from tapllm.tap import PSEUDO_LAYER

Key = tuple[str, int]


@dataclass(frozen=True, slots=True)
class TapShape:
    """What a step's tap does, as a graph must know it when captured (hashable: a graph key)."""

    capture: frozenset[Key] = frozenset()
    steer: frozenset[tuple[Key, str]] = frozenset()  # (key, kind): kind is add, scale, direction or set

    def __bool__(self) -> bool:
        return bool(self.capture or self.steer)


NO_TAP = TapShape()


def tap_shape(capture: CapturePlan | None, steering: SteeringPlan | None) -> tuple[TapShape | None, str | None]:
    """The shape of a step's tap, or None and why a graph cannot do it."""
    keys: frozenset[Key] = frozenset()
    if capture is not None:
        if capture.patterns:
            return None, "attention patterns are captured"
        keys = frozenset(capture.targets)
    kinds: set[tuple[Key, str]] = set()
    if steering is not None:
        for key, ops in steering.ops.items():
            found = set()
            for op in ops:
                if isinstance(op, _AddRows):
                    found.add("add")
                elif isinstance(op, _Op) and op.index is None:
                    found.add("direction" if op.op in ("ablate", "clamp") else op.op)
                else:
                    return None, "a steer edits heads, neurons or SAE features"
            if len(found) > 1:
                return None, "two kinds of steering at one point"
            if "add" not in found and len(ops) > 1:
                return None, "several steers of one kind at one point"
            kinds.add((key, found.pop()))
    return TapShape(keys, frozenset(kinds)), None


class GraphTap:
    """The tap a graph is captured with (see the module docstring)."""

    def __init__(self, shape: TapShape, rows: int, row_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        self.rows = rows

        def buf(point: str, fill: float, dt: torch.dtype = dtype, width: bool = True) -> torch.Tensor:
            shape_ = (rows, *row_shapes[point]) if width else (rows,)
            return torch.full(shape_, fill, dtype=dt, device=device)

        self.captured = {key: buf(key[0], 0.0) for key in shape.capture}
        self.kinds = {key: kind for key, kind in shape.steer}
        self.operands: dict[Key, tuple[torch.Tensor, ...]] = {}
        for key, kind in shape.steer:
            point = key[0]
            if kind == "add":
                self.operands[key] = (buf(point, 0.0),)
            elif kind == "scale":
                self.operands[key] = (buf(point, 1.0, torch.float32),)
            elif kind == "direction":
                self.operands[key] = (buf(point, 0.0, torch.float32), buf(point, 0.0, torch.float32, width=False))
            else:  # set
                self.operands[key] = (buf(point, 0.0, torch.bool, width=False), buf(point, 0.0))
        self.layers = {layer for layer in {k[1] for k in self.captured} | {k[1] for k in self.kinds}
                       if layer != PSEUDO_LAYER}

    # ---- the Tap protocol (inside the graph) ---------------------------------------------
    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        key = (point, layer)
        kind = self.kinds.get(key)
        if kind is not None:
            self._steer(kind, self.operands[key], x)
        out = self.captured.get(key)
        if out is not None:
            out[: x.shape[0]].copy_(x)
        return x

    @staticmethod
    def _steer(kind: str, operands: tuple[torch.Tensor, ...], x: torch.Tensor) -> None:
        n = x.shape[0]
        if kind == "add":
            x.add_(operands[0][:n])
        elif kind == "scale":
            x.copy_((x.float() * operands[0][:n]).to(x.dtype))
        elif kind == "direction":
            u, target = operands[0][:n], operands[1][:n]
            xf = x.float()
            coef = (xf * u).sum(-1, keepdim=True)
            x.copy_((xf + (target.view(n, *([1] * (x.dim() - 1))) - coef) * u).to(x.dtype))
        else:
            mask, value = operands[0][:n], operands[1][:n]
            x.copy_(torch.where(mask.view(n, *([1] * (x.dim() - 1))), value, x))

    def wants_pattern(self, layer: int) -> bool:
        return False

    def steers(self, point: str, layer: int) -> bool:
        return (point, layer) in self.kinds

    def touches(self, layer: int) -> bool:
        return layer in self.layers

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: object) -> None:
        raise RuntimeError("a graph's tap captures no attention pattern")

    # ---- around a replay ---------------------------------------------------------------------
    def load(self, steering: SteeringPlan | None) -> None:
        """Write this step's steering operands (the no-op everywhere first, then the steered rows)."""
        for key, kind in self.kinds.items():
            operands = self.operands[key]
            if kind == "add":
                operands[0].zero_()
            elif kind == "scale":
                operands[0].fill_(1.0)
            elif kind == "direction":
                operands[0].zero_()
                operands[1].zero_()
            else:
                operands[0].zero_()
            for op in (steering.ops.get(key, ()) if steering is not None else ()):
                self._load(kind, operands, op)

    @staticmethod
    def _load(kind: str, operands: tuple[torch.Tensor, ...], op: _AddRows | _Op) -> None:
        if kind == "add":
            if isinstance(op, _AddRows):
                operands[0].index_add_(0, op.rows, op.delta.to(operands[0].dtype))
            else:
                operands[0][op.rows] += op.payload
        elif kind == "scale":  # the eager op multiplies by the Python float: the same float32 factor here
            operands[0][op.rows] = op.factor
        elif kind == "direction":
            operands[0][op.rows] = op.payload
            operands[1][op.rows] = 0.0 if op.op == "ablate" else op.value
        else:
            operands[0][op.rows] = True
            operands[1][op.rows] = op.payload

    def fill_stages(self, capture: CapturePlan) -> None:
        """After a replay: each capture plan's stage from the captured buffers (its rows, its layers)."""
        for pp in capture.points:
            parts = [self.captured[(pp.point, layer)] for layer in pp.keys]
            pick = (lambda t: t[pp.rows]) if isinstance(pp.rows, slice) else (lambda t: t.index_select(0, pp.rows))
            pp.stage = torch.stack([pick(p) for p in parts], dim=1)
