"""What a graph decode step hands each capturing request, worked out once for a placement of the step's
captured rows and reused while the next steps place them the same (a steady decode batch does: the
placement itself is kept, :class:`SteadyPlacement`, while the same slots move on a position a step and
no row crosses an edge of its capture span).

A :class:`DecodePlan` sorts the rows: a request that keeps its rows as captured takes views of the step's
host copy; a request that keeps only SAE features joins its SAE's :class:`FeatureGroup` (the group's
rows are one strided view of the capture buffer when evenly spaced, else gathered in one op each step,
encoded at once and copied to the host in one copy); any other request takes its block on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tapllm.engine.request import RequestStatus
from tapllm.hidden_states.capture import RequestCapture, RowViews, take_features_rows
from tapllm.hidden_states.sink import CopySink
from tapllm.sae.batch import PackLayout, group_pack
from tapllm.sae.features import FeatureSelection

_FINISHED = RequestStatus.FINISHED
FAR = 1 << 62  # a step count past any run


@dataclass(slots=True)
class SteadyPlacement:
    """A decode batch's placement of captured rows, kept while the same slots decode one position further a
    step and no row crosses an edge of its capture span (``GraphStep.shape``)."""

    slots: list[int]
    pos_sum: int
    left: int  # steps after the placing one with rows inside and outside their spans as placed
    placed: list
    total: int
    steps: int = 0

    def holds(self, lay: Any) -> bool:
        """Whether ``lay``, the next decode step, places its rows as this one: every row one position further
        (a row of the step before has since moved on at least one, so a sum one a row larger means each
        moved one), none past an edge."""
        return self.steps + 1 < self.left and lay.item_slots == self.slots and \
            sum(lay.pos) == self.pos_sum + len(lay.pos) * (self.steps + 1)

    def next(self) -> tuple[list, int]:
        """The placement for the step :meth:`holds` accepted."""
        self.steps += 1
        return self.placed, self.total


@dataclass(slots=True)
class How:
    """How a step hands a request its rows (``GraphStep._delivery``)."""

    capture: RequestCapture
    size: int  # numbers per position of the step's host copy it reads (0: none)
    views: RowViews | None  # it keeps its rows as captured: its views of the host copy
    # it keeps SAE features only: (its SAE's id, its selection, its SAE input's and target's first numbers in
    # its record)
    features: tuple[int, FeatureSelection, int, int | None] | None


def rows_view(buffer: torch.Tensor, width: int, starts: Sequence[int]) -> torch.Tensor | None:
    """The rows of ``width`` numbers of the flat ``buffer`` that start at ``starts`` as one strided view
    ``[len(starts), width]``, when they are evenly spaced and apart; else None."""
    if not starts:
        return None
    first, n = starts[0], len(starts)
    step = starts[1] - first if n > 1 else width
    if step < width or (n > 2 and tuple(starts) != tuple(range(first, first + step * n, step))):
        return None
    return buffer.as_strided((n, width), (step, 1), buffer.storage_offset() + first)


def rows_at(buffer: torch.Tensor, width: int, starts: Sequence[int]) -> torch.Tensor:
    """The rows of ``width`` numbers of the flat ``buffer`` that start at ``starts``: ``[len(starts), width]``,
    a view when :func:`rows_view` gives one, else one gather."""
    view = rows_view(buffer, width, starts)
    if view is not None:
        return view
    # through numpy: a third of torch.tensor's time on a list of ints
    index = torch.from_numpy(np.array(starts, dtype=np.int64)).to(buffer.device, non_blocking=True)
    # Every run of ``width`` numbers of the buffer as a row (a view): a row's first number picks it.
    return buffer.unfold(0, width, 1).index_select(0, index)


class FeatureGroup:
    """The requests of one SAE that keep only its features, with their rows of a decode step."""

    def __init__(self, buffer: torch.Tensor, widths: tuple[int, int], caps: Sequence[RequestCapture],
                 sels: Sequence[FeatureSelection], rows: Sequence[int], inputs: Sequence[int],
                 targets: Sequence[int]) -> None:
        self.caps, self.rows, self.fs = tuple(caps), tuple(rows), sels[0]
        self.layout = PackLayout(sels)
        self.widths, self.inputs, self.targets = widths, tuple(inputs), tuple(targets)
        # views stay valid step after step (the capture buffer is allocated once)
        self.x = rows_view(buffer, widths[0], self.inputs)
        self.target = None if self.fs.out is None else rows_view(buffer, widths[1], self.targets)

    def deliver(self, buffer: torch.Tensor, pos: Sequence[int], sink: CopySink) -> None:
        """Encode the group's rows and hand each request its row (position ``pos[row]``)."""
        fs, layout = self.fs, self.layout
        x = self.x if self.x is not None else rows_at(buffer, self.widths[0], self.inputs)
        target = None
        if fs.out is not None:
            target = self.target if self.target is not None else rows_at(buffer, self.widths[1], self.targets)
        host = sink.host_copy(group_pack(fs.sae, layout.sels, x, target, layout, True))
        take_features_rows(self.caps, host, layout.columns, self.rows, pos)


