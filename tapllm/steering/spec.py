"""``Steer``: change one request's activations at a named point — steer, ablate, patch.

Operations, applied in place to the selected positions (and heads or neurons):

* ``add``: ``x + scale * vector``;
* ``ablate``: remove the component along the unit direction, ``x - (x . d) d``;
* ``clamp``: set that component to ``value``, ``x + (value - x . d) d`` (SAE feature steering);
* ``scale``: ``scale * x``;
* ``set``: replace the state by given ``values`` (activation patching: clean -> corrupted),
  e.g. straight from another request's ``RequestOutput.hidden_states``.

At the router of a mixture-of-experts block (:mod:`tapllm.steering.router`): ``ban`` and
``force`` ``experts`` at ``router_logits``, ``add`` a bias vector to the logits, and ``scale`` or
``ablate`` chosen experts' outputs at ``routing_weights``.

Several steers of a request compose in order.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapllm.steering.router import ROUTER_OPS, check_router_steer
from tapllm.tap.points import HEAD_STEER_POINTS, MOE_STEER_POINTS, STEER_POINTS
from tapllm.utils.checks import as_wide_tensor, check_values, real
from tapllm.utils.options import from_mapping

OPS = ("add", "ablate", "clamp", "scale", "set")
STEER_POSITIONS = ("all", "prompt", "generated")


@dataclass(slots=True)
class Steer:
    """One operation on a request's activations.

    Args:
        layers: block indices (negative from the end); may be omitted when ``vector`` is a
            ``{layer: vector}`` dict, whose keys then name the blocks, or when ``values`` is a
            ``HiddenStates`` (its layers then).
        point: ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post`` (see
            ``tapllm.tap.points``), ``q``, ``k``, ``v``, ``z`` (per head), ``mlp_post`` (per neuron),
            or, in a mixture-of-experts model, ``router_logits`` and ``routing_weights`` (per expert).
        op: ``"add"``, ``"ablate"``, ``"clamp"``, ``"scale"`` or ``"set"`` (see the module docstring);
            at ``router_logits`` also ``"ban"`` and ``"force"`` (``tapllm.steering.router``).
        vector: the direction of ``add``/``ablate``/``clamp``: a tensor of the point's last
            dimension (``[hidden]``; ``[head_dim]`` for a per-head point, applied to every selected
            head, or ``[heads, head_dim]``; ``[d_mlp]`` or ``[len(neurons)]`` for ``mlp_post``;
            ``[n_experts]`` for ``router_logits``, a bias on the logits), or ``{layer: tensor}``.
        scale: multiplies the vector for ``add``; the factor of ``scale``.
        value: the coefficient ``clamp`` sets along the direction.
        values: what ``set`` writes: a ``HiddenStates`` holding this point (its positions and
            layers are used), or a tensor ``[len(positions), *row]`` (every layer) or
            ``[len(positions), len(layers), *row]``, where ``row`` is the point's row shape after
            ``heads``/``neurons``.
        positions: ``"all"``, ``"prompt"``, ``"generated"`` or a list of absolute positions
            (required for ``set`` unless ``values`` is a ``HiddenStates``).
        heads: for ``q``/``k``/``v``/``z``, the heads to change (query heads for q/z, KV heads
            for k/v); ``None``: all.
        neurons: for ``mlp_post``, the neurons to change; ``None``: all.
        sae: a ``tapllm.SAE`` (or its path): steer by its features at its point and block
            (``point`` and ``layers`` then come from the SAE). ``op="add"`` adds decoder
            directions; ``"clamp"``/``"set"`` set latents keeping the SAE's error term;
            ``"ablate"`` sets them to 0 (see ``tapllm.sae.steer``).
        features: with ``sae``: ``{id: scale}`` (add), ``{id: value}`` (clamp/set), ``[ids]``
            (ablate; add with scale 1).
        experts: expert indices: the experts ``ban``/``force`` act on at ``router_logits``, or whose
            outputs ``scale``/``ablate`` change at ``routing_weights`` (``None`` there: all).
    """

    layers: Sequence[int] | None = None
    point: str = "resid_post"
    op: str = "add"
    vector: Any = None
    scale: float = 1.0
    positions: str | Sequence[int] = "all"
    value: float = 0.0
    values: Any = None
    heads: Sequence[int] | None = None
    neurons: Sequence[int] | None = None
    sae: Any = None
    features: Any = None
    experts: Sequence[int] | None = None

    def __post_init__(self) -> None:
        by_sae = self.sae is not None or self.features is not None
        if by_sae:
            from tapllm.sae.steer import check_sae_steer

            check_sae_steer(self)  # point, layers, and add's vector, from the SAE
        if self.point not in STEER_POINTS:
            raise ValueError(f"steering.point: unknown point {self.point!r}; choose from {list(STEER_POINTS)}")
        if self.op not in OPS + ROUTER_OPS:
            raise ValueError(f"steering.op must be one of {list(OPS + ROUTER_OPS)}, got {self.op!r}")
        for name in ("scale", "value"):  # float32 at least: the engine's steering arithmetic
            setattr(self, name, real(f"steering.{name}", getattr(self, name)))
        self.positions = _positions(self.positions)
        self.heads = _indices(self.heads, "heads")
        self.neurons = _indices(self.neurons, "neurons")
        if self.heads is not None and self.point not in HEAD_STEER_POINTS:
            raise ValueError(f"steering.heads applies to {list(HEAD_STEER_POINTS)}, not {self.point!r}")
        if self.neurons is not None and self.point != "mlp_post":
            raise ValueError(f"steering.neurons applies to 'mlp_post', not {self.point!r}")
        self.experts = _indices(self.experts, "experts")
        if (self.point in MOE_STEER_POINTS or self.op in ROUTER_OPS or self.experts is not None) \
                and check_router_steer(self.point, self.op, self.experts, self.vector, self.values):
            if self.layers is None:
                raise ValueError("steering.layers is required")
            self.layers = _layer_list(self.layers)
            return
        if by_sae and self.op != "add":
            return
        if self.op == "set":
            self._check_set()
            return
        if self.values is not None:
            raise ValueError(f"steering.values is for op='set', not {self.op!r}")
        if self.op == "scale":
            if self.layers is None:
                raise ValueError("steering.layers is required")
            self.layers = _layer_list(self.layers)
            if self.vector is not None:
                raise ValueError("steering.vector is not used by op='scale' (scale multiplies the state)")
            return
        self._check_vector()

    def _check_vector(self) -> None:
        if self.vector is None:
            raise ValueError("steering.vector is required: a tensor of the point's last dimension or {layer: tensor}")
        if isinstance(self.vector, Mapping) and not _is_wire(self.vector):
            vecs = {_layer(k): _vector(v, f"steering.vector[{k}]") for k, v in self.vector.items()}
            if not vecs:
                raise ValueError("steering.vector is an empty dict")
            if self.layers is None:
                self.layers = list(vecs)
            else:
                self.layers = _layer_list(self.layers)
                missing = [x for x in self.layers if x not in vecs]
                if missing:
                    raise ValueError(f"steering.vector has no vector for layers {missing}")
            self.vector = vecs
        else:
            self.vector = _vector(self.vector, "steering.vector")
            if self.layers is None:
                raise ValueError("steering.layers is required when vector is a single tensor")
            self.layers = _layer_list(self.layers)
        if self.op in ("ablate", "clamp"):
            for layer in self.layers:
                if float(self.vector_for(layer).norm()) == 0:
                    raise ValueError(f"steering.vector for layer {layer} is zero: there is no direction to {self.op}")

    def _check_set(self) -> None:
        from tapllm.hidden_states.result import HiddenStates

        if self.vector is not None:
            raise ValueError("steering.vector is not used by op='set': give values")
        if self.values is None:
            raise ValueError("steering.values is required for op='set': a HiddenStates or a tensor")
        if isinstance(self.values, HiddenStates):
            hs = self.values
            if self.point not in hs:
                raise ValueError(f"steering.values holds no {self.point!r} states (it has {list(hs.points)})")
            if hs.reduce is not None:
                raise ValueError("steering.values: reduced states have no positions to patch")
            if self.layers is None:
                self.layers = list(hs.layers)
            self.layers = _layer_list(self.layers)
            missing = [x for x in self.layers if x not in hs.layers]
            if missing:
                raise ValueError(f"steering.values holds layers {hs.layers}, not {missing}")
            have = hs.positions.tolist()
            if isinstance(self.positions, str):
                if self.positions != "all":
                    raise ValueError("steering.positions for values from HiddenStates must be 'all' or a list")
                self.positions = have
            missing = [p for p in self.positions if p not in have]
            if missing:
                raise ValueError(f"steering.values holds no states at positions {missing[:5]}")
            rows = torch.tensor([have.index(p) for p in self.positions])
            cols = torch.tensor([hs.layers.index(x) for x in self.layers])
            self.values = hs[self.point].index_select(0, rows).index_select(1, cols).float().contiguous()
            check_values(self.values, "steering.values")
        else:
            if self.layers is None:
                raise ValueError("steering.layers is required")
            self.layers = _layer_list(self.layers)
            if isinstance(self.positions, str):
                raise ValueError("steering.positions must list the absolute positions the values are for")
            try:
                t = as_wide_tensor(self.values)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError("steering.values must be a tensor of numbers or a HiddenStates") from None
            check_values(t, "steering.values")
            t = t.detach().to("cpu", torch.float32)
            if t.dim() < 2 or t.shape[0] != len(self.positions):
                raise ValueError(f"steering.values must be [len(positions)={len(self.positions)}, ...], "
                                 f"got shape {tuple(t.shape)}")
            self.values = t.contiguous()

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
        h.update(f"{self.point}|{self.op}|{self.scale!r}|{self.value!r}|{self.positions}|{list(self.layers)}|"
                 f"{self.heads}|{self.neurons}".encode())
        if self.experts is not None:  # a routing steer's experts (other steers' digests as before)
            h.update(f"|experts={self.experts}".encode())
        if self.sae is not None:
            from tapllm.sae.steer import sae_steer_digest

            h.update(sae_steer_digest(self))
            if self.op != "add":
                return h.digest()
        if self.op == "set":
            h.update(str(tuple(self.values.shape)).encode())
            h.update(self.values.numpy().tobytes())
        elif self.vector is not None:  # add, ablate, clamp (scale, ban, force and expert ops have none)
            for layer in self.layers:
                h.update(self.vector_for(layer).numpy().tobytes())
        return h.digest()


def _positions(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if value not in STEER_POSITIONS:
            raise ValueError(f"steering.positions must be one of {list(STEER_POSITIONS)} or a list of positions, "
                             f"got {value!r}")
        return value
    try:
        out = sorted({operator.index(p) for p in value})
    except TypeError:
        raise ValueError(f"steering.positions must be a name or a list of absolute positions, got {value!r}") \
            from None
    if not out or out[0] < 0:
        raise ValueError(f"steering.positions must list positions >= 0, got {value!r}")
    if len(out) != len(list(value)):
        raise ValueError(f"steering.positions names a position twice: {list(value)}")
    return out


def _indices(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        value = [value]
    try:
        out = [operator.index(i) for i in value]
    except TypeError:
        raise ValueError(f"steering.{name} must hold integers, got {value!r}") from None
    if not out or len(set(out)) != len(out):
        raise ValueError(f"steering.{name} must be a non-empty list without repeats, got {value!r}")
    return out


def _layer_list(layers: Any) -> list[int]:
    if isinstance(layers, int):
        layers = [layers]
    out = [_layer(x) for x in layers]
    if not out:
        raise ValueError("steering.layers is empty")
    return out


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
        from tapllm.hidden_states.json_codec import tensor_from_wire

        value = tensor_from_wire(dict(value), field)
    try:
        t = as_wide_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{field} must be a 1-D vector of numbers") from None
    if t.dim() not in (1, 2) or t.numel() == 0:
        raise ValueError(f"{field} must be a [width] vector (or [heads, head_dim]), got shape {tuple(t.shape)}")
    check_values(t, field)
    return t.detach().to("cpu", torch.float32).contiguous()


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
