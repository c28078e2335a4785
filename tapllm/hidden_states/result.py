"""``HiddenStates``: what a request returns, and its safetensors file form."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tapllm.hidden_states.lens import Lens, LensResult
from tapllm.sae.features import Features
from tapllm.utils.dtypes import dtype_name
from tapllm.utils.files import atomic_write

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
        lens: Lens | None = None,
        features: Features | None = None,
    ) -> None:
        self._tensors = tensors
        self.positions = positions
        self.layers = list(layers)
        self.reduce = reduce
        self.spec = spec or {}
        self.metadata = metadata or {}
        self.lens = lens
        self.features = features

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
        """Bytes held by the captured tensors (the lens's included)."""
        return sum(t.numel() * t.element_size() for t in self._flat().values())

    def _flat(self) -> dict[str, torch.Tensor]:
        """Every tensor under a unique name: the points, then ``lens.<point>.<field>``."""
        flat = dict(self._tensors)
        for point, res in (self.lens or {}).items():
            for field in ("token_ids", "logprobs", "target_logprobs"):
                t = getattr(res, field)
                if t is not None:
                    flat[f"lens.{point}.{field}"] = t
        for name, t in (self.features.tensors() if self.features is not None else {}).items():
            flat[f"features.{name}"] = t
        return flat

    def __repr__(self) -> str:
        shapes = ", ".join(f"{p}: {tuple(t.shape)} {dtype_name(t.dtype)}" for p, t in self.items())
        return f"HiddenStates({shapes}; {len(self.positions)} positions, layers={self.layers}, reduce={self.reduce})"

    def plot_lens(self, path: str | os.PathLike, tokenizer: Any = None, point: str | None = None,
                  input_tokens: list[int] | None = None) -> Path:
        """Write the logit lens as a heatmap: ``.png`` (matplotlib) or ``.html`` (self-contained).

        ``tokenizer`` turns ids into text (ids are shown otherwise); ``input_tokens`` (the
        request's tokens) label the positions.
        """
        from tapllm.hidden_states.plots import save_lens_html, save_lens_png

        save = save_lens_html if str(path).endswith((".html", ".htm")) else save_lens_png
        return save(self, path, tokenizer, point, input_tokens)

    def plot_norms(self, path: str | os.PathLike, point: str | None = None) -> Path:
        """Write a PNG of ``point``'s state norm per layer (one line per position, and their mean)."""
        from tapllm.hidden_states.plots import save_norms_png

        return save_norms_png(self, path, point)

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
        """Write a safetensors file (atomically: a temporary file renamed into place).

        Tensors are named by point, plus ``positions``; the header metadata records the
        format, layers, reduction, spec, ``self.metadata`` (e.g. the engine's ``quantization``)
        and any extra ``metadata`` strings given.
        """
        path = Path(path)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "points": json.dumps(list(self.points)),
            "layers": json.dumps(self.layers),
            "reduce": json.dumps(self.reduce),
            "spec": json.dumps(self.spec),
            "lens_targets": json.dumps(self.lens.targets if self.lens is not None else None),
            "features": json.dumps({"feature_ids": self.features.feature_ids, "sae": self.features.sae}
                                   if self.features is not None else None),
        }
        for k, v in {**self.metadata, **(metadata or {})}.items():
            if k in meta:
                raise ValueError(f"metadata key {k!r} is reserved")
            meta[str(k)] = str(v)
        tensors = {p: t.contiguous().cpu() for p, t in self._flat().items()}  # states may live on a GPU
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
                lens = _read_lens({k: f.get_tensor(k) for k in f.keys() if k.startswith("lens.")},
                                  json.loads(meta.get("lens_targets", "null")))
                features = _read_features({k: f.get_tensor(k) for k in f.keys() if k.startswith("features.")},
                                          json.loads(meta.get("features", "null")))
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable hidden-states file ({exc})") from None
        except Exception as exc:  # safetensors raises its own error type for a corrupt header
            if isinstance(exc, ValueError) and "hidden-states" in str(exc):
                raise
            raise ValueError(f"{path}: unreadable hidden-states file ({exc})") from None
        reserved = {"format", "version", "points", "layers", "reduce", "spec", "lens_targets", "features"}
        extra = {k: v for k, v in meta.items() if k not in reserved}
        return cls(tensors, positions, json.loads(meta["layers"]), json.loads(meta["reduce"]), json.loads(meta["spec"]),
                   extra, lens, features)


def _read_features(flat: dict[str, torch.Tensor], meta: dict | None) -> Features | None:
    """SAE features from ``features.<field>`` tensors (None when there are none)."""
    if not flat or meta is None:
        return None
    t = {k.removeprefix("features."): v for k, v in flat.items()}
    return Features(t["positions"], t["error_norm"], ids=t.get("ids"), values=t.get("values"), dense=t.get("dense"),
                    feature_ids=meta.get("feature_ids"), sae=meta.get("sae", ""))


def _read_lens(flat: dict[str, torch.Tensor], targets: list[int] | None) -> Lens | None:
    """The lens from ``lens.<point>.<field>`` tensors (None when there are none)."""
    if not flat:
        return None
    points = sorted({k.split(".")[1] for k in flat})
    results = {p: LensResult(flat[f"lens.{p}.token_ids"], flat[f"lens.{p}.logprobs"],
                             flat.get(f"lens.{p}.target_logprobs")) for p in points}
    return Lens(results, targets)
