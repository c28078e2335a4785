"""RMSNorm, computed in float32 like the reference implementation; LayerNorm with bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.backends.ops import ElementwiseOps
from tapllm.kernels.constants import RMS_FLOAT_SCALE, RMS_GEMMA, RMS_LLAMA
from tapllm.tap.fused import NormSites


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned scale.

    ``ops`` (the backend's fused kernels, set by the model when it has them) computes rows
    ``[T, dim]`` in one pass with the same roundings (``kernel_mode`` says which order).
    """

    ops: ElementwiseOps | None = None
    kernel_mode = RMS_LLAMA
    fused_sites: bool = False  # ``ops`` applies a graph step's tap sites (FusedSiteOps), and the model lets it
    invariant: bool = False  # batch_invariant: per-head norms ([T, H, D]) through ``ops`` too, as rows of D

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.stride(1) == 1:
            return self.ops.rms_norm(x, self.weight, self.eps, self.kernel_mode)
        if self.ops is not None and self.invariant and x.dim() > 2:
            # PyTorch's reduction over the last dimension splits it by the number of rows (on a GPU)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.ops.rms_norm(rows, self.weight, self.eps, self.kernel_mode).view(x.shape)
        return self.eager(x)

    def add_and_norm(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + r, norm(x + r))``; with the fused kernels ``x`` is updated in place in the same pass."""
        if self.ops is not None and x.dim() == 2 and x.stride(1) == 1 and r.stride(1) == 1:
            return x, self.ops.add_rms_norm_(x, r, self.weight, self.eps, self.kernel_mode)
        s = x + r
        return s, self.forward(s)

    def norm_sites(self, x: torch.Tensor, r: torch.Tensor | None, sites: NormSites) -> torch.Tensor | None:
        """The norm of ``x`` (with ``r``: of ``x += r``, in place) with ``sites`` applied in the kernel
        (:mod:`tapllm.tap.fused`); None, with nothing done, where the fused kernels cannot take them."""
        if not self.fused_sites or x.dim() != 2 or x.stride(1) != 1 or (r is not None and r.stride(1) != 1):
            return None
        return self.ops.rms_norm_sites(x, r, self.weight, self.eps, self.kernel_mode, sites)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """The plain PyTorch norm (the reference of the kernel)."""
        # Normalise in float32, cast back, then scale: the reference implementation's order.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerNorm(nn.Module):
    """Layer norm over the last dimension with a learned scale and (optionally) bias (GPT-2, GPT-NeoX).

    Computed by ``F.layer_norm`` in the input's dtype, as ``torch.nn.LayerNorm`` does.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the scale is ``1 + weight``, and everything is computed in float32.

    The checkpoint stores ``weight`` centred on 0. Unlike :class:`RMSNorm`, the product with
    the scale happens in float32 before the cast back (the reference's order for Gemma).
    """

    kernel_mode = RMS_GEMMA

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class RMSNormScaledInFloat32(RMSNorm):
    """RMSNorm that scales in float32 and then casts back (OLMo-2's order; equal in float32)."""

    kernel_mode = RMS_FLOAT_SCALE

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
