"""The tap: the one hook a model calls at its named points, and what describes a step to it.

A leaf package (it imports nothing else of tapllm): the :class:`Tap` protocol and
:data:`no_tap`, the one table of points (:mod:`tapllm.tap.points`), layer and head index
resolution, and :class:`RowSpan`, where a request's chunk sits in a step's batch.
"""

from tapllm.tap.indices import resolve_indices, resolve_layers
from tapllm.tap.points import BY_NAME, POINTS, TABLE, Point, row_shapes
from tapllm.tap.protocol import PSEUDO_LAYER, Tap, no_tap
from tapllm.tap.spans import RowSpan, rows_tensor

__all__ = ["BY_NAME", "POINTS", "PSEUDO_LAYER", "TABLE", "Point", "RowSpan", "Tap", "no_tap", "resolve_indices",
           "resolve_layers", "row_shapes", "rows_tensor"]
