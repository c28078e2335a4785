"""Decode-sized linears on oneDNN-prepacked bfloat16 or float32 weights, read in place (packed_gemv.cpp).

oneDNN's call on a prepacked weight costs 20-40 us at a small model's decode shapes, so the
121 linears of a batch-1 step ran at about half the memory bandwidth. tapllm's kernel reads the
very buffer oneDNN packed (no second copy), for steps of at most :data:`MAX_ROWS` rows; larger
ones keep oneDNN's call. It assumes oneDNN's AVX512 layouts (bf16: blocks of 64 outputs x input
pairs; float32: 64 outputs x inputs), so it is used only after this module's probe ran it, per
dtype, against oneDNN on shapes that pad both dimensions; any other layout (an AMX machine's, a
future oneDNN's) or a CPU without AVX512-BF16 (bf16) or AVX512 (float32) keeps oneDNN, and the
log says so. A passing probe is remembered beside the kernel build (:mod:`tapllm.kernels.trials`).
``TAPLLM_PACKED_GEMV=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tapllm.kernels import build_folder
from tapllm.kernels.constants import GEMV_MAX_ROWS
from tapllm.kernels.trials import recall, remember

logger = logging.getLogger("tapllm")

MAX_ROWS = GEMV_MAX_ROWS  # the C++ kernel and the decoder runner read the same number (constants.py)

_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the dtypes the kernel reads

_state: dict[tuple[int, torch.dtype], tuple[bool, str]] = {}
_ON = "on (oneDNN's packed layout read in place)"


def packed_gemv_ops(ops: Any, dtype: torch.dtype = torch.bfloat16) -> Any | None:
    """``ops`` when its packed GEMV runs correctly on this CPU's packed ``dtype`` weights, else None."""
    if ops is None or dtype not in _NAMES:
        return None
    key = (id(ops), dtype)
    if key not in _state:
        _state[key] = _probe(ops, dtype)
        ok, reason = _state[key]
        (logger.info if ok else logger.warning)("packed %s GEMV for <= %d rows: %s", _NAMES[dtype], MAX_ROWS, reason)
    return ops if _state[key][0] else None


def packed_gemv_status(ops: Any, dtype: torch.dtype) -> str:
    """Why the packed GEMV is on or off for ``dtype`` weights (probing it first if needed)."""
    if dtype not in _NAMES:
        return f"off (the kernel reads {', '.join(_NAMES.values())} weights, not {dtype})"
    packed_gemv_ops(ops, dtype)
    return _state[(id(ops), dtype)][1]


def _probe(ops: Any, dtype: torch.dtype) -> tuple[bool, str]:
    from tapllm.utils.platform import cpu_support

    if os.environ.get("TAPLLM_PACKED_GEMV", "1") == "0":
        return False, "off (TAPLLM_PACKED_GEMV=0): oneDNN's call"
    if dtype == torch.bfloat16:
        if not hasattr(ops, "packed_gemv_supported") or not ops.packed_gemv_supported():
            return False, "off (no AVX512-BF16 in this build or CPU): oneDNN's call"
    elif not hasattr(ops, "packed_gemv_f32_supported") or not ops.packed_gemv_f32_supported():
        return False, "off (no AVX512 in this build): oneDNN's call"
    if dtype not in cpu_support().packable:
        return False, f"off ({_NAMES[dtype]} weights are not packed here)"
    trial = f"packed_gemv_{_NAMES[dtype]}"
    folder = build_folder(ops)
    if recall(folder, trial):
        return True, _ON
    problem = _compare_with_onednn(ops, dtype)
    if problem is not None:
        return False, problem
    remember(folder, trial, True)
    return True, _ON


def _compare_with_onednn(ops: Any, dtype: torch.dtype) -> str | None:
    """Run the kernel against oneDNN on shapes that pad both dimensions; why it is off, or None."""
    g = torch.Generator().manual_seed(0)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    try:
        for n, k in ((130, 72), (64, 33), (520, 576)):  # padded and exact N and K, an odd K; 9 blocks
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
            view = ops.packed_view(packed)
            for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, MAX_ROWS):
                x = torch.randn(rows, k, generator=g).to(dtype)
                for bias in (None, b):
                    want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "").float()
                    got = ops.packed_linear(x, view, bias).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if not err < tol:  # a wrong layout gives an error of order 1
                        return f"off (disagrees with oneDNN at {n}x{k}, {rows} rows: {err:.2e}): oneDNN's call"
    except Exception as exc:  # noqa: BLE001 - any failure means: keep oneDNN's call
        return f"off ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}): oneDNN's call"
    return None
