"""Token masks of a step's constrained rows, computed while the forward pass runs."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tapllm.structured.compiler import GrammarMatcher


@dataclass(slots=True)
class TokenMask:
    """Which tokens each constrained row of a step's logits may not take.

    ``rows`` index the rows of the logits that have a grammar; ``banned`` [len(rows), vocab]
    is True where a token is not allowed. ``errors`` maps a row to why its grammar allows nothing.
    """

    rows: torch.Tensor
    banned: torch.Tensor
    errors: dict[int, str] = field(default_factory=dict)

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        """A copy of ``values`` [N, vocab] with every banned token of the constrained rows at -inf."""
        n, width = values.shape
        banned = self.banned.to(values.device, non_blocking=True)
        if banned.shape[1] < width:  # logits wider than the mask: the padding is never allowed
            banned = torch.nn.functional.pad(banned, (0, width - banned.shape[1]), value=True)
        if len(self.rows) == n:  # every row constrained (rows are in order): one masked_fill
            return values.masked_fill(banned, float("-inf"))
        out = values.clone()
        rows = self.rows.to(values.device, non_blocking=True)
        out[rows] = values[rows].masked_fill(banned, float("-inf"))
        return out


@dataclass(slots=True)
class MaskStats:
    """Time spent on token masks since start (for benchmarks and monitoring)."""

    steps: int = 0
    rows: int = 0
    compute_seconds: float = 0.0  # computing and unpacking masks (in the background thread)
    wait_seconds: float = 0.0  # the step waiting for masks after its forward pass


class PendingMask:
    """A step's token mask being computed; :meth:`result` waits for it."""

    __slots__ = ("_future", "_stats")

    def __init__(self, future: Future, stats: MaskStats) -> None:
        self._future = future
        self._stats = stats

    def result(self) -> TokenMask:
        """The mask (waits for the background computation)."""
        t0 = time.perf_counter()
        mask = self._future.result()
        self._stats.wait_seconds += time.perf_counter() - t0
        return mask


class MaskComputer:
    """Computes the token masks of a step's constrained rows in a background thread.

    The matchers only move when a sampled token is accepted, after the step, so a step's
    masks can be computed from its start, while the forward pass runs (llguidance releases
    the GIL and spreads the rows over its own threads). One worker keeps the computations in
    order, so a matcher is never read by two of them at once.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self.stats = MaskStats()

    def submit(self, matchers: list[tuple[int, GrammarMatcher]], vocab_size: int) -> PendingMask | None:
        """Start the masks of ``matchers`` (logits row, matcher); ``None`` when there are none."""
        if not matchers:
            return None
        if self._pool is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tapllm-masks")
        return PendingMask(self._pool.submit(self._compute, matchers, vocab_size), self.stats)

    def _compute(self, matchers: list[tuple[int, GrammarMatcher]], vocab_size: int) -> TokenMask:
        t0 = time.perf_counter()
        words = (vocab_size + 31) // 32
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, (_, m) in enumerate(matchers)],
                                               bits.ctypes.data, words * 4, len(matchers))
        # Token 32 * w + b is bit b of word w: in little-endian bytes, bit b % 8 of byte 4 * w + b // 8.
        little = bits.astype("<i4", copy=False).view(np.uint8)
        banned = np.unpackbits(little, axis=1, bitorder="little")[:, :vocab_size] == 0
        errors = {row: err for row, m in matchers if (err := m.error) is not None}
        mask = TokenMask(torch.tensor([row for row, _ in matchers]), torch.from_numpy(banned), errors)
        self.stats.steps += 1
        self.stats.rows += len(matchers)
        self.stats.compute_seconds += time.perf_counter() - t0
        return mask

    def close(self) -> None:
        """Stop the background thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
