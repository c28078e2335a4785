"""The forward path of every rank of a tensor-parallel engine: one decision, made alike on each rank.

A rank runs the CPU backend's kernels (prepacked oneDNN linears, the packed GEMV, fused norms,
rotary and activations, paged attention on its own KV heads). The whole-block C++ runner
(``Backend.stack``) takes a decode step's untapped blocks where the ranks meet in shared memory:
it all-reduces o's and down's partial sums there itself (tapllm/models/stack.py); over gloo the
blocks run op by op. CUDA graphs are not captured under tensor parallelism.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tapllm.backends import Backend, select_backend
from tapllm.models.base import CausalLM


def shard_backend(device: torch.device, dtype: torch.dtype, size: int, enforce_eager: bool, backend: str) -> Backend:
    """The backend of each of ``size`` ranks (every rank calls this with the same arguments)."""
    chosen = select_backend(device, dtype, enforce_eager=enforce_eager, backend=backend)
    note = (f"tensor_parallel_size={size}: the C++ block runner all-reduces in shared memory where the ranks "
            "share a machine; over gloo blocks run op by op")
    return replace(chosen, graphs=None, notes=(*chosen.notes, note))


def prepare_shard(model: CausalLM, backend: Backend) -> None:
    """After loading a rank's weights: pack its linears and hand its modules the backend's ops."""
    # quantized weights are never prepacked (as in one process); a float layer beside them is not either
    model.prepare_for_inference(backend.prepack and getattr(model, "quant", None) is None, backend.pack_rows)
    model.use_backend(backend)
