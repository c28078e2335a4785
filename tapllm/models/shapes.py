"""The row shapes of a model's points, read off its modules (not guessed from its config)."""

from __future__ import annotations

from torch import nn

from tapllm.models.base import MLP, Attention, GatedMLP
from tapllm.tap.points import HIDDEN_POINTS, row_shapes


def point_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """One position's row shape at one block, per point inside attention and the MLP that ``model`` has.

    The dimensions come from its first attention and MLP modules (every block of the
    families here has the same); a point whose module the model lacks is left out.
    """
    dims: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Attention) and "heads" not in dims:
            dims.update(heads=m.num_heads, kv_heads=m.num_kv, head_dim=m.head_dim)
        elif isinstance(m, GatedMLP | MLP) and "d_mlp" not in dims:
            dims["d_mlp"] = m.inter
    return {name: shape for name, shape in row_shapes(dims).items() if name not in HIDDEN_POINTS}
