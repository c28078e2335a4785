"""Every place a model's forward calls the tap, numbered: the sites a graph step's tables are indexed by.

A site is one (point, layer) the model passes through its tap: ``embed`` and ``final`` once (the
pseudo-layer), every other tensor point once per block. Its row is what one position holds there,
seen as ``groups x group_width`` numbers: a head point's row is ``heads x head_dim`` (a direction is
taken per head), every other row is one group (a direction over the whole row). Attention
patterns and expert outputs are not sites (:data:`EAGER_POINTS`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tapllm.tap.points import BY_NAME, TABLE
from tapllm.tap.protocol import PSEUDO_LAYER

# Points that are not sites: a step capturing them runs eagerly. Attention patterns are computed beside
# attention; an expert's outputs are [n_experts, hidden] a position, too wide for a table's rows.
EAGER_POINTS = ("attn_pattern", "expert_out")


@dataclass(frozen=True, slots=True)
class Site:
    """One (point, layer) of the forward: its index in the tables and its row's layout."""

    index: int
    point: str
    layer: int
    groups: int
    group_width: int

    @property
    def width(self) -> int:
        """Numbers in one position's row."""
        return self.groups * self.group_width


class Sites:
    """The numbered sites of one model (see the module docstring)."""

    def __init__(self, num_layers: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """``shapes``: the row shape of every point the model has (hidden-size points included)."""
        out: list[Site] = []
        for point in TABLE:
            if point.name in EAGER_POINTS or point.name not in shapes:
                continue
            shape = tuple(shapes[point.name])
            groups, width = (shape[0], math.prod(shape[1:])) if point.heads is not None else (1, math.prod(shape))
            layers = (PSEUDO_LAYER,) if point.group == "pseudo" else range(num_layers)
            first = len(out)
            out.extend(Site(first + k, point.name, layer, groups, width) for k, layer in enumerate(layers))
        self.all: tuple[Site, ...] = tuple(out)
        self.index: dict[tuple[str, int], int] = {(s.point, s.layer): s.index for s in out}
        self.max_width = max(s.width for s in out)

    def __len__(self) -> int:
        return len(self.all)

    def of(self, point: str, layer: int) -> Site:
        """The site of ``point`` at ``layer`` (``KeyError`` when the model has none there)."""
        return self.all[self.index[(point, layer)]]

    def steerable(self, point: str) -> bool:
        """Whether a steer may change ``point``."""
        return BY_NAME[point].steerable
