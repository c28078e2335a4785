"""The residual stream between two norms, with its add and its taps left to the norm that reads it.

A Llama-family block ends with ``x = mid + m`` and the next block (or the final norm) begins by
norming ``x``: the add belongs in the norm's kernel. So a block hands on a :class:`Residual`: the
residual ``x``, the rows ``delta`` not yet added, and the points still to pass through the tap,
on ``delta`` before the add and on the sum after it. :func:`add_norm` makes it whole and norms it,
by the fastest route that gives every tap the values the eager block gives it:

* a graph step's tap that lets kernels apply its sites (:mod:`tapllm.tap.fused`): one norm kernel
  applies the sites on ``delta``, adds, applies the sites on the sum, stores it, norms, and applies
  the sites on the output;
* where no tap steers the sum: the tap on ``delta``, then the add fused with the norm (in place in
  ``x`` with the fused kernels), then the taps on the sum (they capture what the add stored);
* otherwise (a steer, or no fused ops): ``x + delta``, each tap, then the norm, as the eager block.

:meth:`Residual.whole` is the eager block's ``x + delta`` and taps, for what needs the whole
residual (a C++ run of blocks, the end of a step that stops early).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapllm.layers.norm import RMSNorm
from tapllm.tap import Tap
from tapllm.tap.fused import NormSites, Point, kernel_sites


@dataclass(slots=True)
class Residual:
    """The residual stream as a block hands it on (see the module docstring)."""

    x: torch.Tensor
    delta: torch.Tensor | None = None
    on_delta: tuple[Point, ...] = ()  # points ``delta`` has yet to pass through the tap, in order
    on_sum: tuple[Point, ...] = ()  # points of ``x + delta`` not yet tapped, in order

    def whole(self, tap: Tap) -> torch.Tensor:
        """``x + delta`` (a new tensor, as the eager block adds), each pending point tapped."""
        s = self.x
        if self.delta is not None:
            d = self.delta
            for point, layer in self.on_delta:
                d = tap(point, layer, d)
            s = s + d
        for point, layer in self.on_sum:
            s = tap(point, layer, s)
        return s


def add_norm(norm: RMSNorm, tap: Tap, res: Residual, points: tuple[Point, ...] = (),
             out: tuple[Point, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, h)``: ``s`` the whole residual, its pending points and then ``points`` tapped, and
    ``h = norm(s)`` with ``out`` tapped on it (see the module docstring for the routes)."""
    after = res.on_sum + points
    sites = kernel_sites(tap)
    if sites is not None:
        h = norm.norm_sites(res.x, res.delta, NormSites(sites, sites.indices(res.on_delta), sites.indices(after),
                                                       sites.indices(out)))
        if h is not None:
            return res.x, h
    d = res.delta
    for point, layer in res.on_delta:
        d = tap(point, layer, d)
    if d is not None and norm.ops is not None and not any(tap.steers(point, layer) for point, layer in after):
        s, h = norm.add_and_norm(res.x, d)
        for point, layer in after:
            s = tap(point, layer, s)
    else:
        s = res.x if d is None else res.x + d
        for point, layer in after:
            s = tap(point, layer, s)
        h = norm(s)
    for point, layer in out:
        h = tap(point, layer, h)
    return s, h
