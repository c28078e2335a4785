"""The one place that decides how the forward runs (see the package docstring)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from tapllm.backends.ops import (AttentionOps, CpuAttention, ElementwiseOps, GemvOps, LinearOps, MoEOps, QuantOps,
                                 StackOps)
from tapllm.backends.policy import GraphSizes

BACKENDS = ("auto", "eager", "cpu", "cuda")

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
    linear: LinearOps | None = None  # every linear, each row independent of the step (batch_invariant on CUDA)
    stack: StackOps | None = None  # untapped blocks of decode steps in one call
    moe: MoEOps | None = None  # a mixture-of-experts block's experts, no host read (CUDA: graph-safe)
    graphs: GraphSizes | None = None  # the buckets of whole steps replayed from CUDA graphs (None: none)
    graphs_emulated: bool = False  # the CUDA backend on a CPU: a graph's body runs each step, nothing is captured
    prepack: bool = False  # linear weights reordered once at load for oneDNN (CPU)
    pack_rows: int = 16  # the step rows oneDNN packs them for (1 where only that layout is the GEMV's)
    batch_invariant: bool = False  # every row's result independent of the rest of its step (see invariance)
    notes: tuple[str, ...] = field(default=())  # why a faster path is off

    @property
    def fused(self) -> bool:
        """True when any op family runs compiled code."""
        return any(x is not None for x in (self.elementwise, self.attention, self.quant, self.gemv, self.linear,
                                           self.stack))

    def describe(self) -> str:
        """A few lines for the start-up log and ``LLM.describe()``."""
        def on(x: object, text: str) -> str:
            return text if x is not None else "PyTorch"

        lines = [f"forward backend: {self.name} on {self.device}",
                 f"  norms/rotary/activations: {on(self.elementwise, 'fused kernels')}",
                 f"  attention: {on(self.attention, 'paged kernels (KV read in place)' + self._tiles())}",
                 f"  small linears: {on(self.gemv, f'packed GEMV up to {self.gemv_rows} rows')}",
                 f"  untapped decode blocks: {on(self.stack, 'one C++ call per run of blocks')}",
                 *(["  mixture-of-experts experts: fused kernels, sorted by expert on the device"] if self.moe else []),
                 f"  linear weights: {self._packing()}",
                 f"  CUDA graphs: {self.describe_graphs()}",
                 f"  batch invariant: {self.describe_invariance()}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _tiles(self) -> str:
        return ", bf16 prefill on AMX tiles" if getattr(self.attention, "tiles", False) else ""

    def _packing(self) -> str:
        if not self.prepack:
            return "as loaded"
        text = "prepacked for oneDNN" + (f" (for {self.pack_rows}-row steps, the layout the GEMV reads)"
                                         if self.pack_rows != 16 else "")
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        return text + ("; oneDNN runs bf16 GEMMs on AMX tiles" if amx and self.device.type == "cpu" else "")

    def linear_path(self, dtype: torch.dtype) -> str:
        """How the linear layers of a ``dtype`` model run (unquantized), for the load log."""
        if self.linear is not None:
            return "the batch-invariant Triton GEMM"
        if self.prepack:
            return "prepacked for oneDNN"
        if self.device.type != "cpu" or self.name == "cuda":
            return "F.linear"
        from tapllm.utils.platform import cpu_support

        return f"plain F.linear ({cpu_support().reason or 'no oneDNN packing for ' + str(dtype)})"

    def describe_invariance(self) -> str:
        """How ``batch_invariant`` is kept, or "off"."""
        if not self.batch_invariant:
            return "off"
        if self.linear is not None:
            return ("on: linears in a Triton GEMM of fixed tiles (no split over the inputs); decode rows as "
                    "one-token chunks of the Triton prefill kernel, every key tile masked")
        if self.attention is not None:
            linears = f"the packed GEMV at every size{'' if self.gemv is not None else ' (else one row per call)'}"
            return f"on: {linears}; decode rows in the prefill kernel's order (row_attention)"
        return "on: linears and attention one row per call (PyTorch)"

    def describe_graphs(self) -> str:
        """The graph buckets, or "off"."""
        g = self.graphs
        if g is None:
            return "off"
        text = (f"decode steps of {_sizes(g.decode)} rows, mixed steps of {_sizes(g.mixed)} tokens "
                f"(each plain and tapped, captured at start-up)")
        return text + (" [emulated: the graph body runs each step]" if self.graphs_emulated else "")


def _sizes(sizes: tuple[int, ...]) -> str:
    if not sizes:
        return "no"
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]} ({len(sizes)} sizes)"


def select_backend(device: torch.device, dtype: torch.dtype, *, enforce_eager: bool = False, backend: str = "auto",
                   graphs: GraphSizes | None = None, batch_invariant: bool = False) -> Backend:
    """The backend for a model of ``dtype`` on ``device`` (see the package docstring).

    ``backend`` forces one: ``"cuda"`` on a CPU device runs the CUDA backend's modules there, its
    Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported) and its
    graphs emulated, which is how the tests and ``benchmarks/step_budget.py`` check that path without
    a GPU. ``graphs``: the buckets of CUDA graphs (None: no graphs). ``batch_invariant``: only kernels
    whose every row's result is independent of the rest of the step (``ValueError`` where there are
    none: PyTorch's own step on a GPU, or invariant kernels that fail their trial).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if batch_invariant:
        _check_invariant_path(device, backend, enforce_eager)
    prepack = prepack_available(device, dtype)
    if enforce_eager or backend == "eager":
        why = "enforce_eager=True" if enforce_eager else "backend='eager'"
        return Backend("eager", device, prepack=prepack, batch_invariant=batch_invariant,
                       notes=(f"{why}: the plain PyTorch step",))
    if os.environ.get("TAPLLM_KERNELS", "1") == "0":
        return Backend("eager", device, prepack=prepack, batch_invariant=batch_invariant,
                       notes=("TAPLLM_KERNELS=0: the plain PyTorch step",))
    if backend == "cuda" or (backend == "auto" and device.type == "cuda"):
        return _cuda(device, dtype, graphs, batch_invariant)
    if device.type == "cpu":
        return _cpu(device, dtype, batch_invariant)
    return Backend("eager", device, notes=(f"no compiled ops for {device.type}",))


