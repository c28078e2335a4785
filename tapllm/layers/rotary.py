"""Rotary position embedding (rotate-half layout), with the rope scalings transformers knows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tapllm.utils.hf_config import as_transformers_config


def _inv_freq(hf_config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:  # rope parameters per layer type (Gemma-3: local and global layers)
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    # transformers' own implementation of each scaling, so results match it exactly; on the CPU,
    # whatever device the model is being built on (its helpers make tensors on the ambient one).
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    with torch.device("cpu"):
        return ROPE_INIT_FUNCTIONS[rope_type](as_transformers_config(hf_config), torch.device("cpu"), **kwargs)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    ``layer_type`` picks one entry of a ``rope_parameters`` given per layer type (Gemma-3).
    The tables are computed on the CPU (where transformers computes the frequencies) and then
    placed on the device the model is being built on (``torch.get_default_device()``).
    """

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scale = _inv_freq(hf_config, head_dim, layer_type)
        pos = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = pos[:, None] * inv_freq.to("cpu", torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.get_default_device()
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin rows for ``positions`` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] with rows from :meth:`RotaryEmbedding.cos_sin`."""
    cos, sin = cos_sin
    # With float32 cos/sin (OLMo-2) the rotation is computed in float32 and cast back, as there.
    q_rot = (q * cos + _rotate_half(q) * sin).to(q.dtype)
    return q_rot, (k * cos + _rotate_half(k) * sin).to(k.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LongRopeEmbedding(nn.Module):
    """LongRoPE (Phi-3's ``longrope``, formerly ``su``): short and long frequency factors.

    transformers rotates a whole forward with the long factors once its positions reach past
    ``original_max_position_embeddings`` and with the short ones otherwise; the attention
    factor scales cos/sin in both regimes. :meth:`cos_sin` takes that choice per row, so a
    ragged batch can hold sequences of both regimes. cos/sin are computed per step (no table:
    two tables of a 128k context would cost hundreds of MB).
    """

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS["longrope"]
        hf_config = as_transformers_config(hf_config)
        self.original_max = int(hf_config.rope_parameters["original_max_position_embeddings"])
        with torch.device("cpu"):  # see _inv_freq
            short, self.scale = init(hf_config, torch.device("cpu"))
            long, _ = init(hf_config, torch.device("cpu"), seq_len=self.original_max + 1)
        inv = torch.stack((short.to("cpu"), long.to("cpu")))  # [2, rotary_dim / 2]
        self.register_buffer("inv_freq", inv.to(torch.get_default_device()), persistent=False)

    def cos_sin(self, positions: torch.Tensor, long_rows: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, rotary_dim]`` for ``positions`` [T], long factors where ``long_rows`` [T] is set."""
        freqs = positions.float()[:, None] * self.inv_freq[long_rows.long()]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype).unsqueeze(1), (emb.sin() * self.scale).to(dtype).unsqueeze(1)
