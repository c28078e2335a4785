"""How a model's dimensions split over tensor-parallel ranks: pure arithmetic, no processes.

Megatron's layout: query heads, MLP neurons and the vocabulary are cut into equal contiguous
parts, rank ``r`` holding part ``r``. KV heads are cut the same way when there are at least as
many as ranks; with fewer, each KV head is held by ``size // num_kv_heads`` consecutive ranks
(replicated), so every rank's query heads find their KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The part of each sharded dimension that rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        problems = divisibility_problems(self.size, self.num_heads, self.num_kv_heads, self.intermediate_size,
                                         self.vocab_size)
        if problems:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the model: " + "; ".join(problems))
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.size})")

    # ---- local sizes ---------------------------------------------------------------------
    @property
    def heads(self) -> int:
        """Query heads per rank."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads per rank (1 when they are replicated)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 when KV heads are split)."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def neurons(self) -> int:
        """MLP neurons per rank."""
        return self.intermediate_size // self.size

    @property
    def vocab(self) -> int:
        """Vocabulary rows per rank."""
        return self.vocab_size // self.size

    # ---- where this rank's part starts ---------------------------------------------------
    @property
    def head_start(self) -> int:
        return self.rank * self.heads

    @property
    def kv_head_start(self) -> int:
        return (self.rank // self.kv_replicas) * self.kv_heads

    @property
    def neuron_start(self) -> int:
        return self.rank * self.neurons

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def kv_owner_ranks(self) -> list[int]:
        """One rank per distinct part of the KV heads, in head order (what a gather of k/v keeps)."""
        return list(range(0, self.size, self.kv_replicas))


def divisibility_problems(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                          vocab_size: int) -> list[str]:
    """Each config field that ``size`` ranks cannot split evenly, with its value (empty: it splits)."""
    if size < 1:
        return [f"tensor_parallel_size must be >= 1, got {size}"]
    out = []
    if num_heads % size:
        out.append(f"num_attention_heads={num_heads} is not a multiple of {size}")
    if num_kv_heads % size and size % num_kv_heads:
        out.append(f"num_key_value_heads={num_kv_heads} neither is a multiple of {size} nor divides it")
    if intermediate_size % size:
        out.append(f"intermediate_size={intermediate_size} is not a multiple of {size}")
    if vocab_size % size:
        out.append(f"vocab_size={vocab_size} is not a multiple of {size}")
    return out
