"""What hidden states a request asks for: ``HiddenStatesSpec``, its checks and its CLI form."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tapllm._options import from_mapping
from tapllm.dtypes import DTYPES  # re-exported: capture.py reads it from here
from tapllm.hidden_states.reducers import get_reducer

# TransformerLens-style names; see DESIGN.md for their exact meaning.
BLOCK_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
PSEUDO_POINTS = ("embed", "final")  # one pseudo-layer each
POINTS = ("embed", *BLOCK_POINTS, "final")
POSITION_NAMES = ("prompt", "generated", "all", "last_prompt", "last")


@dataclass(slots=True)
class HiddenStatesSpec:
    """Which activations to return with a request.

    Args:
        layers: decoder block indices (negative counts from the end) or ``"all"``.
        points: names from ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``,
            ``resid_post`` (per block) and ``embed``, ``final`` (one pseudo-layer each).
        positions: ``"prompt"``, ``"generated"``, ``"all"``, ``"last_prompt"``, ``"last"`` or
            a window ``(start, stop)`` of absolute token positions, ``stop`` exclusive.
        reduce: ``None`` (one row per position) or a reducer over the positions: ``"mean"``,
            ``"sum"``, ``"max"``, ``"min"``, ``"first"``, ``"last"`` or a plugin's name.
        project: optional ``[k, hidden]`` directions; states become ``states @ project.T``
            (before any reduction).
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``None`` (the model's dtype).

    Model-independent checks run here; layer range, projection width and the window's fit
    to the sequence are checked when a request is added (they depend on model and prompt).
    """

    layers: Sequence[int] | str = "all"
    points: Sequence[str] | str = ("resid_post",)
    positions: str | tuple[int, int] = "all"
    reduce: str | None = None
    project: torch.Tensor | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        self.points = _check_points(self.points)
        self.layers = _check_layers(self.layers)
        self.positions = _check_positions(self.positions)
        if self.reduce is not None:
            if not isinstance(self.reduce, str):
                raise ValueError(f"hidden_states.reduce must be a reducer name or None, got {self.reduce!r}")
            get_reducer(self.reduce)  # raises naming the known reducers
        if self.project is not None:
            self.project = _check_project(self.project)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"hidden_states.dtype must be one of {list(DTYPES)} or None, got {self.dtype!r}")

    @classmethod
    def from_any(cls, value: HiddenStatesSpec | Mapping[str, Any]) -> HiddenStatesSpec:
        """Accept a spec or a plain dict with the same keys."""
        return from_mapping(cls, value, "hidden_states")

    @classmethod
    def parse(cls, text: str) -> HiddenStatesSpec:
        """Parse the command-line form, e.g. ``"layers=0,-1 points=resid_post positions=prompt reduce=mean"``.

        ``positions`` may also be a window ``start:stop``.
        """
        kwargs: dict[str, Any] = {}
        for token in text.split():
            key, sep, val = token.partition("=")
            if not sep or not val:
                raise ValueError(f"--hidden-states: expected key=value, got {token!r}")
            if key == "layers":
                kwargs[key] = val if val == "all" else [_int(v, "layers") for v in val.split(",")]
            elif key == "points":
                kwargs[key] = val.split(",")
            elif key == "positions":
                if ":" in val:
                    a, _, b = val.partition(":")
                    kwargs[key] = (_int(a, "positions"), _int(b, "positions"))
                else:
                    kwargs[key] = val
            elif key in ("reduce", "dtype"):
                kwargs[key] = None if val == "none" else val
            else:
                raise ValueError(
                    f"--hidden-states: unknown key {key!r}; use layers, points, positions, reduce, dtype"
                )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (the projection is given by its shape only)."""
        return {
            "layers": self.layers,
            "points": list(self.points),
            "positions": list(self.positions) if isinstance(self.positions, tuple) else self.positions,
            "reduce": self.reduce,
            "project": list(self.project.shape) if self.project is not None else None,
            "dtype": self.dtype,
        }


def _int(text: str, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--hidden-states: {field} needs integers, got {text!r}") from None


def _check_points(points: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(points, str):
        points = [points]
    out = tuple(points)
    if not out:
        raise ValueError("hidden_states.points is empty: name at least one point")
    for p in out:
        if p not in POINTS:
            raise ValueError(f"hidden_states.points: unknown point {p!r}; choose from {list(POINTS)}")
    if len(set(out)) != len(out):
        raise ValueError(f"hidden_states.points has duplicates: {list(out)}")
    return out


def _check_layers(layers: Sequence[int] | str) -> list[int] | str:
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"hidden_states.layers must be 'all' or a list of block indices, got {layers!r}")
        return layers
    if isinstance(layers, int):
        layers = [layers]
    try:
        out = [operator.index(i) for i in layers]
    except TypeError:
        raise ValueError(f"hidden_states.layers must hold integers, got {layers!r}") from None
    if not out:
        raise ValueError("hidden_states.layers is empty: give block indices or 'all'")
    return out


def _check_positions(positions: Any) -> str | tuple[int, int]:
    if isinstance(positions, str):
        if positions not in POSITION_NAMES:
            raise ValueError(
                f"hidden_states.positions: unknown selection {positions!r}; "
                f"use one of {list(POSITION_NAMES)} or a window (start, stop)"
            )
        return positions
    try:
        start, stop = (operator.index(v) for v in positions)
    except (TypeError, ValueError):
        raise ValueError(
            f"hidden_states.positions must be a name or a (start, stop) pair of integers, got {positions!r}"
        ) from None
    if start < 0:
        raise ValueError(f"hidden_states.positions: window start must be >= 0, got {start}")
    if stop <= start:
        raise ValueError(f"hidden_states.positions: window [{start}, {stop}) is empty (stop must exceed start)")
    return (start, stop)


def _check_project(project: Any) -> torch.Tensor:
    try:
        t = project if isinstance(project, torch.Tensor) else torch.as_tensor(project)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("hidden_states.project must be a [k, hidden] matrix of numbers") from None
    if t.dim() != 2 or t.shape[0] < 1:
        raise ValueError(f"hidden_states.project must be a [k, hidden] matrix, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.float()
    t = t.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(t).all():
        raise ValueError("hidden_states.project holds NaN or infinite values")
    return t
