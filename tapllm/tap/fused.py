"""Sites a kernel applies itself: what a graph step's tap hands the fused ops of a block.

A graph step's tap (``tapllm.engine.table_tap.TableTap``) reads the slot tables of
:mod:`tapllm.tap.tables` at every site. A kernel that computes a site's tensor (a norm with its
residual add, rotary with the K/V write, the gated activation) can apply the site to the rows it holds instead, in the
eager order, before it stores them, and save the site's own launch. Such a tap is a
:class:`FusingTap`: it hands out its :class:`KernelSites` (the tables and the step's row -> slot
map and positions). The model names the sites each fused op applies (:class:`NormSites`,
:class:`HeadSites`, or a site number) and does not call the tap at those points; every other point still goes
through ``tap(point, layer, x)``. Where a fused op cannot take its sites (rows wider than a
tile, an op without them), the model calls the tap at each point as it would without fusion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.tap.tables import TapTables

Point = tuple[str, int]  # (point, layer)


@dataclass(frozen=True, slots=True)
class KernelSites:
    """A graph step's slot tables and rows, as a kernel reads them to apply sites itself."""

    tables: TapTables
    row_slot: torch.Tensor  # [T] each row's slot
    positions: torch.Tensor  # [T] each row's position

    def index(self, point: str, layer: int) -> int | None:
        """The site of ``point`` at ``layer``, or None when the model has none there (the tap does nothing)."""
        return self.tables.sites.index.get((point, layer))

    def indices(self, points: Iterable[Point]) -> tuple[int, ...]:
        """The sites of ``points`` that exist, in order."""
        found = (self.index(point, layer) for point, layer in points)
        return tuple(s for s in found if s is not None)


@dataclass(frozen=True, slots=True)
class NormSites:
    """The sites a norm kernel applies to a row, in this order: ``on_r`` to the rows added to the
    residual (before the add), ``on_x`` to the residual (after the add; the kernel stores it),
    ``on_out`` to the normed rows."""

    rows: KernelSites
    on_r: tuple[int, ...] = ()
    on_x: tuple[int, ...] = ()
    on_out: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class HeadSites:
    """The sites the rotary kernel applies to q and k after rotary and to v (None: no site), before
    the keys and values reach the cache."""

    rows: KernelSites
    q: int | None
    k: int | None
    v: int | None


class FusingTap(ABC):
    """A tap whose sites kernels may apply (see the module docstring)."""

    @property
    @abstractmethod
    def kernel_sites(self) -> KernelSites | None:
        """What a kernel reads to apply this step's sites, or None to pass every point through the tap."""


def kernel_sites(tap: Any) -> KernelSites | None:
    """``tap``'s :class:`KernelSites` when it is a :class:`FusingTap` that fuses, else None."""
    return tap.kernel_sites if isinstance(tap, FusingTap) else None
