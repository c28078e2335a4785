"""A request's capture and steering as the rows of its slot in the graph step's tables.

:func:`slot_capture` lays out what one position of the request captures (its *record*: every point
it records, every layer of it, site after site) and the positions it captures; :func:`slot_ops`
turns its resolved steers into operations over full-width pool rows (a head or neuron selection
becomes the values that leave the others unchanged: 0 to add, 1 to multiply, a zero direction,
NaN to set). :class:`RecordLayout` is how the host finds each point in a record again. What a
table cannot hold (attention patterns, SAE feature edits) is named, and such a request's steps
run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tapllm.hidden_states.capture import RequestCapture
from tapllm.steering.resolved import RequestSteering, ResolvedSteer
from tapllm.tap.sites import Sites
from tapllm.tap.tables import NO_END, OP_ADD, OP_DIRECTION, OP_SCALE, OP_SET, SlotCapture, SlotOp


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """Where each recorded point sits in a request's record: ``(point, layer keys, first number, numbers)``."""

    parts: tuple[tuple[str, tuple[int, ...], int, int], ...]
    size: int
    at: dict[tuple[str, int], int] = field(default_factory=dict, compare=False)  # (point, layer key) -> first number

    def part(self, point: str) -> tuple[tuple[int, ...], int, int]:
        for name, keys, start, n in self.parts:
            if name == point:
                return keys, start, n
        raise KeyError(point)


def slot_capture(capture: RequestCapture, sites: Sites) -> tuple[SlotCapture | None, RecordLayout | None, str | None]:
    """The capture rows of ``capture``'s slot and its record layout, or why a table cannot hold it."""
    sel = capture.sel
    if "attn_pattern" in sel.points:
        return None, None, "attention patterns are captured"
    if "expert_out" in sel.points:
        return None, None, "expert outputs are captured"
    offsets: dict[int, int] = {}
    at: dict[tuple[str, int], int] = {}
    parts = []
    size = 0
    for point in sel.tap_points():
        keys = sel.tap_keys(point)
        start = size
        for key in keys:
            site = sites.of(point, key)
            offsets[site.index] = at[(point, key)] = size
            size += site.width
        parts.append((point, tuple(keys), start, size - start))
    lo = max(sel.lo, capture.next_pos)
    return SlotCapture(offsets, size, lo, sel.hi, sel.last_only), RecordLayout(tuple(parts), size, at), None


def slot_ops(steering: RequestSteering, sites: Sites) -> tuple[list[SlotOp], str | None]:
    """The steering operations of a request's slot, in its steers' order, or why a table cannot hold them."""
    ops: list[SlotOp] = []
    for s in steering.steers:
        if s.sae is not None:
            return [], "a steer edits SAE features"
        for lo, hi, stride, picked in _ranges(s, steering.num_prompt):
            for block in s.blocks:
                site = sites.of(s.point, block)
                rows, kind, value = _rows(s, block, site.groups, site.group_width, picked)
                ops.append(SlotOp(site.index, kind, lo, hi, rows.reshape(rows.shape[0], -1), stride, value))
    return ops, None


def _ranges(s: ResolvedSteer, num_prompt: int) -> list[tuple[int, int, int, list[int] | None]]:
    """``(lo, hi, pool rows per position, rows of the steer's values)`` for each run of positions."""
    if isinstance(s.positions, str):
        lo, hi = {"all": (0, NO_END), "prompt": (0, num_prompt), "generated": (num_prompt, NO_END)}[s.positions]
        return [(lo, hi, 0, None)] if lo < hi else []
    runs: list[tuple[int, int, int, list[int] | None]] = []
    positions = list(s.positions)
    i = 0
    while i < len(positions):
        j = i
        while j + 1 < len(positions) and positions[j + 1] == positions[j] + 1:
            j += 1
        picked = [s._position_set[p] for p in positions[i : j + 1]]
        runs.append((positions[i], positions[j] + 1, 1 if s.op == "set" else 0, picked))
        i = j + 1
    return runs


def _rows(s: ResolvedSteer, block: int, groups: int, width: int, picked: list[int] | None
          ) -> tuple[torch.Tensor, int, float]:
    """Full-width pool rows ``[n, groups, width]`` (float32) of steer ``s`` at ``block``, its kind and value."""
    shape = (groups, width) if groups > 1 else (width,)
    index = s.index.cpu() if s.index is not None else slice(None)
    if s.op == "set":
        values = s.payload[block].float().cpu()[picked]  # [n, *row]
        full = torch.full((values.shape[0], *shape), float("nan"))
        full[:, index] = values
        return full, OP_SET, 0.0
    if s.op in ("ban", "force"):  # router logits: -inf never chosen, +inf always; NaN keeps the other experts
        full = torch.full(shape, float("nan"))
        full[index] = float("-inf") if s.op == "ban" else float("inf")
        return full[None], OP_SET, 0.0
    if s.op == "scale":
        full = torch.ones(shape)
        full[index] = float(torch.tensor(s.factor, dtype=torch.float32))
        return full[None], OP_SCALE, 0.0
    payload = s.payload[block].float().cpu()
    full = torch.zeros(shape)
    full[index] = payload
    if s.op == "add":
        return full[None], OP_ADD, 0.0
    return full[None], OP_DIRECTION, 0.0 if s.op == "ablate" else float(s.value)
