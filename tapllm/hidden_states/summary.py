"""A short human-readable table of what a request captured (used by the CLI)."""

from __future__ import annotations

import textwrap

import torch

from tapllm.hidden_states.result import HiddenStates
from tapllm.hidden_states.spec import PSEUDO_POINTS
from tapllm.utils.dtypes import dtype_name


def summarize(hs: HiddenStates) -> str:
    """Point, layers, shape and the mean L2 norm per layer, one row per point."""
    pos = hs.positions.tolist()
    span = f"{pos[0]}..{pos[-1]}" if pos else "none"
    dtype = next(iter(hs.values())).dtype if len(hs) else None
    head = f"hidden states: {len(pos)} positions ({span}), reduce={hs.reduce}, dtype={dtype_name(dtype)}"
    rows = [("point", "layers", "shape", "mean norm per layer")]
    for point, t in hs.items():
        layers = ["-"] if point in PSEUDO_POINTS else [str(i) for i in hs.layers]
        norms = _layer_norms(t, reduced=hs.reduce is not None)
        cells = "  ".join(f"{name}: {v:.4g}" for name, v in zip(layers, norms.tolist()))
        rows.append((point, _compact(layers), str(tuple(t.shape)), cells))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [head]
    for r in rows:
        prefix = f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  "
        wrapped = textwrap.wrap(r[3], width=max(40, 110 - len(prefix))) or [""]
        lines.append(prefix + wrapped[0])
        lines.extend(" " * len(prefix) + more for more in wrapped[1:])
    return "\n".join(lines)


def _layer_norms(t: torch.Tensor, reduced: bool) -> torch.Tensor:
    t = t.float()
    if reduced:  # [layers, ...]
        return t.reshape(t.shape[0], -1).norm(dim=-1)
    if t.shape[0] == 0:
        return torch.full((t.shape[1],), float("nan"))
    return t.reshape(*t.shape[:2], -1).norm(dim=-1).mean(0)  # [positions, layers, *row] -> per layer


def _compact(layers: list[str]) -> str:
    if len(layers) > 4:
        return f"{layers[0]},{layers[1]},...,{layers[-1]} ({len(layers)})"
    return ",".join(layers)