def _check_invariant_path(device: torch.device, backend: str, enforce_eager: bool) -> None:
    """``ValueError`` where ``batch_invariant`` has no kernels: on a GPU only the CUDA backend's Triton kernels
    keep it (PyTorch's CUDA reductions and cuBLAS GEMMs choose their split from the batch)."""
    if device.type == "cpu":
        return
    eager = enforce_eager or backend in ("eager", "cpu") or os.environ.get("TAPLLM_KERNELS", "1") == "0"
    if device.type != "cuda" or eager:
        where = f"backend={backend!r}{', enforce_eager=True' if enforce_eager else ''} on {device.type}"
        raise ValueError(f"batch_invariant=True needs the CPU or the CUDA backend's Triton kernels, not {where}: "
                         f"PyTorch's GPU reductions and cuBLAS GEMMs split their sums by the batch")


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` are reordered once for oneDNN: on a CPU whose probe
    packed and ran a trial linear in that dtype (see ``tapllm.utils.platform``)."""
    if device.type != "cpu":
        return False
    from tapllm.utils.platform import cpu_support

    return dtype in cpu_support().packable


def _cpu(device: torch.device, dtype: torch.dtype, invariant: bool) -> Backend:
    from tapllm.kernels import fused_kernels, kernels_status
    from tapllm.kernels.gemv import PACK_ROWS, gemv_rows, pack_rows, packed_gemv_ops, packed_gemv_status

    prepack = prepack_available(device, dtype)
    ops = fused_kernels()
    if ops is None:
        return Backend("eager", device, prepack=prepack, batch_invariant=invariant,
                       notes=(f"fused CPU kernels off: {kernels_status()}",))
    gemv = packed_gemv_ops(ops, dtype)
    notes = () if gemv is not None else (f"packed GEMV off: {packed_gemv_status(ops, dtype)}",)
    if invariant:
        from tapllm.kernels.invariance import attention_problem, gemv_problem

        problem = attention_problem(ops, dtype)
        if problem is not None:
            return Backend("eager", device, prepack=prepack, batch_invariant=True,
                           notes=(f"batch_invariant: the fused kernels are off ({problem}): the plain PyTorch step",))
        if gemv is not None and gemv_problem(ops, dtype) is not None:
            notes += (f"batch_invariant: packed GEMV off ({gemv_problem(ops, dtype)}): one row per linear call",)
            gemv = None
    return Backend("cpu", device, elementwise=ops, attention=CpuAttention(ops, invariant), quant=ops, gemv=gemv,
                   gemv_rows=gemv_rows(ops, dtype) if gemv is not None else 0,
                   stack=ops if hasattr(ops, "decoder_layers") else None, prepack=prepack,
                   pack_rows=pack_rows(ops, dtype) if gemv is not None else PACK_ROWS,
                   batch_invariant=invariant, notes=notes)


def _cuda(device: torch.device, dtype: torch.dtype, graphs: GraphSizes | None, invariant: bool = False) -> Backend:
    from tapllm.backends.cuda import TritonAttention, TritonElementwise, elementwise_trial, moe_ops, trial

    emulated = device.type == "cpu"
    problem = trial(device)
    if problem is not None:
        if emulated:
            raise ValueError(f"backend='cuda' on a CPU needs Triton's interpreter (TRITON_INTERPRET=1 before "
                             f"triton is first imported): {problem}")
        _refuse_invariant(invariant, f"the Triton attention is off ({problem})")
        return Backend("eager", device, notes=(f"Triton attention off ({problem}): the plain PyTorch step",))
    problem = elementwise_trial(device, dtype)
    if problem is not None:
        _refuse_invariant(invariant, f"the Triton norms are off ({problem})")
        notes = (f"Triton elementwise ops off ({problem}): PyTorch norms, rotary and activations",)
        return Backend("cuda", device, attention=TritonAttention(), moe=None if invariant else moe_ops(device),
                       graphs=graphs, graphs_emulated=emulated, notes=notes)
    linear = None
    if invariant:
        from tapllm.backends.cuda_invariant import TritonLinear, invariant_trial

        _refuse_invariant(True, invariant_trial(device, dtype))
        linear = TritonLinear()
    return Backend("cuda", device, elementwise=TritonElementwise(), attention=TritonAttention(invariant),
                   linear=linear, moe=None if invariant else moe_ops(device), graphs=graphs, graphs_emulated=emulated,
                   batch_invariant=invariant)


def _refuse_invariant(invariant: bool, problem: str | None) -> None:
    """``ValueError`` when ``batch_invariant`` is asked for and the CUDA backend cannot keep it (``problem``)."""
    if invariant and problem is not None:
        raise ValueError(f"batch_invariant=True cannot be kept on the CUDA backend here: {problem}")
