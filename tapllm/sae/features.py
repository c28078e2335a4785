"""SAE features with generation: the spec's ``sae``/``features``, resolved per request, and each
request's ``Features``, gathered step by step.

The capture plan records the SAE's input point like any captured point (steered first, so
features see what the model computed). After the forward, :class:`tapllm.sae.batch.FeatureBatch`
encodes the step's rows per SAE, every request reading it at once, and copies the results to the
host once; each request keeps views of its rows there (:class:`FeatureBuffers`), joined when it
finishes.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from tapllm.sae.model import SAE
from tapllm.utils.dtypes import DTYPES

MAX_TOP_FEATURES = 1024
PSEUDO_POINTS = ("embed", "final")


# ---- the spec ---------------------------------------------------------------------------------
def parse_features(value: Any) -> tuple[str, int, list[int] | None]:
    """``"topk:16"`` / ``"top:16"`` -> ("topk", 16, None); ``"all"`` -> ("all", 0, None); a list of
    ids -> ("ids", 0, ids). ``ValueError`` names ``hidden_states.features``."""
    if value is None:
        return "topk", 16, None
    if isinstance(value, str):
        if value == "all":
            return "all", 0, None
        name, sep, k = value.partition(":")
        if name in ("topk", "top") and sep:
            try:
                n = int(k)
            except ValueError:
                n = 0
            if not 1 <= n <= MAX_TOP_FEATURES:
                raise ValueError(f"hidden_states.features: top-k needs k in [1, {MAX_TOP_FEATURES}], got {value!r}")
            return "topk", n, None
        if "," in value or value.isdigit():
            return parse_features([v for v in value.split(",") if v])
        raise ValueError(f"hidden_states.features must be 'topk:K', 'all' or a list of feature ids, got {value!r}")
    if isinstance(value, int):
        value = [value]
    try:
        ids = [operator.index(i) for i in value]
    except TypeError:
        raise ValueError(f"hidden_states.features must be 'topk:K', 'all' or a list of feature ids, got {value!r}") \
            from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"hidden_states.features: feature ids must be a non-empty list of distinct ids >= 0, got "
                         f"{value!r}")
    return "ids", 0, ids


_REGISTERED: dict[str, SAE] = {}


def register_sae(name: str, sae: SAE | str | os.PathLike) -> SAE:
    """Make ``sae`` (or the SAE at a path) known as ``name`` in this process: specs and steers may then
    name it, and a server started with ``--sae NAME=PATH`` serves only the SAEs registered so."""
    if not name or not isinstance(name, str):
        raise ValueError(f"an SAE name must be a non-empty string, got {name!r}")
    loaded = sae if isinstance(sae, SAE) else SAE.load(sae)
    _REGISTERED[name] = loaded
    return loaded


def registered_saes() -> dict[str, SAE]:
    """The SAEs registered by name (a copy)."""
    return dict(_REGISTERED)


def load_sae(value: Any, field: str) -> SAE:
    """``value`` as an ``SAE``: an ``SAE`` itself, a registered name, or a path / hub id to load
    (``ValueError`` names ``field``)."""
    if isinstance(value, SAE):
        return value
    if isinstance(value, str) and value in _REGISTERED:
        return _REGISTERED[value]
    if isinstance(value, str | os.PathLike):
        from tapllm.sae.formats import locate_sae

        try:
            path = locate_sae(value)  # a hub id becomes its folder in the Hugging Face cache
            key = _load_key(path)
            if key in _LOADED:  # the same file again (e.g. one spec per request): read once
                return _LOADED[key]
            sae = SAE.load(path)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"{field}: {exc}") from None
        if key is not None:
            if len(_LOADED) >= 8:
                _LOADED.pop(next(iter(_LOADED)))
            _LOADED[key] = sae
        return sae
    raise ValueError(f"{field} must be a tapllm.SAE or the path of one, got {type(value).__name__}")


_LOADED: dict[tuple[str, int], SAE] = {}  # SAEs read from files (hub ids too), by (path, newest mtime of its files)


def _load_key(value: str | os.PathLike) -> tuple[str, int] | None:
    """A local path's identity for the load cache (None when it does not exist)."""
    path = os.path.realpath(os.fspath(value))
    if not os.path.exists(path):
        return None
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    return path, max(os.stat(f).st_mtime_ns for f in files)


def check_spec(spec: Any) -> None:
    """The SAE part of a ``HiddenStatesSpec``: load the SAE, parse ``features``, refuse what cannot combine."""
    if spec.sae is None:
        raise ValueError("hidden_states.features needs an SAE: give hidden_states.sae")
    spec.sae = load_sae(spec.sae, "hidden_states.sae")
    spec.features = parse_features(spec.features)
    if spec.reduce is not None:
        raise ValueError("hidden_states.sae: features are per position; they cannot be combined with reduce")
    if spec.project is not None:
        raise ValueError("hidden_states.sae reads the states themselves: it cannot be combined with project")


