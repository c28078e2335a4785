"""Rank 0's model as the model runner sees it: each call of the model is first announced to the other
ranks (:mod:`tapllm.parallel.messages`), then made on rank 0's shard, meeting them in the collectives;
under pipeline parallelism a step's forward is started (stage 0's blocks) and finished later
(:func:`~tapllm.parallel.ranks.start_rank0`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tapllm.backends import Backend
from tapllm.config import EngineConfig, ModelConfig
from tapllm.hidden_states.plan import Folds
from tapllm.models.base import KVCache
from tapllm.parallel.backend import shard_backend
from tapllm.parallel.driver import TensorParallel
from tapllm.parallel.group import TensorParallelError
from tapllm.parallel.messages import Forward, Lens, Logits
from tapllm.parallel.ranks import start_rank0
from tapllm.parallel.shard_tap import SHARDED_DIMS, ShardTap
from tapllm.steering.plan import PLAIN_OPS
from tapllm.tap import Tap, no_tap
from tapllm.tap.points import QUERY_HEAD_POINTS


class DriverModel:
    """Rank 0's model as the model runner sees it: each call is announced to the workers first."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.shard = tp.model
        self.num_layers = len(self.shard.layers)
        self.forwards = 0  # steps run (for benchmarks: collectives per step)

    @property
    def needs_prompt_lengths(self) -> bool:
        """Whether the step's metadata carries each row's prompt length (Phi-3's LongRoPE picks by it)."""
        return bool(self.shard.needs_prompt_lengths)

    @property
    def stack(self) -> Any:
        """Rank 0's C++ block runner (None where its blocks run in Python)."""
        return self.shard.stack

    @property
    def last_runs(self) -> tuple[tuple[int, int, str], ...]:
        return self.shard.last_runs

    def prompt_salt(self, num_prompt: int) -> bytes:
        return self.shard.prompt_salt(num_prompt)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: Any,
                 tap: Tap | None = None, num_layers: int | None = None) -> torch.Tensor | None:
        """The step's forward on every rank; returns rank 0's final-norm hidden states (or None)."""
        return self.start(input_ids, positions, kv_caches, meta, tap, num_layers)()

    def start(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: Any,
              tap: Tap | None = None, num_layers: int | None = None) -> Callable[[], torch.Tensor | None]:
        """Start the step's forward on every rank; returns what finishes it (rank 0's final-norm hidden states,
        or None). Without pipeline stages the forward is done before this returns; with them, stage 0's blocks
        are, and later steps may start before this one is finished (steps finish in the order they started)."""
        self.forwards += 1
        inner = no_tap if tap is None else tap
        keys = set(getattr(tap, "targets", {}) or {})
        steering = getattr(tap, "steering", None)
        steer_ops = dict(steering.ops) if steering is not None else {}
        from_rank0 = frozenset(k for k, ops in steer_ops.items() if not all(isinstance(op, PLAIN_OPS) for op in ops))
        steer_ops = {k: ops for k, ops in steer_ops.items() if k not in from_rank0}
        pattern_layers = frozenset(i for i in range(self.num_layers) if inner.wants_pattern(i))
        folded: dict[tuple[str, int], Folds] = {}
        capture = getattr(tap, "capture", None)
        if capture is not None and self.tp.pp == 1:  # (a later pipeline stage relays whole points)
            folds = capture.fold(SHARDED_DIMS)
            # a steered key is gathered whole (the steer needs it); the tap then folds it on rank 0
            folded = {k: folds[k[0]] for k in keys if k[0] in folds and k not in steer_ops and k not in from_rank0}
        gathered = {k: _rows_asked(tap, k, input_ids.shape[0]) for k in keys
                    if k[0] in SHARDED_DIMS and k not in folded}
        heads = {k: h for k in gathered if (h := _heads_asked(tap, k)) is not None} if self.tp.pp == 1 else {}
        layers = frozenset(layer for _, layer in keys)
        sent = copy.copy(meta)
        sent.attn = None  # a handle of this process's kernels: each rank attaches its own
        targets = getattr(tap, "targets", {}) or {}
        relayed = frozenset(k for k, (_, target) in targets.items() if target is not None)
        self.tp.send(Forward(input_ids, positions, sent, num_layers, steer_ops, gathered, layers, pattern_layers,
                             from_rank0, kernels=meta.attn is not None, relayed=relayed, seq=self.forwards,
                             folded=folded, heads=heads))
        shard_tap = ShardTap(inner, self.tp.layout, self.tp.group, gathered, layers, pattern_layers, from_rank0,
                             folded, heads)
        with self._joined("the forward"):
            if self.tp.pp == 1:
                hidden = self.shard(input_ids, positions, kv_caches, meta, shard_tap, num_layers=num_layers)
                rest: Callable[[], torch.Tensor | None] = lambda: hidden
            else:
                rest = start_rank0(self.shard, self.tp.ranks, self.tp.inboxes, self.tp.check_workers, self.tp.timeout_s,
                                   input_ids, positions, kv_caches, meta, shard_tap, num_layers, self.forwards)

        def finish() -> torch.Tensor | None:
            try:
                with self._joined("the forward"):
                    out = rest()
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001 - _joined broke the group: the engine's error, not a request's
                raise TensorParallelError(f"tensor parallel group broken: {self.tp.group.broken}") from exc
            shard_tap.raise_held()
            return out

        return finish

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` from the vocabulary-parallel head."""
        self.tp.send(Logits(hidden), first_stage=True)
        with self._joined("the LM head"):
            return self.shard.compute_logits(hidden)

    def lens_logits(self, point: str, x: torch.Tensor) -> torch.Tensor:
        """The logit lens through the vocabulary-parallel head."""
        self.tp.send(Lens(point, x), first_stage=True)
        with self._joined("the logit lens"):
            return self.shard.lens_logits(point, x)

    @contextmanager
    def _joined(self, what: str) -> Iterator[None]:
        """Rank 0's part of a call the workers joined: if it raises midway, the workers may be left in a
        collective, so the group is marked broken (later calls raise TensorParallelError)."""
        try:
            yield
        except TensorParallelError as exc:
            if self.tp.group.broken is None:  # found by rank 0 itself (a pipeline stage that failed)
                self.tp.group.broken = str(exc)
                self.tp.abort()
            raise
        except BaseException as exc:
            if self.tp.group.broken is None:
                self.tp.group.broken = f"rank 0 raised {type(exc).__name__} during {what}: {exc}"
                self.tp.abort()
            raise


def _rows_asked(tap: Any, key: tuple[str, int], num_rows: int) -> torch.Tensor | None:
    """The batch rows the step's tap steers or captures at ``key`` (sorted), or None for every row (or rows
    it cannot tell: an SAE edit's)."""
    ops, target = tap.targets[key]
    found = [op.rows for op in ops] if all(isinstance(op, PLAIN_OPS) for op in ops) else None
    if found is None:
        return None
    if target is not None:
        found.append(target[0].rows)
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for rows in found:
        mask[rows] = True
    if bool(mask.all()):
        return None
    return mask.nonzero().flatten()


def _heads_asked(tap: Any, key: tuple[str, int]) -> tuple[int, ...] | None:
    """The query heads the step's requests capture at a ``q`` or ``z`` key nobody steers, when every one of
    them keeps only some heads (sorted); None: all of them are gathered."""
    ops, target = tap.targets[key]
    if ops or target is None or key[0] not in QUERY_HEAD_POINTS:
        return None
    heads: set[int] = set()
    for entry, _, _ in target[0].entries:
        capture = entry.capture
        if capture.sel.heads is None or capture.features is not None or key[0] not in capture.sel.points:
            return None
        heads.update(capture.sel.heads)
    return tuple(sorted(heads))


def start_tensor_parallel(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device
                          ) -> tuple[TensorParallel, DriverModel, Backend]:
    """Start the ranks of ``engine_config.tensor_parallel_size`` with this process as rank 0: the group,
    rank 0's model as the runner sees it, and the backend every rank runs (:func:`shard_backend`)."""
    what = "tensor_parallel_size > 1 or pipeline_parallel_size > 1"
    if device.type != "cpu":
        raise ValueError(f"{what} runs on the CPU (gloo) only so far, not on {device.type}")
    if engine_config.backend == "cuda":
        raise ValueError(f"{what} runs the CPU backend (gloo) only so far, not backend='cuda'")
    size = engine_config.tensor_parallel_size
    backend = shard_backend(device, model_config.dtype, size, engine_config.enforce_eager, engine_config.backend)
    tp = TensorParallel(model_config, engine_config, backend)
    return tp, DriverModel(tp), backend
