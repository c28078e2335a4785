"""A linear layer whose weights come from a checkpoint, optionally prepacked for oneDNN on CPU.

On CPU, ``F.linear`` reorders the weight into oneDNN's blocked layout on every call; for the
small row counts of decoding that dominates, so weights are reordered once at load time (what
torch.compile's CPU freezing does). The public ``torch.utils.mkldnn.to_mkldnn``
(``MkldnnLinear``) converts every input to and from oneDNN's tensor format, which costs more
than it saves at decode sizes, and torch.compile's freezing costs a compile per shape; so the
private ``torch.ops.mkldnn`` packing ops are used, where the backend says so (``Backend.prepack``:
where ``tapllm.utils.platform``'s probe packed and ran a trial linear in that dtype on this CPU;
bf16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT); everywhere else the layer is a plain ``F.linear``. With the CPU backend,
steps of at most ``Backend.gemv_rows`` rows read the packed weight in place with tapllm's GEMV
(``tapllm.kernels.gemv``). With ``batch_invariant`` every step takes that GEMV, whose row results do
not depend on the step's other rows; where it cannot run, each row is its own one-row call
(:func:`rowwise`). On the CUDA backend ``batch_invariant`` hands every layer the backend's invariant
linear instead (``Backend.linear``: a Triton GEMM of fixed tiles, :meth:`Linear.use_linear`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tapllm.backends.ops import GemvOps, LinearOps
from tapllm.kernels.gemv import PACK_ROWS, Sample, reads, sample_entries


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised storage; ``nn.Linear`` would waste time on random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None
        self.sample: Sample | None = None  # entries of the weight before packing
        # With the backend's GEMV: the packed buffer as a plain tensor, for steps of at most
        # ``gemv_rows`` rows; None keeps oneDNN's call at every size.
        self.gemv: torch.Tensor | None = None
        self.gemv_rows = 0
        self.ops: GemvOps | None = None
        self.invariant = False  # batch_invariant: row results independent of the step's other rows
        self.linear_ops: LinearOps | None = None  # the backend's invariant linear (CUDA), used for every step

    def pack(self, rows: int = PACK_ROWS) -> None:
        """Replace the weight by a oneDNN-packed copy, packed for steps of ``rows`` rows (call after loading,
        when available; ``Backend.pack_rows``)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, rows)
        if self.packed.dtype in (torch.bfloat16, torch.float32):  # the GEMV checks its layout against these
            self.sample = sample_entries(self.weight.data)
        self.weight = None  # the packed copy is the only one kept

    def use_gemv(self, ops: GemvOps | None, rows: int, invariant: bool = False) -> None:
        """Read the packed weight in place for steps of at most ``rows`` rows with ``ops`` (the backend's
        GEMV, probed for the weight's dtype); None restores oneDNN's call. ``invariant``: every row's
        result independent of the rest of the step (the GEMV at every size, else one row per call)."""
        self.invariant = invariant
        usable = ops is not None and self.packed is not None and self.packed.dtype in (torch.bfloat16, torch.float32)
        view = None
        if usable:
            try:
                view = ops.packed_view(self.packed)
            except RuntimeError:  # a layout the kernel does not read (oneDNN packs some shapes plainly): oneDNN's call
                view = None
            if view is not None and (self.sample is None or not reads(view, self.sample)):
                view = None  # another layout of the same size (oneDNN's choice for this shape): oneDNN's call
        self.ops = ops if view is not None else None
        self.gemv = view
        self.gemv_rows = rows if view is not None else 0

    def use_linear(self, ops: LinearOps | None) -> None:
        """Compute every step with ``ops`` (the backend's batch-invariant linear); None: the other paths."""
        self.linear_ops = ops if ops is not None and self.packed is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` by whichever path the layer was set up for (a row-parallel layer passes None,
        adding its bias after the all-reduce)."""
        if self.linear_ops is not None:
            return self.linear_ops.linear(x, self.weight, bias)
        gemv = self.gemv is not None and x.dim() == 2 and x.dtype == self.gemv.dtype
        if gemv and (self.invariant or x.shape[0] <= self.gemv_rows):
            return self.ops.packed_linear(x, self.gemv, bias)
        if self.invariant:
            return rowwise(lambda rows: self._library(rows, bias), x)
        return self._library(x, bias)

    def _library(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [None], "")
        return F.linear(x, self.weight, bias)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a linear map of the last dimension) applied to each row of ``x`` alone, as a ``[1, K]`` call.

    A library GEMM's row results depend on how many rows it is given and where the row sits among
    them (oneDNN's and MKL's do, measured); the same one-row call gives a row the same result in any
    step, at the cost of a call per row.
    """
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 1:
        return fn(flat).view(*x.shape[:-1], -1)
    return torch.cat([fn(flat[i : i + 1]) for i in range(flat.shape[0])]).view(*x.shape[:-1], -1)


def pack_linears(model: nn.Module, rows: int = PACK_ROWS) -> None:
    """Prepack every :class:`Linear` of ``model`` for steps of ``rows`` rows (the backend decided both:
    ``Backend.prepack``, ``Backend.pack_rows``)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(rows)
