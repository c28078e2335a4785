"""The memory-bandwidth bound of a decode step, and tapllm's decode step against it.

A batch-1 decode step reads every weight once, so it cannot be faster than the weights'
bytes over the machine's memory bandwidth. The bandwidth is measured the way a decode step
uses it: a matrix-vector product of one row over a weight matrix far larger than the
last-level cache, prepacked as the model's linears are, in the model's dtype, with the
process's torch threads.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

STREAM_BYTES = 1.6e9  # far past any last-level cache


def stream_bandwidth_gbs(dtype: torch.dtype, repeats: int = 5) -> float:
    """GB/s of a GEMV over a ``STREAM_BYTES`` matrix of ``dtype`` (best of ``repeats``)."""
    from tapllm.backends.select import prepack_available

    k = 4096
    n = int(STREAM_BYTES / (k * torch.tensor([], dtype=dtype).element_size()))
    w = torch.empty(n, k, dtype=dtype).normal_()
    nbytes = w.numel() * w.element_size()
    x = torch.randn(1, k).to(dtype)
    # As the model's linears run: prepacked once where oneDNN packs this dtype (a plain weight
    # would be reordered, so read and written, on every call: half the apparent bandwidth).
    if prepack_available(torch.device("cpu"), dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        del w

        def gemv() -> None:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
    else:
        def gemv() -> None:
            torch.nn.functional.linear(x, w)
    gemv()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        gemv()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def streamed_weight_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Bytes of the weights one decode step reads: every parameter once (a tied table once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return numel * torch.tensor([], dtype=dtype).element_size()


def decode_step_ms(llm: Any, vocab: int, prompt_len: int = 128, new_tokens: int = 65, trials: int = 3,
                   first_id: int = 32) -> float:
    """tapllm's batch-1 decode step: (time of ``new_tokens`` - time of 1) / (``new_tokens`` - 1),
    on fresh random prompts each time (no prefix-cache help), best of ``trials``."""
    from tapllm import SamplingParams

    def timed(n: int) -> float:
        prompt = [random.randrange(first_id, vocab) for _ in range(prompt_len)]
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    best = float("inf")
    for _ in range(trials):
        best = min(best, (timed(new_tokens) - timed(1)) / (new_tokens - 1))
    return best * 1e3
