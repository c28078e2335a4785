"""Layer, head and neuron indices checked against a model: negative ones count from the end."""

from __future__ import annotations

from collections.abc import Sequence


def resolve_layers(layers: Sequence[int], num_layers: int, where: str, *, unique: bool = True) -> tuple[int, ...]:
    """Block indices of ``layers`` in ``[0, num_layers)``; ``ValueError`` names ``where``."""
    out = []
    for i in layers:
        if not -num_layers <= i < num_layers:
            raise ValueError(f"{where}: layer {i} is out of range for a {num_layers}-block model "
                             f"(valid: {-num_layers}..{num_layers - 1})")
        out.append(i % num_layers)
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{where} names a block twice: {list(layers)} -> {out}")
    return tuple(out)


def resolve_indices(chosen: Sequence[int], n: int, where: str, what: str, label: str = "") -> tuple[int, ...]:
    """Indices of ``chosen`` among ``n`` heads or neurons (``what``); ``ValueError`` names ``where``
    and writes ``label`` before the bad index."""
    bad = [c for c in chosen if not -n <= c < n]
    if bad:
        raise ValueError(f"{where}: {label}{bad[0]} is out of range for {n} {what}")
    return tuple(c % n for c in chosen)
