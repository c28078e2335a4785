"""Hidden states as JSON: base64 of the raw little-endian array (default) or nested lists.

Shared by the server (encode) and ``tapllm.client`` (decode), so both sides agree on the
layout::

    {"positions": [...], "layers": [...], "reduce": null,
     "points": {"resid_post": {"shape": [P, L, H], "dtype": "float32", "data": "<base64>"}}}

With ``encoding="list"`` each point's ``data`` is a nested list of floats instead (a non-finite number
is written as ``null``, JSON having none, and read back as NaN: base64 keeps -inf and +inf). A logit
lens adds ``"lens": {"targets": [...], "points": {point: {"token_ids": <int64 tensor>,
"logprobs": <tensor>, "target_logprobs": <tensor> | null}}}``.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import torch

from tapllm.hidden_states.lens import Lens, LensResult
from tapllm.hidden_states.result import HiddenStates
from tapllm.sae.features import Features
from tapllm.utils.checks import check_values
from tapllm.utils.dtypes import DTYPES, dtype_from_name, dtype_name, is_supported

ENCODINGS = ("base64", "list")
_INDEX_DTYPES = {"int64": torch.int64, "int32": torch.int32}  # token ids (lens), SAE feature ids; not compute dtypes


def _wire_dtype(name: Any) -> torch.dtype | None:
    return _INDEX_DTYPES.get(name) if isinstance(name, str) and name in _INDEX_DTYPES else dtype_from_name(name)


def tensor_to_wire(t: torch.Tensor, encoding: str) -> dict[str, Any]:
    """One tensor as ``{"shape", "dtype", "data"}``."""
    t = t.detach().cpu().contiguous()
    index = t.dtype in (torch.int64, torch.int32)
    if not index and not is_supported(t.dtype):
        raise ValueError(f"cannot encode dtype {t.dtype}")
    if encoding == "list":
        data: Any = t.tolist() if index else t.float().tolist()
    else:
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
        array = raw.numpy()
        if sys.byteorder != "little":
            array = array.byteswap()
        data = base64.b64encode(array.tobytes()).decode("ascii")
    name = str(t.dtype).removeprefix("torch.") if index else dtype_name(t.dtype)
    return {"shape": list(t.shape), "dtype": name, "data": data}


def _none_as_nan(data: Any) -> Any:
    """A nested list with JSON's ``null`` read as NaN: the server writes non-finite numbers (a dense block's
    NaN router rows, a banned expert's -inf logit) as null, since JSON has none."""
    if isinstance(data, list):
        return [_none_as_nan(v) for v in data]
    return float("nan") if data is None else data


