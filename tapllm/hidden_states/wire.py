"""Hidden states as JSON: base64 of the raw little-endian array (default) or nested lists.

Shared by the server (encode) and ``tapllm.client`` (decode), so both sides agree on the
layout::

    {"positions": [...], "layers": [...], "reduce": null,
     "points": {"resid_post": {"shape": [P, L, H], "dtype": "float32", "data": "<base64>"}}}

With ``encoding="list"`` each point's ``data`` is a nested list of floats instead.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import torch

from tapllm.dtypes import DTYPES, dtype_from_name, dtype_name, is_supported
from tapllm.hidden_states.result import HiddenStates

ENCODINGS = ("base64", "list")


def tensor_to_wire(t: torch.Tensor, encoding: str) -> dict[str, Any]:
    """One tensor as ``{"shape", "dtype", "data"}``."""
    t = t.detach().cpu().contiguous()
    if not is_supported(t.dtype):
        raise ValueError(f"cannot encode dtype {t.dtype}")
    if encoding == "list":
        data: Any = t.float().tolist()
    else:
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
        array = raw.numpy()
        if sys.byteorder != "little":
            array = array.byteswap()
        data = base64.b64encode(array.tobytes()).decode("ascii")
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "data": data}


def tensor_from_wire(obj: Any, field: str = "tensor") -> torch.Tensor:
    """Inverse of ``tensor_to_wire`` (either encoding); ``ValueError`` names ``field``."""
    if not isinstance(obj, dict) or not {"shape", "dtype", "data"} <= set(obj):
        raise ValueError(f"{field} must be an object with shape, dtype and data")
    dtype = dtype_from_name(obj["dtype"])
    if dtype is None:
        raise ValueError(f"{field}.dtype must be one of {list(DTYPES)}, got {obj['dtype']!r}")
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
        return torch.tensor(data, dtype=torch.float32).reshape(shape).to(dtype)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{field}.data must be base64 or a nested list of numbers of shape {shape}") from None


def hidden_states_to_wire(hs: HiddenStates, encoding: str = "base64") -> dict[str, Any]:
    """A request's ``HiddenStates`` as a JSON-ready dict."""
    if encoding not in ENCODINGS:
        raise ValueError(f"hidden_states.encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
    return {
        "positions": hs.positions.tolist(),
        "layers": list(hs.layers),
        "reduce": hs.reduce,
        "points": {p: tensor_to_wire(t, encoding) for p, t in hs.items()},
    }


def hidden_states_from_wire(obj: dict[str, Any]) -> HiddenStates:
    """Inverse of ``hidden_states_to_wire``."""
    if not isinstance(obj, dict) or "points" not in obj:
        raise ValueError("hidden_states must be an object with points, positions and layers")
    tensors = {p: tensor_from_wire(v, f"hidden_states.points.{p}") for p, v in obj["points"].items()}
    positions = torch.tensor(obj.get("positions", []), dtype=torch.long)
    return HiddenStates(tensors, positions, list(obj.get("layers", [])), obj.get("reduce"))
