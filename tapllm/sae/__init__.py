"""Sparse autoencoders: load SAELens / sparsify / Gemma Scope SAEs, read their features with
generation (``HiddenStatesSpec(sae=..., features=...)``) and steer by them (``Steer(sae=...)``)."""

from tapllm.sae.model import SAE, SAEConfig

__all__ = ["SAE", "SAEConfig"]
