"""``Steer``: add or ablate a direction in the residual stream of one request.

``add`` adds ``scale * vector``; ``ablate`` removes the component along the unit direction,
``x - (x . d) d`` (``scale`` is ignored). Several steers of a request compose in order.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapllm._options import from_mapping

STEER_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
OPS = ("add", "ablate")
STEER_POSITIONS = ("all", "prompt", "generated")


@dataclass(slots=True)
class Steer:
    """One steering operation.

    Args:
        layers: block indices (negative from the end); may be omitted when ``vector`` is a
            ``{layer: vector}`` dict, whose keys then name the blocks.
        point: ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out`` or ``resid_post`` (see DESIGN.md).
        op: ``"add"`` or ``"ablate"``.
        vector: a ``[hidden]`` tensor for every listed block, or ``{layer: [hidden] tensor}``.
        scale: multiplies the vector for ``add``.
        positions: ``"all"``, ``"prompt"`` or ``"generated"``.
    """

    layers: Sequence[int] | None = None
    point: str = "resid_post"
    op: str = "add"
    vector: Any = None
    scale: float = 1.0
    positions: str = "all"

    def __post_init__(self) -> None:
        if self.point not in STEER_POINTS:
            raise ValueError(f"steering.point: unknown point {self.point!r}; choose from {list(STEER_POINTS)}")
        if self.op not in OPS:
            raise ValueError(f"steering.op must be one of {list(OPS)}, got {self.op!r}")
        if self.positions not in STEER_POSITIONS:
            raise ValueError(f"steering.positions must be one of {list(STEER_POSITIONS)}, got {self.positions!r}")
        if not isinstance(self.scale, int | float) or not math.isfinite(self.scale):
            raise ValueError(f"steering.scale must be a finite number, got {self.scale!r}")
        if self.vector is None:
            raise ValueError("steering.vector is required: a [hidden] tensor or {layer: tensor}")
        if isinstance(self.vector, Mapping) and not _is_wire(self.vector):
            vecs = {_layer(k): _vector(v, f"steering.vector[{k}]") for k, v in self.vector.items()}
            if not vecs:
                raise ValueError("steering.vector is an empty dict")
            if self.layers is None:
                self.layers = list(vecs)
            else:
                self.layers = [_layer(x) for x in self.layers]
                missing = [x for x in self.layers if x not in vecs]
                if missing:
                    raise ValueError(f"steering.vector has no vector for layers {missing}")
            self.vector = vecs
        else:
            self.vector = _vector(self.vector, "steering.vector")
            if self.layers is None:
                raise ValueError("steering.layers is required when vector is a single tensor")
            if isinstance(self.layers, int):
                self.layers = [self.layers]
            self.layers = [_layer(x) for x in self.layers]
        if not self.layers:
            raise ValueError("steering.layers is empty")
        if self.op == "ablate":
            for layer in self.layers:
                if float(self.vector_for(layer).norm()) == 0:
                    raise ValueError(f"steering.vector for layer {layer} is zero: there is no direction to ablate")

    def vector_for(self, layer: int) -> torch.Tensor:
        """The vector applied at ``layer`` (as given in ``layers``)."""
        return self.vector[layer] if isinstance(self.vector, dict) else self.vector

    @classmethod
    def from_any(cls, value: Steer | Mapping[str, Any]) -> Steer:
        """Accept a ``Steer`` or a plain dict with the same keys."""
        return from_mapping(cls, value, "steering")

    @classmethod
    def from_file(cls, path: str | Path, scale: float = 1.0, op: str = "add", positions: str = "all") -> Steer:
        """Load a control vector: llama.cpp / repeng GGUF, or safetensors ``{layer: vector}``.

        GGUF control vectors hold ``direction.N`` tensors; llama.cpp adds ``direction.N`` to
        the output of (0-based) block N, so they map to ``point="resid_post"``, layer N. In a
        safetensors file, a tensor named ``"12"`` (or ``"direction.12"``) is block 12.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such control-vector file: {path}")
        vectors = _read_gguf(path) if path.suffix == ".gguf" else _read_safetensors(path)
        if not vectors:
            raise ValueError(f"{path} holds no control-vector directions")
        return cls(layers=sorted(vectors), point="resid_post", op=op, vector=vectors, scale=scale,
                   positions=positions)

    def digest(self) -> bytes:
        """A hash of everything that changes the computation (for the prefix-cache salt)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.point}|{self.op}|{self.scale!r}|{self.positions}|{list(self.layers)}".encode())
        for layer in self.layers:
            h.update(self.vector_for(layer).numpy().tobytes())
        return h.digest()


def _is_wire(value: Mapping) -> bool:
    """The wire form of one tensor, ``{"shape", "dtype", "data"}`` (not a ``{layer: vector}`` dict)."""
    return set(value) == {"shape", "dtype", "data"}


def _layer(value: Any) -> int:
    if isinstance(value, str):
        value = value.removeprefix("direction.")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"steering: layer keys must be integers, got {value!r}") from None
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"steering.layers must hold integers, got {value!r}") from None


def _vector(value: Any, field: str) -> torch.Tensor:
    if isinstance(value, Mapping):  # the wire form {"shape", "dtype", "data"}
        from tapllm.hidden_states.wire import tensor_from_wire

        value = tensor_from_wire(dict(value), field)
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{field} must be a 1-D vector of numbers") from None
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{field} must be a 1-D [hidden] vector, got shape {tuple(t.shape)}")
    t = t.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(t).all():
        raise ValueError(f"{field} holds NaN or infinite values")
    return t


def _read_gguf(path: Path) -> dict[int, torch.Tensor]:
    import numpy as np
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises several types for a corrupt file
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from None
    out = {}
    for t in reader.tensors:
        if t.name.startswith("direction."):
            out[_layer(t.name)] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    return out


def _read_safetensors(path: Path) -> dict[int, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None
    return {_layer(k): v.reshape(-1).float() for k, v in tensors.items()}


def steering_digest(steers: Sequence[Steer]) -> bytes:
    """The cache salt of a request steered by ``steers`` (empty for none)."""
    if not steers:
        return b""
    h = hashlib.blake2b(digest_size=16)
    for s in steers:
        h.update(s.digest())
    return b"steer:" + h.digest()
