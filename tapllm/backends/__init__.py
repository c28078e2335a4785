"""The forward backend: how a model's step runs on its device, chosen once at load, in one place.

:func:`select_backend` picks one of

- ``eager``: plain PyTorch for every op (the reference every other path is tested against;
  ``enforce_eager=True``, ``TAPLLM_KERNELS=0``, or wherever nothing faster is available);
- ``cpu``: tapllm's fused C++ kernels (norms, rotary, activations, KV write, paged decode and
  prefill attention), oneDNN-prepacked linears with a packed GEMV for steps of a few rows, and
  runs of untapped blocks of a decode step in one C++ call;
- ``cuda``: Triton kernels reading the paged KV cache in place, Triton norms, rotary (fused with
  the KV write) and gated activations, a mixture-of-experts block's experts in fused Triton kernels
  (sorted by expert on the device), and CUDA graphs of decode steps at batch buckets
  (``cuda_graph_sizes``).

and records why (a probe that failed, an option that turned something off). Modules receive
typed handles to the op families (:mod:`tapllm.backends.ops`); :meth:`Backend.describe` is
what the start-up log and ``LLM.describe()`` print.
"""

from tapllm.backends.ops import (AttentionOps, ElementwiseOps, FusedSiteOps, GemvOps, MoEOps, QuantOps,
                                 RotaryKVWriteOps, StackOps)
from tapllm.backends.select import Backend, select_backend

__all__ = ["AttentionOps", "Backend", "ElementwiseOps", "GemvOps", "MoEOps", "QuantOps", "RotaryKVWriteOps", "StackOps",
           "select_backend"]
