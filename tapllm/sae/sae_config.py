"""``SAEConfig``: what an SAE is and where it reads (the weights live in ``model.SAE``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SAEConfig:
    """What an SAE is and where it reads: architecture, sizes, options and its point in tapllm's terms.

    ``point``/``layer`` name where the encoder reads (a tapllm point and block index; ``embed``
    and ``final`` have ``layer=None``). A transcoder also names ``out_point``/``out_layer``,
    what its decoder predicts. ``hook_name`` is the name in the source format (TransformerLens'
    hook name, sparsify's hookpoint or Gemma Scope's folder).
    """

    architecture: str
    d_in: int
    d_sae: int
    point: str | None = None
    layer: int | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    rescale_acts_by_decoder_norm: bool = False
    out_point: str | None = None
    out_layer: int | None = None
    hook_name: str | None = None
    format: str = "tapllm"
    source: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def transcoder(self) -> bool:
        """True when the decoder predicts another point than the encoder reads."""
        return self.out_point is not None
