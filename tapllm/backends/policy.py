"""The one decider of how each step runs: a whole-step CUDA graph, or the eager step, and why.

:class:`StepPolicy` is made from the backend's graph sizes and asked once per step with the
step's :class:`StepShape`. A step of single-token decodes replays the ``decode`` graph of the next
batch size up; a step with prefill chunks replays the ``mixed`` graph of the next token count up;
either one *tapped* (its sites read the slot tables) when some row's request captures or steers.
What no graph can run goes eagerly, and the reason is counted (``eager_steps``), as the
``/metrics`` counter ``tapllm_graph_fallback_steps_total{reason}`` shows it.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger("tapllm")


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    """Which graph a step replays: its kind ("decode" or "mixed"), its size (rows or tokens), tapped or plain."""

    kind: str
    size: int
    tapped: bool


@dataclass(frozen=True, slots=True)
class GraphSizes:
    """The buckets graphs are captured at: decode batch sizes, mixed-step token counts, and the most
    sequences (requests' chunks) a mixed step holds."""

    decode: tuple[int, ...]
    mixed: tuple[int, ...]
    max_seqs: int

    def keys(self) -> list[GraphKey]:
        """Every graph: each bucket plain and tapped."""
        return [GraphKey(kind, size, tapped) for kind, sizes in (("decode", self.decode), ("mixed", self.mixed))
                for size in sizes for tapped in (False, True)]

    @property
    def buckets(self) -> int:
        return len(self.decode) + len(self.mixed)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the decider needs to know about a step."""

    decode_only: bool
    tokens: int  # rows of the batch
    seqs: int  # requests' chunks in it
    sample_rows: int  # rows whose logits are sampled (forks waiting on a prompt share its row)
    tapped: bool  # some row's slot captures or steers
    blocked: str | None = None  # why some request of the step cannot run in a graph


class StepPolicy:
    """Chooses each step's path (see the module docstring)."""

    def __init__(self, sizes: GraphSizes | None, off: str | None = None) -> None:
        """``sizes`` None: no graphs at all (``off`` says why, once, in :attr:`off`)."""
        self.sizes = sizes
        self.off = off
        self.eager_steps: Counter[str] = Counter()
        self.graph_steps = 0

    def choose(self, shape: StepShape) -> tuple[GraphKey | None, str | None]:
        """The graph to replay, or None and why the step runs eagerly (counted)."""
        key, reason = self._choose(shape)
        if key is None:
            self.eager_steps[reason] += 1
            logger.debug("step runs eagerly: %s", reason)
        else:
            self.graph_steps += 1
        return key, reason

    def _choose(self, shape: StepShape) -> tuple[GraphKey | None, str | None]:
        sizes = self.sizes
        if sizes is None:
            return None, self.off or "no CUDA graphs"
        if shape.blocked is not None:
            return None, shape.blocked
        if shape.decode_only and sizes.decode:
            size = _bucket(sizes.decode, shape.tokens)
            if size is not None:
                return GraphKey("decode", size, shape.tapped), None
        if not sizes.mixed:
            return None, "a prefill chunk in the step" if not shape.decode_only else \
                f"more than {sizes.decode[-1]} rows"
        size = _bucket(sizes.mixed, shape.tokens)
        if size is None:
            return None, f"more than {sizes.mixed[-1]} tokens"
        if shape.seqs > min(size, sizes.max_seqs) or shape.sample_rows > min(size, sizes.max_seqs):
            return None, f"more than {sizes.max_seqs} sequences"
        return GraphKey("mixed", size, shape.tapped), None

    @property
    def eager_share(self) -> float:
        """Eager steps over all steps decided so far."""
        eager = sum(self.eager_steps.values())
        total = eager + self.graph_steps
        return eager / total if total else 0.0


def _bucket(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def default_graph_sizes(max_num_seqs: int, max_num_batched_tokens: int, decode: list[int] | None = None,
                        mixed: list[int] | None = None) -> GraphSizes:
    """vLLM's decode buckets (1, 2, 4, then every multiple of 8 up to ``max_num_seqs``, at most 512) unless
    given, and mixed-step token buckets at powers of two from 16 up to ``max_num_batched_tokens``."""
    if decode is None:
        top = min(max_num_seqs, 512)
        decode = sorted({b for b in (1, 2, 4, *range(8, top + 1, 8)) if b <= top} | {top})
    else:
        decode = sorted({b for b in decode if b <= max_num_seqs})
    if mixed is None:
        mixed = []
        b = 16
        while b < max_num_batched_tokens:
            mixed.append(b)
            b *= 2
        mixed.append(max_num_batched_tokens)
    else:
        mixed = sorted({b for b in mixed if b <= max_num_batched_tokens})
    return GraphSizes(tuple(decode), tuple(sorted(set(mixed))), max_num_seqs)