def features_to_text(parsed: tuple[str, int, list[int] | None]) -> str | list[int]:
    """The spec's ``features`` as given: ``"topk:16"``, ``"all"`` or the ids."""
    mode, k, ids = parsed
    return f"topk:{k}" if mode == "topk" else ("all" if mode == "all" else list(ids or ()))


# ---- resolved per request ---------------------------------------------------------------------
@dataclass(slots=True)
class FeatureSelection:
    """A request's features, resolved: the SAE, where it reads, what is kept.

    As the input processor resolves it, ``sae`` is the spec's own SAE; :meth:`on_device` gives the
    engine's copy, with the SAE on its device. ``ids`` stays a CPU tensor (the step reads it on the host).
    """

    sae: SAE
    point: str
    key: int  # the layer key of ``point`` (block index, or the pseudo-layer)
    mode: str  # "topk", "ids" or "all"
    k: int
    ids: torch.Tensor | None  # the listed features (int64, CPU)
    dtype: torch.dtype  # of values / dense
    out: tuple[str, int] | None = None  # a transcoder's target (point, key)

    def on_device(self, saes: DeviceSAEs) -> FeatureSelection:
        """This selection with the SAE on ``saes``' device (moved once per engine)."""
        return replace(self, sae=saes.get(self.sae))

    @property
    def width(self) -> int:
        """Numbers kept per position (values, or dense columns)."""
        if self.mode == "topk":
            return self.k
        return self.sae.d_sae if self.mode == "all" else int(self.ids.numel())

    def inputs(self) -> list[tuple[str, int]]:
        """The (point, layer key) pairs the step must record for this request."""
        return [(self.point, self.key)] + ([self.out] if self.out is not None else [])

    def row_bytes(self) -> int:
        """Bytes of one position's features (int32 ids, values, float32 error norm)."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return self.width * (size + (4 if self.mode == "topk" else 0)) + 4


class DeviceSAEs:
    """The engine's SAEs on its device, float32, one copy per distinct SAE (by content digest)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_digest: dict[bytes, SAE] = {}

    def get(self, sae: SAE) -> SAE:
        """``sae`` on the device (moved once; later requests with the same weights share it)."""
        key = sae.digest()
        found = self._by_digest.get(key)
        if found is None:
            found = sae.to(self.device, torch.float32)
            if found is sae:  # never pack (or otherwise change) the caller's own object
                found = SAE(replace(sae.cfg), **sae._tensors())
            found._digest = key
            found.pack()
            self._by_digest[key] = found
        return found


def resolve_features(spec: Any, *, num_layers: int, hidden_size: int, point_shapes: dict[str, tuple[int, ...]],
                     pseudo_layer: int) -> FeatureSelection:
    """Check the spec's SAE against the model; ``ValueError`` names the field (nothing moves to a device)."""
    sae: SAE = spec.sae
    mode, k, ids = spec.features
    c = sae.cfg
    key, out = _key(c.point, c.layer, num_layers, pseudo_layer), None
    width = _width(c.point, hidden_size, point_shapes)
    if width != c.d_in:
        raise ValueError(f"hidden_states.sae reads {c.point!r} ({width} numbers a position in this model), but its "
                         f"d_in is {c.d_in}")
    if c.transcoder:
        out = (c.out_point, _key(c.out_point, c.out_layer, num_layers, pseudo_layer))
    if mode == "topk" and k > c.d_sae:
        raise ValueError(f"hidden_states.features: top-{k} of an SAE with {c.d_sae} features")
    if mode == "ids" and max(ids) >= c.d_sae:
        raise ValueError(f"hidden_states.features: feature id {max(ids)} is out of range for d_sae={c.d_sae}")
    ids_t = torch.tensor(ids) if ids is not None else None
    dtype = DTYPES[spec.dtype] if spec.dtype else torch.float32
    return FeatureSelection(sae, c.point, key, mode, k, ids_t, dtype, out)


def _key(point: str, layer: int | None, num_layers: int, pseudo_layer: int) -> int:
    if point in PSEUDO_POINTS:
        return pseudo_layer
    if layer is None or not -num_layers <= layer < num_layers:
        raise ValueError(f"hidden_states.sae reads block {layer} of {point!r}, out of range for a {num_layers}-block "
                         "model")
    return layer % num_layers


def _width(point: str, hidden: int, shapes: dict[str, tuple[int, ...]]) -> int:
    from tapllm.tap.points import HIDDEN_POINTS

    if point in HIDDEN_POINTS:
        return hidden
    if point not in shapes or point == "attn_pattern":
        raise ValueError(f"hidden_states.sae reads {point!r}, which this model does not expose")
    n = 1
    for d in shapes[point]:
        n *= d
    return n


