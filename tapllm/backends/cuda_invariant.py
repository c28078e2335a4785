"""The CUDA backend under ``batch_invariant``: its linears, and the trial of its invariant kernels.

Every row's result must not depend on the rest of its step. The backend keeps its Triton norms,
rotary and activations (one program per row, a row's reductions fixed by its width alone) and its
attention with ``invariant`` on (:class:`~tapllm.backends.cuda.TritonAttention`); its linears take
:func:`tapllm.kernels.triton_linear.invariant_linear` instead of cuBLAS. Before use,
:func:`invariant_trial` compares bits on the device: rows of a linear alone against the same rows
among others, and decode rows against the same tokens inside prefill chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TritonLinear:
    """:class:`~tapllm.backends.ops.LinearOps` on :func:`tapllm.kernels.triton_linear.invariant_linear`."""

    __slots__ = ("_k",)

    def __init__(self) -> None:
        from tapllm.kernels import triton_linear

        self._k = triton_linear

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._k.invariant_linear(x, weight, bias)


def invariant_trial(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the invariant kernels keep a row's bits on ``device`` in ``dtype``, else what failed."""
    from tapllm.kernels import triton_linear

    if not triton_linear.available(device):
        return f"the invariant Triton linear cannot run on {device}"
    try:
        return _linear_rows(device, dtype) or _attention_rows(device, dtype)
    except Exception as exc:  # noqa: BLE001 - a failed launch means: no invariant path here
        return f"trial failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"


def _linear_rows(device: torch.device, dtype: torch.dtype) -> str | None:
    """Rows of a linear alone, and in steps of other sizes and places, against each other and ``F.linear``."""
    from tapllm.kernels.triton_linear import invariant_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 80, generator=g).to(dtype).to(device)
    w = (torch.randn(72, 80, generator=g) / 8).to(dtype).to(device)
    b = torch.randn(72, generator=g).to(dtype).to(device)
    whole = invariant_linear(x, w, b)
    want = F.linear(x.float(), w.float(), b.float())
    if not torch.allclose(whole.float(), want, rtol=2e-2, atol=2e-2):
        return f"the invariant linear disagrees with F.linear ({dtype})"
    for first, rows in ((0, 1), (5, 1), (3, 9), (60, 10), (1, 66)):
        if not torch.equal(invariant_linear(x[first:first + rows], w, b), whole[first:first + rows]):
            return f"the invariant linear changed rows {first}..{first + rows - 1} with the step's size ({dtype})"
    return None


def _attention_rows(device: torch.device, dtype: torch.dtype) -> str | None:
    """Decode rows against the same tokens at several places of prefill chunks, with a window and a soft-cap."""
    from tapllm.kernels import triton_attention as ta

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, page = 4, 2, 64, 16
    length = 80  # the sequence's tokens, all in the cache
    k_cache = torch.randn(kv_heads, 8, page, dim, generator=g).to(dtype).to(device)
    v_cache = torch.randn(kv_heads, 8, page, dim, generator=g).to(dtype).to(device)
    q = torch.randn(length, heads, dim, generator=g).to(dtype).to(device)
    table = torch.tensor([[2, 7, 0, 5, 1, 3]], device=device)
    index, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    for window, cap in ((0, 0.0), (20, 5.0)):
        # the sequence's last token as a decode row alone
        last = ta.decode_rows(q[length - 1 :], k_cache, v_cache, table, torch.tensor([length], **index), dim**-0.5,
                              window, cap)
        for ctx, n in ((0, length), (37, length - 37), (70, length - 70)):
            chunk = ta.prefill_attention(q[ctx:], k_cache, v_cache, torch.tensor([0], **index),
                                         torch.tensor([n], **index), torch.tensor([ctx], **index), table,
                                         dim**-0.5, window, cap, n, invariant=True)
            rows = torch.tensor([ctx, ctx + n // 2, ctx + n - 1], **index)
            alone = ta.decode_rows(q[rows], k_cache, v_cache, table.expand(3, -1), rows + 1, dim**-0.5, window, cap)
            if not torch.equal(alone, chunk[rows - ctx]):
                return f"decode rows differ from the same tokens in a prefill chunk ({dtype}, window {window})"
            # a graph's unified step: that decode row (a sequence of its own), then the chunk
            unified = ta.unified_attention(torch.cat([q[length - 1 :], q[ctx:]]), k_cache, v_cache,
                                           table.to(torch.int32), torch.tensor([0, 0], **i32),
                                           torch.tensor([0, 1, 1 + n], **i32), torch.tensor([length - 1, ctx], **i32),
                                           dim**-0.5, window, cap, invariant=True)
            if not (torch.equal(unified[:1], last) and torch.equal(unified[1:], chunk)):
                return f"the unified step's rows differ from the same tokens alone ({dtype}, window {window})"
    return None
