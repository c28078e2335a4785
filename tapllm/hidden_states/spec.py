"""What hidden states a request asks for: ``HiddenStatesSpec``, its checks and its CLI form."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.hidden_states.reducers import get_reducer
from tapllm.utils.checks import as_wide_tensor, check_values
from tapllm.utils.dtypes import DTYPES  # re-exported: resolved.py reads it from here
from tapllm.utils.options import from_mapping
# The point names live in the one table (tapllm.tap.points); re-exported for this package's users.
from tapllm.tap.points import (BLOCK_POINTS, HEAD_POINTS, HIDDEN_POINTS, LENS_POINTS, POINTS,  # noqa: F401
                               PSEUDO_POINTS, QUERY_HEAD_POINTS, RESIDUAL_POINTS)

POSITION_NAMES = ("prompt", "generated", "all", "last_prompt", "last")
MAX_LENS_K = 100
MAX_LENS_TARGETS = 64


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
        lens: logit lens: the top ``lens`` tokens and their logprobs when the model's final
            norm and unembedding are applied to each captured residual-stream state
            (``embed``, ``resid_pre``, ``resid_mid``, ``resid_post``; ``final`` is the model's
            own prediction), computed where the model runs: ``hs.lens``.
        lens_targets: token ids whose logprob the lens also reports at every state.
        heads: query heads kept for ``q``, ``z`` and ``attn_pattern`` (``None``: all of them;
            ``k`` and ``v`` always hold every KV head).
        experts: expert ids (in ``[0, n_experts)``) kept for ``expert_out``, the per-expert outputs of a
            mixture-of-experts block: required with that point (every expert's row at every token would
            be ``n_experts`` times the size of the residual stream), and only with it.
        sae: a ``tapllm.SAE`` (or the path / hub id of one): its features at the point and block
            it reads, per selected position, in ``hs.features``. With an SAE, ``points`` and
            ``layers`` default to nothing: name them to get raw states as well.
        features: what to keep of the SAE's latents: ``"topk:K"`` (ids and values of the K
            largest, the default ``topk:16``), a list of feature ids, or ``"all"`` (dense).
        device: where the returned tensors live: ``None`` or ``"cpu"`` (the default), or the
            model's own device (``"cuda"``, ``"cuda:N"``) to keep them there for an in-process
            consumer (a probe or SAE trained on the GPU): no copy to the host at all.

    Model-independent checks run here; layer range, projection width and the window's fit
    to the sequence are checked when a request is added (they depend on model and prompt).
    """

    layers: Sequence[int] | str | None = None
    points: Sequence[str] | str | None = None
    positions: str | tuple[int, int] = "all"
    reduce: str | None = None
    project: torch.Tensor | None = None
    dtype: str | None = None
    lens: int | None = None
    lens_targets: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    experts: Sequence[int] | None = None
    sae: Any = None
    features: Any = None
    device: str | None = None

    def __post_init__(self) -> None:
        with_sae = self.sae is not None or self.features is not None
        if self.points is None:
            self.points = () if with_sae else ("resid_post",)
        self.points = _check_points(self.points, allow_empty=with_sae)
        self.layers = _check_layers("all" if self.layers is None else self.layers)
        self.positions = _check_positions(self.positions)
        if self.reduce is not None:
            if not isinstance(self.reduce, str):
                raise ValueError(f"hidden_states.reduce must be a reducer name or None, got {self.reduce!r}")
            get_reducer(self.reduce)  # raises naming the known reducers
        if self.project is not None:
            self.project = _check_project(self.project)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"hidden_states.dtype must be one of {list(DTYPES)} or None, got {self.dtype!r}")
        if self.heads is not None:
            if isinstance(self.heads, int):
                self.heads = [self.heads]
            try:
                self.heads = [operator.index(h) for h in self.heads]
            except TypeError:
                raise ValueError(f"hidden_states.heads must hold head indices, got {self.heads!r}") from None
            if not self.heads:
                raise ValueError("hidden_states.heads is empty: give head indices or leave it out")
        self.experts = _check_experts(self.experts, self.points)
        if self.device is not None:
            self.device = _check_device(self.device)
        if self.lens_targets is not None and self.lens is None:
            self.lens = 1
        if self.lens is not None:
            self._check_lens()
        if with_sae:
            from tapllm.sae.features import check_spec

            check_spec(self)

    def _check_lens(self) -> None:
        if isinstance(self.lens, bool) or not isinstance(self.lens, int) or not 1 <= self.lens <= MAX_LENS_K:
            raise ValueError(f"hidden_states.lens must be an integer in [1, {MAX_LENS_K}] (top tokens), got {self.lens!r}")
        if self.project is not None:
            raise ValueError("hidden_states.lens reads the residual stream itself: it cannot be combined with project")
        if not any(p in LENS_POINTS for p in self.points):
            raise ValueError(f"hidden_states.lens needs a residual-stream point ({', '.join(LENS_POINTS)}); "
                             f"got points {list(self.points)}")
        if self.lens_targets is not None:
            try:
                targets = [operator.index(t) for t in self.lens_targets]
            except TypeError:
                raise ValueError(f"hidden_states.lens_targets must hold token ids, got {self.lens_targets!r}") from None
            if not 1 <= len(targets) <= MAX_LENS_TARGETS or any(t < 0 for t in targets):
                raise ValueError(f"hidden_states.lens_targets must hold 1 to {MAX_LENS_TARGETS} token ids >= 0, "
                                 f"got {self.lens_targets!r}")
            self.lens_targets = targets

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
            elif key == "lens":
                kwargs[key] = _int(val, "lens")
            elif key in ("lens_targets", "heads", "experts"):
                kwargs[key] = [_int(v, key) for v in val.split(",")]
            elif key in ("sae", "features"):
                kwargs[key] = val
            else:
                raise ValueError(
                    f"--hidden-states: unknown key {key!r}; use layers, points, positions, reduce, dtype, lens, "
                    "lens_targets, heads, experts, sae, features"
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
            "lens": self.lens,
            "lens_targets": list(self.lens_targets) if self.lens_targets is not None else None,
            "heads": list(self.heads) if self.heads is not None else None,
            **({"experts": list(self.experts)} if self.experts is not None else {}),
            **({"device": self.device} if self.device is not None else {}),
            **({"sae": repr(self.sae), "features": _features_text(self.features)} if self.sae is not None else {}),
        }