@dataclass(slots=True)
class DecodePlan:
    """A decode step's deliveries for one placement of its captured rows (module docstring)."""

    placed: list  # the placement it was made for (GraphStep._placed)
    buffer: torch.Tensor  # the capture buffer its views are of
    requests: list[Any] = field(default_factory=list)  # every request it delivers to
    kept: list[tuple[RequestCapture, RowViews, int, int]] = field(default_factory=list)  # cap, views, first, row
    groups: list[FeatureGroup] = field(default_factory=list)
    # requests that take their block on the device: (capture, record layout, row, first number, features)
    device: list[tuple[RequestCapture, Any, int, int, bool]] = field(default_factory=list)
    host_copy: bool = False  # some request reads the step's host copy

    def has_ended(self, stopped: set | frozenset) -> bool:
        """Whether a request it delivers to has finished or is in ``stopped`` since it was made."""
        return any(req.status is _FINISHED for req in self.requests) or \
            bool(stopped and not stopped.isdisjoint(self.requests))


def deliver_groups(plan: DecodePlan, pos: Sequence[int], sink: CopySink, failed: dict[RequestCapture, str]
                   ) -> None:
    """Each of ``plan``'s feature groups encoded and handed out; a group that fails puts its requests in
    ``failed``."""
    for g in plan.groups:
        try:
            g.deliver(plan.buffer, pos, sink)
        except Exception as exc:  # noqa: BLE001 - the group's requests fail, the others go on
            for cap in g.caps:
                failed[cap] = f"hidden_states: computing SAE features failed: {type(exc).__name__}: {exc}"


def decode_plan(placed: list, ended: set | frozenset, buffer: torch.Tensor, how: Callable[[Any], How],
                width: Callable[[str, int], int]) -> DecodePlan:
    """The :class:`DecodePlan` of ``placed`` (a decode step's captured rows: row, first number, count, and
    the slot's joined record with ``request``, ``layout``), leaving out requests that finished or are in
    ``ended``; ``how`` says how a row's request takes it, ``width(point, key)`` a site's row width."""
    plan = DecodePlan(placed, buffer)
    groups: dict[int, list[tuple]] = {}
    for r, first, _, joined in placed:
        req = joined.request
        if req.status is _FINISHED or req in ended:
            continue
        plan.requests.append(req)
        cap = req.capture
        h = how(joined)
        if h.views is not None:  # rows kept as captured: cut from the step's host copy when read
            plan.kept.append((cap, h.views, first, r))
        elif h.features is not None:
            _, fs, at_in, at_out = h.features
            groups.setdefault(h.features[0], []).append((cap, fs, r, first + at_in,
                                                         0 if at_out is None else first + at_out))
        else:
            plan.device.append((cap, joined.layout, r, first, cap.sel.features is not None))
            plan.host_copy |= cap.takes_host_rows and bool(cap.sel.points)
    plan.host_copy |= bool(plan.kept)
    for g in groups.values():
        caps, sels, rows, inputs, targets = zip(*g)
        fs = sels[0]
        widths = (width(fs.point, fs.key), width(*fs.out) if fs.out is not None else 0)
        plan.groups.append(FeatureGroup(buffer, widths, caps, sels, rows, inputs, targets))
    return plan