def tensor_from_wire(obj: Any, field: str = "tensor") -> torch.Tensor:
    """Inverse of ``tensor_to_wire`` (either encoding); ``ValueError`` names ``field``."""
    if not isinstance(obj, dict) or not {"shape", "dtype", "data"} <= set(obj):
        raise ValueError(f"{field} must be an object with shape, dtype and data")
    dtype = _wire_dtype(obj["dtype"])
    if dtype is None:
        raise ValueError(f"{field}.dtype must be one of {list(DTYPES) + list(_INDEX_DTYPES)}, got {obj['dtype']!r}")
    try:
        shape = [int(s) for s in obj["shape"]]
    except (TypeError, ValueError):
        raise ValueError(f"{field}.shape must be a list of integers") from None
    data = obj["data"]
    if isinstance(data, str):
        try:
            raw = bytearray(base64.b64decode(data, validate=True))
        except ValueError:
            raise ValueError(f"{field}.data is not valid base64") from None
        elem = torch.tensor([], dtype=dtype).element_size()
        count = 1
        for s in shape:
            count *= s
        if len(raw) != count * elem:
            raise ValueError(f"{field}.data holds {len(raw)} bytes, shape {shape} of {obj['dtype']} needs {count * elem}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        if sys.byteorder != "little" and elem > 1:
            flat = flat.view(-1, elem).flip(1).reshape(-1)
        return flat.view(dtype).reshape(shape).clone()
    try:
        wide = torch.tensor(_none_as_nan(data), dtype=torch.float64).reshape(shape)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{field}.data must be base64 or a nested list of numbers of shape {shape}") from None
    if dtype.is_floating_point:
        check_values(wide, f"{field}.data", dtype, finite=False)  # before the conversion makes it infinite
    return wide.to(dtype)


def hidden_states_to_wire(hs: HiddenStates, encoding: str = "base64") -> dict[str, Any]:
    """A request's ``HiddenStates`` as a JSON-ready dict."""
    if encoding not in ENCODINGS:
        raise ValueError(f"hidden_states.encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
    out = {
        "positions": hs.positions.tolist(),
        "layers": list(hs.layers),
        "reduce": hs.reduce,
        "points": {p: tensor_to_wire(t, encoding) for p, t in hs.items()},
    }
    if hs.lens is not None:
        out["lens"] = {"targets": hs.lens.targets, "points": {
            p: {"token_ids": tensor_to_wire(r.token_ids, encoding), "logprobs": tensor_to_wire(r.logprobs, encoding),
                "target_logprobs": tensor_to_wire(r.target_logprobs, encoding) if r.target_logprobs is not None
                else None}
            for p, r in hs.lens.items()}}
    if hs.features is not None:
        out["features"] = features_to_wire(hs.features, encoding)
    if hs.metadata:
        out["metadata"] = dict(hs.metadata)  # e.g. {"quantization": "int4-g128"}
    return out


def hidden_states_from_wire(obj: dict[str, Any]) -> HiddenStates:
    """Inverse of ``hidden_states_to_wire``."""
    if not isinstance(obj, dict) or "points" not in obj:
        raise ValueError("hidden_states must be an object with points, positions and layers")
    tensors = {p: tensor_from_wire(v, f"hidden_states.points.{p}") for p, v in obj["points"].items()}
    positions = torch.tensor(obj.get("positions", []), dtype=torch.long)
    lens = None
    if obj.get("lens"):
        results = {}
        for p, r in obj["lens"]["points"].items():
            where = f"hidden_states.lens.points.{p}"
            target = r.get("target_logprobs")
            results[p] = LensResult(tensor_from_wire(r["token_ids"], f"{where}.token_ids"),
                                    tensor_from_wire(r["logprobs"], f"{where}.logprobs"),
                                    tensor_from_wire(target, f"{where}.target_logprobs") if target else None)
        lens = Lens(results, obj["lens"].get("targets"))
    features = None
    if obj.get("features"):
        features = features_from_wire(obj["features"])
    hs = HiddenStates(tensors, positions, list(obj.get("layers", [])), obj.get("reduce"), lens=lens,
                      features=features)
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        hs.metadata.update({str(k): str(v) for k, v in meta.items()})
    return hs


def features_to_wire(features: Features, encoding: str) -> dict[str, Any]:
    """A request's ``Features`` as JSON: ``positions``, ``error_norm``, ``ids``/``values`` or ``dense``."""
    out: dict[str, Any] = {"sae": features.sae, "feature_ids": features.feature_ids}
    for name, t in features.tensors().items():
        out[name] = t.tolist() if name == "positions" else tensor_to_wire(t, encoding)
    return out


def features_from_wire(obj: dict[str, Any]) -> Features:
    """Inverse of :func:`features_to_wire` (for clients)."""

    def get(name: str) -> torch.Tensor | None:
        return tensor_from_wire(obj[name], f"features.{name}") if obj.get(name) is not None else None

    return Features(torch.tensor(obj.get("positions", []), dtype=torch.long), get("error_norm"), ids=get("ids"),
                    values=get("values"), dense=get("dense"), feature_ids=obj.get("feature_ids"),
                    sae=obj.get("sae", ""))
