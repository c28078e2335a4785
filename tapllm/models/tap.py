"""What a model sees of capture and steering: one callable, the tap.

A model calls ``x = tap(point, layer, x)`` on every named point of its forward (block
points with the block index, ``embed`` and ``final`` with :data:`PSEUDO_LAYER`) and goes on
with what the tap returns. The engine's tap (``tapllm.engine.tap.StepTap``) steers and
records the rows of the requests that asked; :func:`no_tap` is used when none did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tap = Callable[[str, int, torch.Tensor], torch.Tensor]
PSEUDO_LAYER = -1  # the layer of the "embed" and "final" points


def no_tap(point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The tap of a step where nobody captures or steers: returns ``x`` untouched."""
    return x
