"""What a model sees of capture and steering: the tap.

A model calls ``x = tap(point, layer, x)`` on every named point of its forward (block points
with the block index, ``embed`` and ``final`` with :data:`PSEUDO_LAYER`; inside attention
``q``, ``k``, ``v`` ``[T, heads, head_dim]`` and ``z``, inside the MLP ``mlp_post``) and goes on
with what the tap returns. Attention also asks ``tap.wants_pattern(layer)``: when some
request of the step captures ``attn_pattern`` there, it hands the tap its queries and the
layer's key cache (``tap.pattern``). ``tap.steers(point, layer)`` tells whether the tap may
change ``x`` at that point, so a model may compute what reads the point before calling the
tap only when it does not (e.g. a residual add fused with the next norm), and
``tap.touches(layer)`` whether it does anything at all in block ``layer`` (blocks it leaves
alone may run as fused code that calls no tap). ``tap.wants(point, layer)`` tells whether the tap
may steer or record ``point`` there: a model computes a point that costs work of its own
(``expert_out``: every expert's rows) only when it does. The engine's tap
(``tapllm.engine.step_tap.StepTap``) steers and records the rows of the requests that asked;
:data:`no_tap` is used when none did. A graph step's tap is also a
:class:`~tapllm.tap.fused.FusingTap`: kernels that compute a point's tensor may apply its sites
themselves, and the model then does not call the tap there.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

PSEUDO_LAYER = -1  # the layer of the "embed" and "final" points


class Tap(Protocol):
    """The hook a model calls at each point (see the module docstring)."""

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor: ...

    def wants_pattern(self, layer: int) -> bool: ...

    def steers(self, point: str, layer: int) -> bool: ...

    def touches(self, layer: int) -> bool: ...

    def wants(self, point: str, layer: int) -> bool: ...

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None: ...


class _NoTap:
    """The tap of a step where nobody captures or steers: returns ``x`` untouched."""

    __slots__ = ()

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x

    def wants_pattern(self, layer: int) -> bool:
        return False

    def steers(self, point: str, layer: int) -> bool:
        return False

    def touches(self, layer: int) -> bool:
        return False

    def wants(self, point: str, layer: int) -> bool:
        return False

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None:
        return None


no_tap: Tap = _NoTap()
