"""The per-step steering plan the step's tap applies at each point.

The plan lists, per (point, block), the batch rows of steered requests and what to do to
them. The tap applies it right after the model computes each steerable tensor, before that
tensor is recorded or used, so the rest of the forward (and any captured state) sees the
steered value. Rows of other requests are never touched; a step without steered requests
has no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.steering.resolved import RequestSteering
from tapllm.tap import RowSpan, rows_tensor


@dataclass(slots=True)
class _AddRows:
    """Add each ``(n, vector)`` of ``deltas`` to its run of ``n`` batch rows in ``rows`` in one
    ``index_add_``; no row is listed twice (see :func:`_merged_adds`)."""

    rows: torch.Tensor
    deltas: list[tuple[int, torch.Tensor]]

    def apply(self, t: torch.Tensor) -> None:
        # Expanded to the point's row here: a head point's vector may be [head_dim], for every head.
        row = t.shape[1:]
        t.index_add_(0, self.rows, torch.cat([v.expand(n, *row) for n, v in self.deltas]))


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
        if self.op in ("ban", "force"):  # router logits: -inf never chosen, +inf always (tapllm.steering.router)
            t[key] = float("-inf") if self.op == "ban" else float("inf")
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
# The operations made of plain tensors and numbers only: they can be sent to another process (pickled) and
# applied there with the same result (an SAE edit holds the SAE, possibly prepacked for oneDNN, and cannot).
PLAIN_OPS: tuple[type, ...] = (_AddRows, _Op)


class SteeringPlan:
    """The steering of one step: per (point, block), the operations on the planned rows.

    Built from the step's row spans of steered requests, each with its steering; the step's
    tap applies ``ops[(point, block)]`` to a point's tensor in place, on those rows only, in
    the order the request listed its steers.
    """

    def __init__(self, spans: Sequence[tuple[RowSpan, RequestSteering]], device: torch.device) -> None:
        found: dict[tuple[str, int], list[SteerOp]] = {}
        # per point: (the add's rank among its request's plain adds there, first row, stop row, vector)
        plain_adds: dict[tuple[str, int], list[tuple[int, int, int, torch.Tensor]]] = {}
        for span, steering in spans:
            ranks: dict[tuple[str, int], int] = {}
            for s in steering.steers:
                w = s.window(steering.num_prompt, span.start, span.num_tokens)
                if w is None:
                    continue
                if isinstance(w, tuple):
                    rows: slice | torch.Tensor = slice(span.row + w[0] - span.start, span.row + w[1] - span.start)
                    picked = None
                else:
                    rows = rows_tensor([span.row + p - span.start for p in w], device)
                    picked = rows_tensor([s._position_set[p] for p in w], device)
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
                        rank = ranks[key] = ranks.get(key, -1) + 1
                        plain_adds.setdefault(key, []).append((rank, rows.start, rows.stop, payload))
        self.ops: dict[tuple[str, int], list[SteerOp]] = {}
        for key, ops in found.items():
            adds = plain_adds.get(key, [])
            if len(ops) > 1 and len(adds) == len(ops):
                self.ops[key] = _merged_adds(adds, device)
            else:
                self.ops[key] = list(ops)

    def __bool__(self) -> bool:
        return bool(self.ops)


def _merged_adds(adds: Sequence[tuple[int, int, int, torch.Tensor]], device: torch.device) -> list[_AddRows]:
    """The plain additions at one point, ``(rank, first row, stop row, vector)``, as few ``index_add_``
    calls as keep each row's arithmetic that of the request alone: call ``k`` adds every request's
    ``k``-th addition there.

    Requests own disjoint rows, so their additions commute; one request's do not in a low-precision
    dtype. Each ``x + v`` rounds to the model's dtype in the order the request listed its steers,
    as the unmerged operation and the graph step's tap do, whatever else the step holds. (On the CPU
    ``index_add_`` sums a row listed twice in float32 and rounds once, on CUDA in any order.)
    """
    calls = []
    for rank in range(max(a[0] for a in adds) + 1):
        part = [(r0, r1, v) for k, r0, r1, v in adds if k == rank]
        rows = torch.cat([torch.arange(r0, r1, device=device) for r0, r1, _ in part])
        calls.append(_AddRows(rows, [(r1 - r0, v) for r0, r1, v in part]))
    return calls
