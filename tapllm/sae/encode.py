"""An SAE's latents and reconstruction of a batch of rows, in PyTorch (every architecture and option).

This is the reference the fused kernel (:mod:`tapllm.kernels.triton_sae`) is tested against, and
the path of the SAEs and devices it does not cover.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tapllm.sae.model import SAE

SPARSE_DECODE_DENSITY = 32  # decode by gathering when fewer than 1 latent in this many is active (CPU)


def encode_and_reconstruct(sae: SAE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense latents ``[n, d_sae]`` and the reconstruction ``[n, d_out]`` of float32 rows ``x``.

    A top-k SAE decodes only its k active latents (a gather of k decoder rows per row); on CPU,
    so does any SAE whose latents are sparse enough that gathering beats the dense matmul.
    """
    xn, factors = sae.normalize(x)
    z = sae.encode_normalized(xn)
    c = sae.cfg
    if c.architecture == "topk":
        vals, idx = torch.topk(z, c.k, dim=-1)
        if c.rescale_acts_by_decoder_norm:
            vals = vals / sae.W_dec.norm(dim=-1)[idx]
        y = F.embedding_bag(idx, sae.W_dec, per_sample_weights=vals, mode="sum") + sae.b_dec
        if factors is not None:
            scale, shift = factors
            y = y * scale + shift
    elif z.device.type == "cpu" and not c.rescale_acts_by_decoder_norm and \
            int(z.count_nonzero()) * SPARSE_DECODE_DENSITY < z.numel():
        y = sparse_decode(z, sae.W_dec) + sae.b_dec
        if factors is not None:
            scale, shift = factors
            y = y * scale + shift
    else:
        y = sae.decode_normalized(z, factors)
    if sae.W_skip is not None:
        y = y + x @ sae.W_skip.T
    return z, y


def sparse_decode(z: torch.Tensor, w_dec: torch.Tensor) -> torch.Tensor:
    """``z @ w_dec`` for mostly-zero latents ``z`` ``[n, d_sae]``: a weighted sum of the active rows of
    ``w_dec`` per row (equal to the matmul up to float rounding; a row with no active latent gives 0)."""
    n, d = z.shape
    flat = z.reshape(-1)
    idx = flat.nonzero().squeeze(1)  # row-major, so each row's latents are contiguous
    rows = idx // d
    offsets = torch.searchsorted(rows, torch.arange(n, device=z.device))  # where each row's bag starts
    return F.embedding_bag(idx - rows * d, w_dec, offsets=offsets, per_sample_weights=flat.index_select(0, idx),
                           mode="sum")
