"""How a model's dimensions split over tensor-parallel ranks (and its blocks over pipeline stages):
pure arithmetic, no processes.

Megatron's layout: query heads, MLP neurons and the vocabulary are cut into contiguous parts,
rank ``r`` holding part ``r``. Where a size does not divide by the ranks, the parts are balanced
(the first ``size % ranks`` ranks hold one more). Query heads go with their KV head: when there
are at least as many KV heads as ranks, each rank holds a balanced run of whole KV groups (a KV
head and the query heads that read it), so 3 groups of 3 over 2 ranks give 6 + 3 query heads and
2 + 1 KV heads. With fewer KV heads than ranks, each KV head is held by ``size // num_kv_heads``
consecutive ranks (replicated) and the query heads split evenly, so every rank's query heads find
their KV head locally.
"""

from __future__ import annotations

from dataclasses import dataclass


def balanced(total: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part ``i`` of ``total`` cut into ``parts`` contiguous runs, the first
    ``total % parts`` one longer than the rest."""
    base, extra = divmod(total, parts)
    return i * base + min(i, extra), base + (i < extra)


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
    # MLP neurons are split in runs of this many (a quantized down_proj's input block: 32, a group, 256), so
    # every rank's slice of its inputs starts and ends on a block boundary
    neuron_unit: int = 1

    def __post_init__(self) -> None:
        problems = divisibility_problems(self.size, self.num_heads, self.num_kv_heads, self.intermediate_size,
                                         self.vocab_size, self.neuron_unit)
        if problems:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the model: " + "; ".join(problems))
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.size})")

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 when KV heads are split)."""
        return max(1, self.size // self.num_kv_heads)

    # ---- every rank's part: (start, count) ------------------------------------------------
    def _kv_part(self, rank: int) -> tuple[int, int]:
        if self.kv_replicas > 1:
            return rank // self.kv_replicas, 1
        return balanced(self.num_kv_heads, self.size, rank)

    def _head_part(self, rank: int) -> tuple[int, int]:
        if self.kv_replicas > 1:
            return balanced(self.num_heads, self.size, rank)  # even: checked
        group = self.num_heads // self.num_kv_heads
        start, count = self._kv_part(rank)
        return start * group, count * group

    @property
    def head_counts(self) -> list[int]:
        """Query heads of every rank, in rank order."""
        return [self._head_part(r)[1] for r in range(self.size)]

    @property
    def kv_head_counts(self) -> list[int]:
        """KV heads of every rank, in rank order (replicated ones counted on each rank holding them)."""
        return [self._kv_part(r)[1] for r in range(self.size)]

    def _neuron_part(self, rank: int) -> tuple[int, int]:
        start, count = balanced(self.intermediate_size // self.neuron_unit, self.size, rank)
        return start * self.neuron_unit, count * self.neuron_unit

    @property
    def neuron_counts(self) -> list[int]:
        """MLP neurons of every rank, in rank order."""
        return [self._neuron_part(r)[1] for r in range(self.size)]

    @property
    def vocab_counts(self) -> list[int]:
        """Vocabulary rows of every rank, in rank order."""
        return [balanced(self.vocab_size, self.size, r)[1] for r in range(self.size)]

    # ---- this rank's sizes ---------------------------------------------------------------
    @property
    def heads(self) -> int:
        """This rank's query heads."""
        return self._head_part(self.rank)[1]

    @property
    def kv_heads(self) -> int:
        """This rank's KV heads (1 when they are replicated)."""
        return self._kv_part(self.rank)[1]

    @property
    def neurons(self) -> int:
        """This rank's MLP neurons."""
        return self._neuron_part(self.rank)[1]

    @property
    def vocab(self) -> int:
        """This rank's vocabulary rows."""
        return balanced(self.vocab_size, self.size, self.rank)[1]

    # ---- where this rank's part starts ---------------------------------------------------
    @property
    def head_start(self) -> int:
        return self._head_part(self.rank)[0]

    @property
    def kv_head_start(self) -> int:
        return self._kv_part(self.rank)[0]

    @property
    def neuron_start(self) -> int:
        return self._neuron_part(self.rank)[0]

    @property
    def vocab_start(self) -> int:
        return balanced(self.vocab_size, self.size, self.rank)[0]

    def parts_text(self) -> str:
        """What each rank holds, e.g. ``6 + 3 of 9 query heads, 2 + 1 of 3 KV heads (split), ...``: one
        count where every rank holds the same, else every rank's, in rank order."""
        def of(counts: list[int], total: int, what: str) -> str:
            shown = str(counts[0]) if len(set(counts)) == 1 else " + ".join(map(str, counts))
            return f"{shown} of {total} {what}"

        kv = "split" if self.kv_replicas == 1 else f"each held by {self.kv_replicas} ranks"
        return (f"{of(self.head_counts, self.num_heads, 'query heads')}, "
                f"{of(self.kv_head_counts, self.num_kv_heads, 'KV heads')} ({kv}), "
                f"{of(self.neuron_counts, self.intermediate_size, 'MLP neurons')}, "
                f"{of(self.vocab_counts, self.vocab_size, 'vocabulary rows')}")

    def kv_owner_ranks(self) -> list[int]:
        """One rank per distinct part of the KV heads, in head order (what a gather of k/v keeps)."""
        return list(range(0, self.size, self.kv_replicas))


def divisibility_problems(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                          vocab_size: int, neuron_unit: int = 1) -> list[str]:
    """Each config field that ``size`` ranks cannot split, even unevenly, with its value (empty: it splits).

    Heads, neurons and vocabulary rows may split unevenly, but every rank needs at least one of each;
    KV heads must either be at least as many as the ranks (each rank then holds whole KV groups) or
    divide the ranks (each held by ``size // num_kv_heads`` ranks, the query heads then split evenly)."""
    if size < 1:
        return [f"tensor_parallel_size must be >= 1, got {size}"]
    out = []
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        out.append(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    elif num_heads < size:
        out.append(f"num_attention_heads={num_heads} is fewer than the {size} ranks")
    elif num_kv_heads < size:
        if size % num_kv_heads:
            out.append(f"num_key_value_heads={num_kv_heads} is fewer than the {size} ranks and does not divide them")
        elif num_heads % size:
            out.append(f"num_attention_heads={num_heads} is not a multiple of {size} (needed where the "
                       f"num_key_value_heads={num_kv_heads} are replicated over the ranks)")
    if neuron_unit > 1 and (intermediate_size % neuron_unit or intermediate_size // neuron_unit < size):
        out.append(f"intermediate_size={intermediate_size} does not split into at least {size} runs of "
                   f"{neuron_unit} neurons (the quantized down_proj's blocks of inputs)")
    elif intermediate_size < size:
        out.append(f"intermediate_size={intermediate_size} is fewer than the {size} ranks")
    if vocab_size < size:
        out.append(f"vocab_size={vocab_size} is fewer than the {size} ranks")
    return out


def stage_layers(num_layers: int, stages: int, head_blocks: float = 0.0) -> list[tuple[int, int]]:
    """``(first block, stop)`` of each of ``stages`` pipeline stages: contiguous runs of the model's
    ``num_layers`` blocks; ``ValueError`` naming the fields when there are fewer blocks than stages.

    Stage 0 also runs the LM head, which costs as much as ``head_blocks`` blocks (its weights over a
    block's): it takes that many fewer blocks than an even share of the blocks and the head, at least
    one; the other stages share the rest evenly (balanced runs)."""
    if stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {stages}")
    if num_layers < stages:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's num_hidden_layers={num_layers}: "
                         "every stage needs at least one block")
    if stages == 1:
        return [(0, num_layers)]
    first = max(1, min(num_layers - (stages - 1), round((num_layers + head_blocks) / stages - head_blocks)))
    out = [(0, first)]
    for s in range(stages - 1):
        start, count = balanced(num_layers - first, stages - 1, s)
        out.append((first + start, first + start + count))
    return out
