"""The server's SAE extension: ``extra_body={"sae_features": {...}}`` and SAE entries in ``steering``.

A server names its SAEs at startup (``tapllm serve --sae NAME=PATH``, repeatable) and clients
refer to them by name only: a request can never make the server read a file. Features come
back inside the response's ``hidden_states`` object as ``features`` (binary tensors, like states;
``tapllm.hidden_states.json_codec.features_to_wire``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.sae.features import registered_saes
from tapllm.utils.dtypes import DTYPES

DtypeName = Literal[tuple(DTYPES)]  # type: ignore[valid-type]


def served_sae(name: str, field: str) -> str:
    """``name`` if the server registered an SAE under it; ``ValueError`` lists the ones it serves."""
    known = sorted(registered_saes())
    if name not in known:
        hint = f"this server serves {known}" if known else "this server serves no SAEs (start it with --sae NAME=PATH)"
        raise ValueError(f"{field}: unknown SAE {name!r}; {hint}")
    return name


class SaeFeaturesRequest(BaseModel):
    """``sae_features``: ``{"sae": NAME, "features": "topk:16" | [ids] | "all", "positions": ..., "dtype": ...,
    "encoding": "base64" | "list"}``."""

    model_config = ConfigDict(extra="forbid")
    sae: str
    features: str | list[int] = "topk:16"
    positions: str | list[int] = "all"
    dtype: DtypeName | None = None
    encoding: Literal["base64", "list"] = "base64"

    def merge(self, spec: HiddenStatesSpec | None) -> HiddenStatesSpec:
        """The request's spec with these features (a features-only spec when no ``hidden_states`` was asked)."""
        name = served_sae(self.sae, "sae_features.sae")
        if spec is None:
            positions: Any = tuple(self.positions) if isinstance(self.positions, list) else self.positions
            if isinstance(positions, tuple) and len(positions) != 2:
                raise ValueError(f"sae_features.positions as a window must be [start, stop], got {self.positions}")
            return HiddenStatesSpec(sae=name, features=self.features, positions=positions, dtype=self.dtype)
        if self.positions != "all" or self.dtype is not None:
            raise ValueError("sae_features.positions/dtype: with hidden_states, the features follow its positions and "
                             "dtype; leave them out")
        return HiddenStatesSpec(layers=spec.layers, points=spec.points, positions=spec.positions, dtype=spec.dtype,
                                lens=spec.lens, lens_targets=spec.lens_targets, heads=spec.heads,
                                experts=spec.experts, sae=name,
                                features=self.features)