# ---- per-request buffers and the result -------------------------------------------------------
class Features:
    """A request's SAE features, one row per captured position.

    Attributes:
        positions: absolute token positions ``[P]``.
        ids, values: top-k mode: feature ids (int32) and activations ``[P, k]``, largest first.
        dense: listed-features mode: ``[P, len(feature_ids)]``; ``"all"``: ``[P, d_sae]``.
        feature_ids: the listed features (the columns of ``dense``), or None.
        error_norm: ``||x - reconstruction||`` per position ``[P]`` (float32; a transcoder's
            prediction error against its target point).
        sae: a short description of the SAE (architecture, point, d_sae, source).
    """

    def __init__(self, positions: torch.Tensor, error_norm: torch.Tensor, *, ids: torch.Tensor | None = None,
                 values: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                 feature_ids: list[int] | None = None, sae: str = "") -> None:
        self.positions = positions
        self.error_norm = error_norm
        self.ids, self.values, self.dense = ids, values, dense
        self.feature_ids = feature_ids
        self.sae = sae

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (what ``HiddenStates.save`` writes as ``features.<name>``)."""
        out = {"positions": self.positions, "error_norm": self.error_norm}
        for name in ("ids", "values", "dense"):
            t = getattr(self, name)
            if t is not None:
                out[name] = t
        return out

    def top(self, position: int, n: int = 10) -> list[tuple[int, float]]:
        """The ``n`` most active (feature id, activation) at absolute ``position``."""
        row = (self.positions == position).nonzero()
        if not len(row):
            raise KeyError(f"position {position} was not captured; captured: {self.positions.tolist()}")
        i = int(row[0])
        if self.ids is not None:
            return [(int(f), float(v)) for f, v in zip(self.ids[i, :n], self.values[i, :n]) if v > 0]
        vals, cols = torch.topk(self.dense[i].float(), min(n, self.dense.shape[1]))
        names = self.feature_ids if self.feature_ids is not None else None
        return [(int(names[c]) if names else int(c), float(v)) for c, v in zip(cols, vals) if v > 0]

    def __repr__(self) -> str:
        what = (f"ids/values {tuple(self.ids.shape)}" if self.ids is not None else f"dense {tuple(self.dense.shape)}")
        return f"Features({what}; {len(self.positions)} positions; {self.sae})"


Columns = dict[str, slice | list[int]]  # a field's columns in a step's pack rows (see tapllm.sae.batch)


class FeatureBuffers:
    """One request's features on the host: its rows of each step's pack (views, in position order),
    joined into ``Features`` when it finishes."""

    def __init__(self, fs: FeatureSelection, last_only: bool) -> None:
        self.fs = fs
        self.last_only = last_only
        # (first position, a step's host pack, its first row, rows, columns): cut when the result is made
        self.chunks: list[tuple[int, torch.Tensor, int, int, Columns]] = []

    def take(self, pack: torch.Tensor, row: int, cols: Columns, a: int, b: int) -> None:
        """Keep rows ``row, row + 1, ...`` of ``pack`` (an int32 host pack, filled by the time results are
        read) for positions ``[a, b)``, whose fields are at ``cols``."""
        if self.last_only:
            self.chunks = [(b - 1, pack, row + b - a - 1, 1, cols)]
        else:
            self.chunks.append((a, pack, row, b - a, cols))

    def result(self, positions: torch.Tensor) -> Features:
        """The captured rows as ``Features`` (``positions`` as the request's states have them)."""
        fs = self.fs
        n = len(positions)
        names = ("ids", "values") if fs.mode == "topk" else ("dense",)
        out: dict[str, torch.Tensor] = {}
        for name in (*names, "error_norm"):
            parts = [pack[row : row + k, cols[name]] for _, pack, row, k, cols in self.chunks]
            width = 1 if name == "error_norm" else fs.width
            t = torch.cat(parts) if parts else torch.empty((0, width), dtype=torch.int32)
            if t.shape[0] != n:
                raise RuntimeError(f"hidden_states: {t.shape[0]} rows of SAE features were captured for {n} "
                                   "positions")
            if name == "error_norm":
                t = t.view(torch.float32).reshape(n)
            elif name != "ids":
                t = t.view(torch.float32).to(fs.dtype)
            out[name] = t
        listed = fs.ids.tolist() if fs.ids is not None else None
        return Features(positions.clone(), out["error_norm"], ids=out.get("ids"), values=out.get("values"),
                        dense=out.get("dense"), feature_ids=listed, sae=repr(fs.sae))
