"""The one place that decides how the forward runs (see the package docstring)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from tapllm.backends.ops import AttentionOps, CpuAttention, ElementwiseOps, GemvOps, QuantOps, StackOps

logger = logging.getLogger("tapllm")


@dataclass(frozen=True, slots=True)
class Backend:
    """The forward path of one engine: which op families run compiled code, and why the others do not.

    A field left ``None`` means the modules of that family run their PyTorch code.
    """

    name: str  # "eager" | "cpu" | "cuda"
    device: torch.device
    elementwise: ElementwiseOps | None = None
    attention: AttentionOps | None = None
    quant: QuantOps | None = None
    gemv: GemvOps | None = None  # linears of at most ``gemv_rows`` rows (CPU, packed weights)
    gemv_rows: int = 0
    stack: StackOps | None = None  # untapped blocks of decode steps in one call
    graph_sizes: tuple[int, ...] = ()  # CUDA graph batch buckets of decode steps (empty: none)
    notes: tuple[str, ...] = field(default=())  # why a faster path is off

    @property
    def fused(self) -> bool:
        """True when any op family runs compiled code."""
        return any(x is not None for x in (self.elementwise, self.attention, self.quant, self.gemv, self.stack))

    def describe(self) -> str:
        """A few lines for the start-up log and ``LLM.describe()``."""
        def on(x: object, text: str) -> str:
            return text if x is not None else "PyTorch"

        lines = [f"forward backend: {self.name} on {self.device}",
                 f"  norms/rotary/activations: {on(self.elementwise, 'fused kernels')}",
                 f"  attention: {on(self.attention, 'paged kernels (KV read in place)')}",
                 f"  small linears: {on(self.gemv, f'packed GEMV up to {self.gemv_rows} rows')}",
                 f"  untapped decode blocks: {on(self.stack, 'one C++ call per run of blocks')}",
                 f"  CUDA graphs: {', '.join(map(str, self.graph_sizes)) if self.graph_sizes else 'off'}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def select_backend(device: torch.device, dtype: torch.dtype, *, enforce_eager: bool = False,
                   graph_sizes: tuple[int, ...] = ()) -> Backend:
    """The backend for a model of ``dtype`` on ``device`` (see the package docstring)."""
    if enforce_eager:
        return Backend("eager", device, notes=("enforce_eager=True: the plain PyTorch step",))
    if os.environ.get("TAPLLM_KERNELS", "1") == "0":
        return Backend("eager", device, notes=("TAPLLM_KERNELS=0: the plain PyTorch step",))
    if device.type == "cpu":
        return _cpu(device, dtype)
    if device.type == "cuda":
        return _cuda(device, dtype, graph_sizes)
    return Backend("eager", device, notes=(f"no compiled ops for {device.type}",))


def _cpu(device: torch.device, dtype: torch.dtype) -> Backend:
    from tapllm.kernels import fused_kernels, kernels_status
    from tapllm.kernels.gemv import MAX_ROWS, packed_gemv_ops, packed_gemv_status

    ops = fused_kernels()
    if ops is None:
        return Backend("eager", device, notes=(f"fused CPU kernels off: {kernels_status()}",))
    gemv = packed_gemv_ops(ops, dtype)
    notes = () if gemv is not None else (f"packed GEMV off: {packed_gemv_status(ops, dtype)}",)
    return Backend("cpu", device, elementwise=ops, attention=CpuAttention(ops), quant=ops, gemv=gemv,
                   gemv_rows=MAX_ROWS if gemv is not None else 0,
                   stack=ops if hasattr(ops, "decoder_layers") else None, notes=notes)


def _cuda(device: torch.device, dtype: torch.dtype, graph_sizes: tuple[int, ...]) -> Backend:
    from tapllm.backends.cuda import TritonAttention, TritonElementwise, elementwise_trial, trial

    problem = trial(device)
    if problem is not None:
        return Backend("eager", device, notes=(f"Triton attention off ({problem}): the plain PyTorch step",))
    problem = elementwise_trial(device, dtype)
    if problem is not None:
        notes = (f"Triton elementwise ops off ({problem}): PyTorch norms, rotary and activations",)
        return Backend("cuda", device, attention=TritonAttention(), graph_sizes=graph_sizes, notes=notes)
    return Backend("cuda", device, elementwise=TritonElementwise(), attention=TritonAttention(),
                   graph_sizes=graph_sizes)
