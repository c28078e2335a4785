"""SAE features in a collected dataset: each token row holds the SAE's top-k latents, sparse.

Columns (one entry per row, like the points' ``[layers, hidden]`` with one "layer"):

* ``sae_ids`` ``[1, k]`` int32: the k largest latents' feature ids, largest first;
* ``sae_values`` ``[1, k]`` float32: their activations (0 past the SAE's active latents);
* ``sae_error_norm`` (one number a row): ``||x - reconstruction||``.

A row's dense latents are ``torch.zeros(d_sae).index_put_((ids[0].long(),), values[0])``.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.hidden_states.spec import HiddenStatesSpec


def sae_spec(cfg: Any, positions: str) -> HiddenStatesSpec:
    """What a collection with ``--sae`` captures: its points (if any) and the SAE's top latents."""
    return HiddenStatesSpec(layers=cfg.layers if cfg.points else None, points=list(cfg.points), positions=positions,
                            sae=cfg.sae, features=f"topk:{cfg.sae_top}")


def sae_identity(cfg: Any) -> dict[str, Any]:
    """The SAE part of a run's identity (``run.json``): where it came from, what it is, a digest of its weights."""
    spec = cfg.spec()
    sae = spec.sae
    return {"source": str(cfg.sae), "architecture": sae.architecture, "point": sae.point, "layer": sae.layer,
            "d_sae": sae.d_sae, "top": cfg.sae_top, "digest": sae.digest().hex()}


def feature_columns(features: Any) -> dict[str, torch.Tensor]:
    """A request's ``Features`` as the dataset's columns."""
    return {"sae_ids": features.ids[:, None, :].contiguous(),
            "sae_values": features.values.float()[:, None, :].contiguous(),
            "sae_error_norm": features.error_norm.float().contiguous()}
