"""What the modules of a model see of a backend's compiled ops: typed handles, one per op family.

A backend (see :mod:`tapllm.backends`) hands each module the ops of its family, or ``None``,
in which case the module runs its plain PyTorch code (the reference). The protocols below
say exactly which calls a module may make; the CPU backend satisfies them with the C++ ops
of ``tapllm.kernels`` (``torch.ops.tapllm_<isa>``), the CUDA backend its elementwise ops and
attention with Triton kernels (and, for ``batch_invariant``, its linears).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tapllm.tap.fused import HeadSites, KernelSites, NormSites


class ElementwiseOps(Protocol):
    """Norms, rotary and gated activations over rows ``[T, dim]`` (tapllm.kernels.reference defines them)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int) -> torch.Tensor: ...

    def add_rms_norm_(self, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                      mode: int) -> torch.Tensor: ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None: ...

    def gated_act(self, gate_up: torch.Tensor, act: int) -> torch.Tensor: ...


class RotaryKVWriteOps(ElementwiseOps, Protocol):
    """Elementwise ops that also rotate q/k and store k/v into the paged cache in one launch (CUDA's
    Triton ops); :class:`~tapllm.models.base.Attention` uses it where nothing steers k or v."""

    def rotary_kv_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None: ...


class FusedSiteOps(RotaryKVWriteOps, Protocol):
    """Elementwise ops that also apply a graph step's tap sites to the rows they compute (CUDA's Triton
    ops; see :mod:`tapllm.tap.fused`): the Llama family's norms, rotary and gated activation in tapped graphs;
    a ``None`` result: the rows do not fit one kernel, nothing was done."""

    def rms_norm_sites(self, x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int,
                       sites: NormSites) -> torch.Tensor | None: ...

    def rotary_sites(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, sites: HeadSites) -> None: ...

    def gated_act_sites(self, gate_up: torch.Tensor, act: int, rows: KernelSites, site: int) -> torch.Tensor | None: ...


class AttentionOps(Protocol):
    """Attention over the paged KV cache ``[Hkv, num_blocks, block_size, D]``, read in place."""

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int,
                         softcap: float) -> torch.Tensor: ...

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor,
                          scale: float, window: int, softcap: float, max_len: int) -> torch.Tensor: ...


class LinearOps(Protocol):
    """Linears whose every row's result is independent of the step's other rows (batch_invariant on CUDA:
    :func:`tapllm.kernels.triton_linear.invariant_linear`); ``F.linear``'s contract."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class MoEOps(Protocol):
    """A mixture-of-experts block's experts in fused kernels with no value read on the host (a CUDA graph
    holds them): :func:`tapllm.kernels.triton_moe.fused_experts`'s contract (gated SiLU/GELU-tanh, no biases)."""

    def fused_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, act: int) -> torch.Tensor: ...


class GemvOps(Protocol):
    """Linears of a few rows reading oneDNN's prepacked weight in place (tapllm.kernels.gemv)."""

    def packed_view(self, packed: torch.Tensor) -> torch.Tensor: ...

    def packed_linear(self, x: torch.Tensor, view: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class QuantOps(Protocol):
    """Linears and embedding rows over quantized blocks (tapllm.quant)."""

    def quant_linear(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None,
                     act_bits: int) -> torch.Tensor: ...

    def quant_dequantize(self, rows: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor: ...


class StackOps(Protocol):
    """Runs of whole pre-norm Llama-style blocks of a decode step in one call (tapllm.models.stack)."""

    def decoder_layers(self, *args: object) -> torch.Tensor: ...


class CpuAttention:
    """:class:`AttentionOps` over the C++ ops namespace (which takes no ``max_len``).

    ``invariant`` (batch_invariant): decode rows take ``row_attention``, the prefill kernel's
    arithmetic for one row, so a token's attention does not depend on how its step was made; prefill
    keeps the AVX512 task that it repeats (no AMX tiles).
    """

    __slots__ = ("invariant", "ops")

    def __init__(self, ops: object, invariant: bool = False) -> None:
        self.ops = ops
        self.invariant = invariant

    @property
    def tiles(self) -> bool:
        """Whether bfloat16 prefill attention runs on AMX tiles (this CPU and process run them, not invariant)."""
        return not self.invariant and bool(getattr(self.ops, "amx_supported", lambda: False)())

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self.ops.kv_write(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int,
                         softcap: float) -> torch.Tensor:
        attend = self.ops.row_attention if self.invariant else self.ops.decode_attention
        return attend(q, k_cache, v_cache, block_tables, lens, scale, window, softcap)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor, tables: torch.Tensor,
                          scale: float, window: int, softcap: float, max_len: int) -> torch.Tensor:
        return self.ops.prefill_attention(q, k_cache, v_cache, starts, lens, contexts, tables, scale, window,
                                          softcap, not self.invariant)
