"""What rank 0 sends the other ranks, one message per call they must join, in call order.

Messages travel pickled over each worker's pipe (the step's inputs are small: token ids,
positions, attention metadata, the step's steering); the tensors the model computes travel
only through the group's collectives.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch


def _same(x: Any) -> Any:
    return x


class _Pickler(pickle.Pickler):
    """A pickler that sends a tensor viewing part of a larger buffer (a step's inputs are views into
    one staging buffer) as a compact copy, not with the whole buffer behind it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
            return _same, (obj.clone(),)
        return NotImplemented


def dumps(msg: object) -> bytes:
    """``msg`` pickled for a worker's pipe (see :class:`_Pickler`)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buffer.getvalue()


@dataclass(slots=True)
class InitCache:
    """Allocate the KV cache: ``num_blocks`` blocks (plus the padding one) of ``block_size`` tokens."""

    num_blocks: int
    block_size: int


@dataclass(slots=True)
class Forward:
    """Run the model over one step's batch, with the step's steering and the points to gather."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # AttentionMetadata, without its ``attn`` (the kernels' handle: each rank sets its own)
    num_layers: int | None
    steer_ops: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    gathered: dict[tuple[str, int], torch.Tensor | None] = field(default_factory=dict)  # point -> rows (None: all)
    layers: frozenset[int] = frozenset()
    pattern_layers: frozenset[int] = frozenset()
    from_rank0: frozenset[tuple[str, int]] = frozenset()  # points rank 0 steers alone, then broadcasts
    kernels: bool = False  # rank 0's step attends with the backend's kernels (meta.attn was set)
    relayed: frozenset[tuple[str, int]] = frozenset()  # points rank 0's tap captures (another stage sends them)
    seq: int = 0  # the step's number: tags its residual's sends between pipeline stages
    folded: dict[tuple[str, int], Any] = field(default_factory=dict)  # point -> Folds: folded, then gathered
    heads: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)  # q/z -> the only heads gathered


@dataclass(slots=True)
class Logits:
    """Join the vocabulary-parallel LM head over ``hidden`` (final-norm rows)."""

    hidden: torch.Tensor


@dataclass(slots=True)
class Lens:
    """Join the logit lens over residual-stream states ``x`` of ``point``."""

    point: str
    x: torch.Tensor


@dataclass(slots=True)
class CopyBlocks:
    """Copy whole KV blocks ``(source, destination)`` in every layer (copy-on-write after a fork)."""

    copies: list[tuple[int, int]]


@dataclass(slots=True)
class Shutdown:
    """Leave the loop and exit."""
