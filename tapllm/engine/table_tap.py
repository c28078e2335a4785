"""The tap of a graph step: every site reads the slot tables (``tapllm.tap.tables``) through one kernel.

Unlike the eager step's tap (``tapllm.engine.step_tap``), built for one step from its requests,
this tap is the same object for every step a graph replays: at each site it launches the site
kernel (``tapllm.kernels.triton_tap``), which looks each row's slot up and steers and captures what
that slot asked for, and nothing else. Before the first block, :meth:`TableTap.begin` places each
captured row in the capture buffer. Since any slot may steer any point, the tap says it steers
every steerable point, so the model never fuses a residual add past a point a steer could change.

It is also a :class:`~tapllm.tap.fused.FusingTap`: a model whose norms, rotary and activation can
apply sites themselves (the Llama family's, on the CUDA backend's kernels) takes its
:attr:`TableTap.kernel_sites` and calls the tap only at the points no kernel of its applies (``z``),
so a tapped block launches one kernel more than a plain one rather than one more per site.
"""

from __future__ import annotations

import torch

from tapllm.kernels.triton_tap import prologue, tap_site
from tapllm.tap.fused import FusingTap, KernelSites
from tapllm.tap.points import BY_NAME
from tapllm.tap.tables import TapTables


class TableTap(FusingTap):
    """The :class:`tapllm.tap.Tap` of a graph step (see the module docstring); ``fuse=False`` hands no
    kernel its sites (every site is then its own launch)."""

    def __init__(self, tables: TapTables, row_slot: torch.Tensor, positions: torch.Tensor,
                 last_rows: torch.Tensor, *, fuse: bool = True) -> None:
        self.tables = tables
        self.row_slot = row_slot
        self.positions = positions
        self.last_rows = last_rows
        self._sites = KernelSites(tables, row_slot, positions) if fuse else None

    @property
    def kernel_sites(self) -> KernelSites | None:
        return self._sites

    def begin(self) -> None:
        """Each captured row's place in the capture buffer (one kernel: part of the graph)."""
        prologue(self.tables, self.row_slot, self.positions, self.last_rows)

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        index = self.tables.sites.index.get((point, layer))
        if index is not None:
            tap_site(x, self.tables.sites.all[index], self.tables, self.row_slot, self.positions)
        return x

    def steers(self, point: str, layer: int) -> bool:
        return BY_NAME[point].steerable and (point, layer) in self.tables.sites.index

    def touches(self, layer: int) -> bool:
        return True

    def wants(self, point: str, layer: int) -> bool:
        return (point, layer) in self.tables.sites.index

    def wants_pattern(self, layer: int) -> bool:
        return False

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: object) -> None:
        raise RuntimeError("a graph step's tap captures no attention pattern")
