"""``HiddenStates``: what a request returns, and its safetensors file form."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tapllm._files import atomic_write
from tapllm.dtypes import dtype_name

FORMAT = "tapllm.hidden_states"
VERSION = "1"


class HiddenStates(Mapping[str, torch.Tensor]):
    """Captured activations of one request, by point.

    ``hs[point]`` is a contiguous CPU tensor ``[positions, layers, hidden]``; with a reduction
    ``[layers, hidden]``; with a projection ``hidden`` is ``k``. ``embed`` and ``final`` have
    one layer each; the other points have one entry per block in ``layers``.

    Attributes:
        positions: absolute token positions captured (reduced over, when reduced).
        layers: the resolved block indices, in the order of the layer dimension.
        reduce: the reducer's name, or None.
        spec: the request's spec as a dict (informational).
        metadata: extra strings stored with the file (``save(metadata=...)``).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        positions: torch.Tensor,
        layers: list[int],
        reduce: str | None = None,
        spec: dict | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self._tensors = tensors
        self.positions = positions
        self.layers = list(layers)
        self.reduce = reduce
        self.spec = spec or {}
        self.metadata = metadata or {}

    def __getitem__(self, point: str) -> torch.Tensor:
        try:
            return self._tensors[point]
        except KeyError:
            raise KeyError(f"point {point!r} was not captured; captured: {list(self._tensors)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def points(self) -> tuple[str, ...]:
        """The captured points, in request order."""
        return tuple(self._tensors)

    @property
    def nbytes(self) -> int:
        """Bytes held by the captured tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{p}: {tuple(t.shape)} {dtype_name(t.dtype)}" for p, t in self.items())
        return f"HiddenStates({shapes}; {len(self.positions)} positions, layers={self.layers}, reduce={self.reduce})"

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
        """Write a safetensors file (atomically: a temporary file renamed into place).

        Tensors are named by point, plus ``positions``; the header metadata records the
        format, layers, reduction, spec and any extra ``metadata`` strings given.
        """
        path = Path(path)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "points": json.dumps(list(self.points)),
            "layers": json.dumps(self.layers),
            "reduce": json.dumps(self.reduce),
            "spec": json.dumps(self.spec),
        }
        for k, v in (metadata or {}).items():
            if k in meta:
                raise ValueError(f"metadata key {k!r} is reserved")
            meta[str(k)] = str(v)
        tensors = {p: t.contiguous() for p, t in self._tensors.items()}
        tensors["positions"] = self.positions.contiguous()
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise FileNotFoundError(f"cannot save hidden states: no such directory: {parent}")
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> HiddenStates:
        """Read a file written by ``save``; extra metadata is in ``hs.metadata``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such hidden-states file: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ValueError(f"{path} is not a tapllm hidden-states file (format={meta.get('format')!r})")
                points = json.loads(meta["points"])
                tensors = {p: f.get_tensor(p) for p in points}
                positions = f.get_tensor("positions")
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable hidden-states file ({exc})") from None
        except Exception as exc:  # safetensors raises its own error type for a corrupt header
            if isinstance(exc, ValueError) and "hidden-states" in str(exc):
                raise
            raise ValueError(f"{path}: unreadable hidden-states file ({exc})") from None
        reserved = {"format", "version", "points", "layers", "reduce", "spec"}
        extra = {k: v for k, v in meta.items() if k not in reserved}
        return cls(
            tensors, positions, json.loads(meta["layers"]), json.loads(meta["reduce"]), json.loads(meta["spec"]), extra
        )
