"""The compiled kernels ``batch_invariant=True`` runs, checked bit for bit on this CPU before use.

In that mode every row's result must not depend on the rest of its step. On the CPU backend:

- linears take the packed GEMV (:mod:`tapllm.kernels.gemv`) at every row count: each row's sums run
  over the inputs in one order whatever the number of rows and the row's place among them. oneDNN's
  GEMM does not keep that (measured here: a bf16 row of a 576x1536 linear changed between 2 and 3 rows,
  a float32 row between 1 and 2), nor does MKL's float32 GEMM;
- prefill chunks keep ``prefill_attention``, whose key tiles start at multiples of its tile size, and
  decode rows take ``row_attention``, which repeats that kernel's arithmetic for a row alone
  (csrc/row_attention.cpp), so a token's attention is the same in a chunk of any size or in a decode step.

The trial runs both on shapes that exercise their tails (rows at several places in steps of 1 to 130
rows; prompts attended in one chunk, in uneven chunks and row by row, with a sliding window and a
soft-cap) and compares bits. A pass is remembered beside the build (:mod:`tapllm.kernels.trials`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tapllm.kernels import build_folder
from tapllm.kernels.gemv import pack_rows
from tapllm.kernels.trials import recall, remember

logger = logging.getLogger("tapllm")

_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
_state: dict[tuple[int, str, torch.dtype], str | None] = {}


def attention_problem(ops: Any, dtype: torch.dtype) -> str | None:
    """Why ``row_attention`` cannot stand for ``prefill_attention`` rows in ``dtype`` here, or None."""
    return _checked(ops, "attention", dtype, _attention_trial)


def gemv_problem(ops: Any, dtype: torch.dtype) -> str | None:
    """Why the packed GEMV (already probed against oneDNN) is not row-invariant in ``dtype`` here, or None."""
    return _checked(ops, "gemv", dtype, _gemv_trial)


def _checked(ops: Any, what: str, dtype: torch.dtype, trial: Any) -> str | None:
    key = (id(ops), what, dtype)
    if key not in _state:
        name = f"invariant_{what}_{_NAMES.get(dtype, str(dtype))}"
        folder = build_folder(ops)
        problem = None if recall(folder, name) else _run(trial, ops, dtype)
        if problem is None:
            remember(folder, name, True)
        else:
            logger.warning("batch_invariant: %s kernels off in %s (%s)", what, dtype, problem)
        _state[key] = problem
    return _state[key]


def _run(trial: Any, ops: Any, dtype: torch.dtype) -> str | None:
    try:
        return trial(ops, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the eager code
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"


def _gemv_trial(ops: Any, dtype: torch.dtype) -> str | None:
    g = torch.Generator().manual_seed(0)
    for n, k in ((130, 72), (576, 1536)):  # padded N and K; K past a block of outputs' cache lines
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g).to(dtype),
                                                         pack_rows(ops, dtype))
        view = ops.packed_view(packed)
        bias = torch.randn(n, generator=g).to(dtype)
        x = torch.randn(130, k, generator=g).to(dtype)
        alone = torch.cat([ops.packed_linear(x[i : i + 1], view, bias) for i in range(x.shape[0])])
        for rows in (2, 3, 5, 64, 65, 71, 130):
            for first in (0, 130 - rows):
                got = ops.packed_linear(x[first : first + rows], view, bias)
                if not torch.equal(got, alone[first : first + rows]):
                    return f"a row of a {n}x{k} linear changed in a step of {rows} rows"
    return None


def _attention_trial(ops: Any, dtype: torch.dtype) -> str | None:
    g = torch.Generator().manual_seed(0)
    bs, n = 16, 530  # past row_attention's group of 8 key tiles (512 keys)
    for heads, kv_heads, d in ((4, 2, 16), (6, 2, 64), (2, 1, 80)):
        blocks = n // bs + 3
        k_cache = torch.randn(kv_heads, blocks, bs, d, generator=g).to(dtype)
        v_cache = torch.randn(kv_heads, blocks, bs, d, generator=g).to(dtype)
        table = torch.randperm(blocks, generator=g)[: -(-n // bs)][None].contiguous()
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
        q = qkv[:, : heads * d].view(n, heads, d)  # a view of a fused projection, as the model's
        for window, cap in ((0, 0.0), (40, 0.0), (0, 4.0), (520, 0.0)):
            def chunks(cuts: list[int]) -> torch.Tensor:
                return torch.cat([ops.prefill_attention(q[a:b], k_cache, v_cache, torch.tensor([0]),
                                                        torch.tensor([b - a]), torch.tensor([a]), table,
                                                        d**-0.5, window, cap, False)
                                  for a, b in zip(cuts, cuts[1:])])

            whole = chunks([0, n])
            if not torch.equal(whole, chunks([0, 37, 100, 101, 515, n])):
                return f"prefill_attention rows changed with the chunking (head size {d}, window {window})"
            rows = ops.row_attention(q, k_cache, v_cache, table.expand(n, -1).contiguous(), torch.arange(1, n + 1),
                                     d**-0.5, window, cap)
            if not torch.equal(whole, rows):
                return f"row_attention differs from prefill_attention (head size {d}, window {window}, softcap {cap})"
    return None
