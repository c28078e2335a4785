"""The tap: the one hook a model calls at its named points, and what describes a step to it.

A leaf package (it imports nothing else of tapllm): the :class:`Tap` protocol and
:data:`no_tap`, the one table of points (:mod:`tapllm.tap.points`), layer and head index
resolution, and :class:`RowSpan`, where a request's chunk sits in a step's batch.

The names are imported on first use (PEP 562), so that reading the table of points (the
command line's help does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "resolve_indices": "indices", "resolve_layers": "indices",
    "BY_NAME": "points", "POINTS": "points", "TABLE": "points", "Point": "points", "row_shapes": "points",
    "PSEUDO_LAYER": "protocol", "Tap": "protocol", "no_tap": "protocol",
    "RowSpan": "spans", "rows_tensor": "spans",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tapllm.tap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tapllm.tap.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
