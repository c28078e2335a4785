"""SAE features in one Triton launch: from encoder pre-activations to each row's largest latents,
sorted, and its reconstruction error norm (see :mod:`tapllm.kernels.triton_sae_kernels`).

The caller computes ``pre = x_in @ W_enc + b_enc`` (one matmul for every row of a step); the kernel
does the rest of a ``standard``, ``jumprelu`` or ``topk`` SAE's encode and decode. Triton is
imported only when the kernel runs; on CPU tensors it runs in Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported), which is how the tests check it against
the PyTorch encode. The launch depends on shapes only.
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.triton_modules import kernels_module, runs_on

ARCHS = ("standard", "jumprelu", "topk")
MAX_K = 256  # the most latents a row gathers and sorts: a topk SAE's k, else the requests' largest k
_SCAN = 512  # latents a program reads at a time while it searches and counts
_NUMBERS = 8192  # about how many numbers a [latents, columns] tile holds while gathering or decoding
# In Triton's interpreter every tile op costs a Python call whatever its size: tiles of up to this many
# latents there (0: the GPU's tiles, which the tests use to cover rows of many tiles).
INTERPRETER_TILE = 16384


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_sae_kernels")


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device`` (CUDA, or the CPU under Triton's interpreter)."""
    return runs_on(_kernels(), device)


def fits(arch: str, k_sae: int | None, k_out: int) -> bool:
    """Whether the kernel computes ``arch``'s top ``k_out`` latents (a topk SAE: at most its own k)."""
    if arch == "topk":
        return k_sae is not None and 1 <= k_out <= k_sae <= MAX_K
    return arch in ARCHS and 1 <= k_out <= MAX_K


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _check(name: str, t: torch.Tensor, rows: int | None, width: int, device: torch.device) -> None:
    if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or t.shape[1] != width or \
            (t.stride(1) != 1 and width > 1):
        want = f"[{rows if rows is not None else 'n'}, {width}]"
        raise ValueError(f"sae_features: {name} must be {want} with contiguous rows; got {tuple(t.shape)}, "
                         f"strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"sae_features: {name} is on {t.device}, pre on {device}")


def sae_features(pre: torch.Tensor, w_dec: torch.Tensor, base: torch.Tensor, target: torch.Tensor, *, arch: str,
                 k_out: int, k: int | None = None, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's ``k_out`` largest latents and reconstruction error, from pre-activations ``pre``.

    Args:
        pre: ``[n, d_sae]`` float32, ``x_in @ W_enc + b_enc``.
        w_dec: ``[d_sae, d_out]`` float32 decoder.
        base: ``[n, d_out]`` or ``[1, d_out]`` float32 rows the reconstruction starts from (``b_dec``,
            plus a skip connection's output).
        target: ``[n, d_out]`` rows (any float dtype) the reconstruction is measured against.
        arch: ``standard``, ``jumprelu`` (``threshold`` ``[d_sae]``) or ``topk`` (its ``k``).
        k_out: latents kept per row (:func:`fits`).

    Returns:
        int32 ``[n, 2 * k_out + 1]``: the ids, largest latent first (ties: lowest id first), then the
        latents' float32 bits, then the error norm's (``.view(torch.float32)`` reads them).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("sae_features: triton cannot be imported (pip install triton)")
    if not fits(arch, k, k_out):
        raise ValueError(f"sae_features: {arch} SAE (k={k}) cannot give {k_out} latents a row here "
                         f"(at most {MAX_K}, and at most the SAE's own k)")
    if arch == "jumprelu" and threshold is None:
        raise ValueError("sae_features: a jumprelu SAE needs its threshold")
    n, d_sae = pre.shape
    d_out = w_dec.shape[1]
    if pre.dtype != torch.float32 or w_dec.dtype != torch.float32 or base.dtype != torch.float32:
        raise ValueError(f"sae_features: pre, w_dec and base must be float32; got {pre.dtype}, {w_dec.dtype}, "
                         f"{base.dtype}")
    _check("pre", pre, None, d_sae, pre.device)
    _check("w_dec", w_dec, d_sae, d_out, pre.device)
    _check("target", target, n, d_out, pre.device)
    if base.shape[0] not in (1, n):
        raise ValueError(f"sae_features: base must have 1 or {n} rows; got {base.shape[0]}")
    _check("base", base, base.shape[0], d_out, pre.device)
    thr = threshold if threshold is not None else pre
    if threshold is not None:
        if threshold.shape != (d_sae,) or threshold.dtype != torch.float32 or threshold.stride(0) != 1:
            raise ValueError(f"sae_features: threshold must be contiguous float32 [{d_sae}]")
    out = torch.empty((n, 2 * k_out + 1), dtype=torch.int32, device=pre.device)
    if n == 0:
        return out
    kk = k if arch == "topk" else k_out
    block_k = _pow2(kk, 16)
    block_s = min(_SCAN, _pow2(d_sae, 16))
    collect_s = min(block_s, max(16, _NUMBERS // block_k))
    block_d = min(_pow2(d_out, 16), max(16, _NUMBERS // block_k) if arch == "topk" else 512)
    dec_s = 16
    if kernels.INTERPRETED and INTERPRETER_TILE:
        block_s = collect_s = min(INTERPRETER_TILE, _pow2(d_sae, 16))
        dec_s = min(block_s, 256)
    kernels.sae_features_kernel[(n,)](
        pre, thr, w_dec, base, target, out, d_sae, d_out, pre.stride(0), w_dec.stride(0),
        0 if base.shape[0] == 1 else base.stride(0), target.stride(0), out.stride(0),
        ARCH=ARCHS.index(arch), K=kk, K_OUT=k_out, BLOCK_K=block_k, BLOCK_S=block_s, COLLECT_S=collect_s,
        DEC_S=dec_s, BLOCK_D=block_d, num_warps=8 if d_sae >= 4096 else 4)
    return out
