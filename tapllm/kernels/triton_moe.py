"""The experts of a mixture-of-experts block in two fused Triton kernels, with no value read on the
host: the CUDA backend's expert path, which a CUDA graph can hold
(:mod:`tapllm.kernels.triton_moe_kernels`).

The step's ``T * top_k`` (token, choice) pairs are sorted by expert on the device, each expert's
rows padded to a block (:func:`tapllm.kernels.moe_blocks.pair_blocks`); the first kernel runs every
block through its expert's gate/up rows and the gated activation (SiLU or GELU-tanh), the second
through its down projection, scaling each pair's row by its routing weight and writing it at the
pair's place, and the ``top_k`` rows of each token are summed in one fixed order. Grid sizes depend
on ``T``, ``top_k`` and the expert count only, so every launch is the same at every step of a graph.

Triton is imported only when the op runs or :func:`available` is asked; with
``TRITON_INTERPRET=1`` set before triton is imported the kernels run in Triton's interpreter on CPU
tensors (the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU
from tapllm.kernels.moe_blocks import pair_blocks
from tapllm.kernels.triton_modules import kernels_module, runs_on

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTS = (ACT_SILU, ACT_GELU_TANH)

BLOCK_M = 16  # slots per block: an expert's rows are padded to a multiple of this
# (BLOCK_N, BLOCK_K, warps, stages) per dtype
TILES = {torch.float16: (64, 64, 4, 3), torch.bfloat16: (64, 64, 4, 3), torch.float32: (64, 32, 4, 2)}


def _kernels() -> Any | None:
    """The kernels' module (importing triton), or None when triton cannot be imported."""
    return kernels_module("triton_moe_kernels")


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA, or the CPU under Triton's interpreter."""
    return runs_on(_kernels(), device)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: int) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every row ``t`` of ``x`` ``[T, hidden]``, as
    :func:`tapllm.models.experts.grouped_experts` computes it with ``glu = act(gate) * up`` and no biases.

    ``gate_up`` ``[E, 2I, hidden]`` and ``down`` ``[E, hidden, I]`` in x's dtype (inputs contiguous);
    ``weights`` ``[T, top_k]`` in float32 or x's dtype, ``ids`` ``[T, top_k]`` integers; ``act`` a gated
    activation mode of :mod:`tapllm.kernels.constants`. Each pair's row is ``(y * weight).to(x.dtype)``
    (``y`` the expert's output in x's dtype), and a token's rows are summed over its choices.
    """
    op = "fused_experts"
    n_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    if x.dtype not in _DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"{op}: x and the weights must share one dtype of float16/bfloat16/float32; got "
                         f"{x.dtype}, {gate_up.dtype}, {down.dtype}")
    if tuple(gate_up.shape[1:]) != (2 * inter, hidden) or tuple(down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"{op}: gate_up [E, 2I, {hidden}] and down [E, {hidden}, I] disagree: "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if ids.shape != weights.shape or ids.shape[0] != n_tokens:
        raise ValueError(f"{op}: ids and weights must both be [{n_tokens}, top_k]; got {tuple(ids.shape)}, "
                         f"{tuple(weights.shape)}")
    if act not in _ACTS:
        raise ValueError(f"{op}: act must be one of {_ACTS}; got {act}")
    kernels = _kernels()
    if kernels is None or not available(x.device):
        raise ValueError(f"{op}: needs Triton on a CUDA device, or on the CPU with its interpreter "
                         f"(TRITON_INTERPRET=1 before triton is imported); got {x.device}")
    top_k = ids.shape[1]
    pairs = n_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    blocks = pair_blocks(ids, num_experts, BLOCK_M)
    slots = blocks.sorted_pairs.shape[0]
    block_n, block_k, warps, stages = TILES[x.dtype]
    interpreted = kernels.INTERPRETED
    emulated_bf16 = interpreted and x.dtype == torch.bfloat16
    flags = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                 UPCAST=emulated_bf16, EMULATE_RNE=emulated_bf16, ROWWISE=interpreted, num_warps=warps, num_stages=stages)
    act_rows = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    kernels.moe_gate_up_kernel[(slots // BLOCK_M, -(-inter // block_n))](
        x, gate_up, blocks.sorted_pairs, blocks.block_expert, act_rows, pairs, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act_rows.stride(0), ACT=act, **flags)
    out_pairs = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    kernels.moe_down_kernel[(slots // BLOCK_M, -(-hidden // block_n))](
        act_rows, down, blocks.sorted_pairs, blocks.block_expert, weights.contiguous(), out_pairs, pairs, inter,
        hidden, act_rows.stride(0), down.stride(0), down.stride(1), out_pairs.stride(0), **flags)
    return out_pairs.view(n_tokens, top_k, hidden).sum(1)