def _int(text: str, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--hidden-states: {field} needs integers, got {text!r}") from None


def _features_text(parsed: Any) -> Any:
    from tapllm.sae.features import features_to_text

    return features_to_text(parsed)


def _check_points(points: Sequence[str] | str, allow_empty: bool = False) -> tuple[str, ...]:
    if isinstance(points, str):
        points = [points]
    out = tuple(points)
    if not out and not allow_empty:
        raise ValueError("hidden_states.points is empty: name at least one point")
    for p in out:
        if p not in POINTS:
            raise ValueError(f"hidden_states.points: unknown point {p!r}; choose from {list(POINTS)}")
    if len(set(out)) != len(out):
        raise ValueError(f"hidden_states.points has duplicates: {list(out)}")
    return out


def _check_experts(experts: Sequence[int] | int | None, points: Sequence[str]) -> list[int] | None:
    """The expert ids of ``experts`` (>= 0, distinct; the upper bound, the model's, is checked at resolve);
    required with ``expert_out`` and only with it."""
    if experts is None:
        if "expert_out" in points:
            raise ValueError("hidden_states.experts is required with point 'expert_out': name the expert ids to "
                             "keep (every expert's row at every token would be n_experts times the residual stream)")
        return None
    if "expert_out" not in points:
        raise ValueError("hidden_states.experts selects rows of point 'expert_out': add it to points or leave "
                         "experts out")
    if isinstance(experts, int):
        experts = [experts]
    try:
        out = [operator.index(e) for e in experts]
    except TypeError:
        raise ValueError(f"hidden_states.experts must hold expert ids (integers), got {experts!r}") from None
    if not out:
        raise ValueError("hidden_states.experts is empty: name at least one expert id")
    if any(e < 0 for e in out):
        raise ValueError(f"hidden_states.experts: expert ids must be >= 0, got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"hidden_states.experts names an expert twice: {out}")
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
        t = as_wide_tensor(project)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("hidden_states.project must be a [k, hidden] matrix of numbers") from None
    if t.dim() != 2 or t.shape[0] < 1:
        raise ValueError(f"hidden_states.project must be a [k, hidden] matrix, got shape {tuple(t.shape)}")
    check_values(t, "hidden_states.project")  # projected in float32
    return t.detach().to("cpu", torch.float32).contiguous()


def _check_device(value: Any) -> str:
    """``value`` as a device name tapllm can keep states on (``"cpu"``, ``"cuda"``, ``"cuda:N"``)."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"hidden_states.device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"hidden_states.device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return str(device)
