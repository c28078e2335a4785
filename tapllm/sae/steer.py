"""Steering by SAE features: ``Steer(op=..., sae=..., features=...)``.

* ``add``: ``features={id: scale}`` adds ``sum(scale * W_dec[id])`` (times ``Steer.scale``) at the
  SAE's point and block; it becomes a plain vector steer.
* ``clamp`` / ``set``: ``features={id: value}`` encodes the state, sets those latents to ``value``,
  decodes, and keeps the SAE's error term: ``x' = decode(z') + (x - decode(z))``, as SAELens'
  hooked SAEs do with ``use_error_term=True``; only the named features change. (``set`` is
  the same operation under the name activation patching uses.)
* ``ablate``: ``features=[ids]`` is ``clamp`` to 0.

Decoding is linear up to the SAE's per-row normalization, so the edit is computed as
``x + denormalize((z' - z) @ W_dec)`` on the steered rows, in float32.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tapllm.sae.features import DeviceSAEs, load_sae
from tapllm.sae.model import SAE
from tapllm.utils.checks import real

SAE_STEER_OPS = ("add", "clamp", "set", "ablate")
SAE_STEER_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


def check_sae_steer(steer: Any) -> None:
    """Fill a ``Steer`` given ``sae``/``features``: load the SAE, take its point and block, parse the features.

    For ``add`` the decoder directions are summed into ``steer.vector``; for the other ops
    ``steer.features`` becomes ``{id: value}``. ``ValueError`` names the field.
    """
    if steer.sae is None:
        raise ValueError("steering.features needs an SAE: give steering.sae")
    if steer.op not in SAE_STEER_OPS:
        raise ValueError(f"steering.op={steer.op!r} does not apply to SAE features; use one of {list(SAE_STEER_OPS)}")
    sae = steer.sae = load_sae(steer.sae, "steering.sae")
    c = sae.cfg
    if c.transcoder:
        raise ValueError("steering.sae: steering by a transcoder's features is not supported")
    if c.point not in SAE_STEER_POINTS:
        raise ValueError(f"steering.sae reads {c.point!r}; SAE steering works at {list(SAE_STEER_POINTS)}")
    if steer.point not in ("resid_post", c.point):
        raise ValueError(f"steering.point={steer.point!r}, but the SAE reads {c.point!r} (leave point out)")
    steer.point = c.point
    if steer.layers is not None:
        given = [steer.layers] if isinstance(steer.layers, int) else list(steer.layers)
        if given != [c.layer]:
            raise ValueError(f"steering.layers={given}, but the SAE reads block {c.layer} (leave layers out)")
    steer.layers = [c.layer]
    for name in ("vector", "values", "heads", "neurons"):
        if getattr(steer, name) is not None:
            raise ValueError(f"steering.{name} is not used with an SAE: name features instead")
    feats = _features(steer.features, steer.op, sae.d_sae)
    if steer.op == "add":
        ids = torch.tensor(list(feats), dtype=torch.long)
        scales = torch.tensor(list(feats.values()), dtype=torch.float32)
        steer.vector = (scales[:, None] * sae.W_dec.detach().to("cpu", torch.float32)[ids]).sum(0)
    steer.features = feats


def _features(value: Any, op: str, d_sae: int) -> dict[int, float]:
    if value is None:
        raise ValueError(f"steering.features is required with an SAE: {{id: {'scale' if op == 'add' else 'value'}}}"
                         + (" or [ids]" if op in ("add", "ablate") else ""))
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, Mapping):
        items = list(value.items())
        if op == "ablate":
            items = [(k, 0.0) for k, _ in items]
    elif op in ("add", "ablate"):
        items = [(v, 1.0 if op == "add" else 0.0) for v in value]
    else:
        raise ValueError(f"steering.features for op={op!r} must be {{id: value}}, got {value!r}")
    out: dict[int, float] = {}
    for k, v in items:
        try:
            fid = operator.index(int(k) if isinstance(k, str) else k)
        except (TypeError, ValueError):
            raise ValueError(f"steering.features: feature ids must be integers, got {k!r}") from None
        if not 0 <= fid < d_sae:
            raise ValueError(f"steering.features: feature {fid} is out of range for d_sae={d_sae}")
        v = real(f"steering.features[{fid}]", v)  # float32, as the latents are
        if fid in out:
            raise ValueError(f"steering.features names feature {fid} twice")
        out[fid] = v
    if not out:
        raise ValueError("steering.features is empty")
    return out


def sae_steer_digest(steer: Any) -> bytes:
    """What of an SAE steer the prefix-cache key must cover: the SAE's weights and the features."""
    return steer.sae.digest() + repr(sorted(steer.features.items())).encode()


@dataclass(slots=True)
class SaeEdit:
    """A resolved clamp/set/ablate: the SAE and the latents to set (:meth:`on_device` for the step)."""

    sae: SAE
    ids: torch.Tensor  # int64 [m]
    values: torch.Tensor  # float32 [m]

    def on_device(self, saes: DeviceSAEs) -> SaeEdit:
        """This edit with the SAE (moved once per engine) and the latents on ``saes``' device."""
        return SaeEdit(saes.get(self.sae), self.ids.to(saes.device), self.values.to(saes.device))

    def op(self, rows: slice | torch.Tensor) -> SaeEditOp:
        """The operation on batch ``rows`` of one step."""
        return SaeEditOp(self, rows)


def resolve_sae_edit(steer: Any, hidden_size: int, where: str) -> SaeEdit:
    """Check an SAE clamp/set/ablate against the model (``ValueError`` names ``where``); CPU tensors."""
    sae: SAE = steer.sae
    if sae.d_in != hidden_size:
        raise ValueError(f"{where}.sae has d_in={sae.d_in}, but the model's hidden size is {hidden_size}")
    ids = torch.tensor(list(steer.features), dtype=torch.long)
    values = torch.tensor(list(steer.features.values()), dtype=torch.float32)
    return SaeEdit(sae, ids, values)


@dataclass(slots=True)
class SaeEditOp:
    """Set the planned latents on batch rows ``rows``, keeping the error term (module docstring)."""

    edit: SaeEdit
    rows: slice | torch.Tensor

    def apply(self, t: torch.Tensor) -> None:
        sae = self.edit.sae
        x = t[self.rows].float()
        xn, factors = sae.normalize(x)
        z = sae.encode_normalized(xn)
        dz = torch.zeros_like(z)
        dz[:, self.edit.ids] = self.edit.values - z[:, self.edit.ids]
        t[self.rows] = (x + sae.decode_normalized(dz, factors, bias=False)).to(t.dtype)
