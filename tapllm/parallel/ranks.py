"""Where a rank sits among every rank of an engine: its stage, its tensor-parallel group, its link to
the other stages; and a step's forward as each rank runs it under pipeline parallelism.

Ranks are numbered stage by stage: rank ``r`` is rank ``r % tp`` of stage ``r // tp``'s tensor-parallel
group (``tp`` = ``tensor_parallel_size``), so rank 0, the engine's process, is stage 0's first rank.
Without pipeline parallelism there is one stage and no link, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tapllm.config import ModelConfig
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.messages import Forward
from tapllm.parallel.pipeline import StageLink, final_norm, run_stage
from tapllm.parallel.relay import RelayTap, StageInbox, serve_stage
from tapllm.parallel.shard_tap import ShardTap, StepSteering
from tapllm.parallel.sharding import Stage, stages_of


@dataclass(slots=True)
class Ranks:
    """One rank's place: ``rank`` among all, ``tp`` ranks a stage, the stage's blocks (None: one stage), its
    group, and the link between stages (None: one stage)."""

    rank: int
    tp: int
    stages: list[tuple[int, int]]
    group: TPGroup
    link: StageLink | None
    sends: list[Callable[[], None]] = field(default_factory=list)  # a worker's sends not yet waited for
    # Rank 0's messages that came while this rank waited for a reply (later steps' calls), in order.
    inbox: deque[Any] = field(default_factory=deque)

    @property
    def stage_index(self) -> int:
        return self.rank // self.tp

    @property
    def stage(self) -> Stage | None:
        if len(self.stages) == 1:
            return None
        start, stop = self.stages[self.stage_index]
        return Stage(start, stop, self.stage_index == 0)

    def holds(self, layer: int) -> bool:
        """Whether this rank's stage holds block ``layer``."""
        start, stop = self.stages[self.stage_index]
        return start <= layer < stop


def join(store: dist.Store, cfg: ModelConfig, rank: int, tp: int, pp: int, timeout_s: float) -> Ranks:
    """Join the groups of ``tp`` x ``pp`` ranks (collective: every rank calls it): this rank's stage's
    tensor-parallel group and, with ``pp`` > 1, the link between stages."""
    stages = stages_of(cfg, pp)
    if pp == 1:
        return Ranks(rank, tp, stages, TPGroup(store, rank, tp, timeout_s), None)
    group = TPGroup(dist.PrefixStore(f"stage{rank // tp}", store), rank % tp, tp, timeout_s)
    link = StageLink(store, rank, tp * pp, cfg.hidden_size, cfg.dtype)
    return Ranks(rank, tp, stages, group, link)


MAX_SENDS = 8  # a worker's sends in flight before it waits for the oldest


def _depth(msg_layers: int | None, num_layers: int) -> int:
    return num_layers if msg_layers is None else min(msg_layers, num_layers)


def forward_stage(msg: Forward, model: Any, kv: list[Any], layout: ShardLayout, ranks: Ranks,
                  conn: Connection) -> None:
    """A worker's part of one step under pipeline parallelism: its stage's blocks, from the residual the
    rank before it in the pipeline sends, on to the rank after it (or, from the stage that runs the step's
    last block, back to rank 0); a stage's first rank relays what the step's tap captures to rank 0."""
    s, tp = ranks.stage_index, ranks.tp
    start, stop = ranks.stages[s]
    depth = _depth(msg.num_layers, len(model.layers))
    if start >= depth:  # the step stops before this stage's blocks
        return
    stop = min(stop, depth)
    relay = s > 0 and ranks.rank % tp == 0
    inner = RelayTap(msg.steer_ops, msg.pattern_layers, conn, msg.relayed, msg.from_rank0, ranks.inbox) if relay else \
        StepSteering(msg.steer_ops, msg.pattern_layers)
    tap = ShardTap(inner, layout, ranks.group, msg.gathered, msg.layers, msg.pattern_layers, msg.from_rank0)
    x = None if s == 0 else ranks.link.recv(msg.input_ids.shape[0], ranks.rank - tp, msg.seq)
    y = run_stage(model, msg.input_ids, msg.positions, kv, msg.meta, tap, start, stop, x,
                  inner.progress if relay else None)
    tap.raise_held()
    last = stop == depth
    if not last:  # not waited for: this rank goes on with the next step while the next stage takes it
        ranks.sends.append(ranks.link.send(y, ranks.rank + tp, msg.seq, wait=False))
        while len(ranks.sends) > MAX_SENDS:
            ranks.sends.pop(0)()
    if relay:
        inner.done(y if last else None)


def start_rank0(model: Any, ranks: Ranks, inboxes: dict[int, StageInbox], alive: Callable[[], None], timeout_s: float,
                input_ids: torch.Tensor, positions: torch.Tensor, kv: list[Any], meta: Any, tap: ShardTap,
                num_layers: int | None, seq: int) -> Callable[[], torch.Tensor | None]:
    """Rank 0's part of step ``seq`` under pipeline parallelism: stage 0's blocks now, the residual sent on;
    returns what finishes the step (each later stage's taps, :func:`~tapllm.parallel.relay.serve_stage`, until
    the residual comes back, then the final norm on it), which may run after later steps started.
    ``inboxes``: what each later stage's first rank sends, by its rank; ``alive`` raises if a worker is gone;
    a later stage silent for ``timeout_s`` is taken for hung."""
    total = len(model.layers)
    depth = _depth(num_layers, total)
    tp = ranks.tp
    stop = min(ranks.stages[0][1], depth)
    x = run_stage(model, input_ids, positions, kv, meta, tap, 0, stop, None)
    if stop >= depth:
        return lambda: None if depth < total else final_norm(model, tap, x)
    sent = ranks.link.send(x, tp, seq, wait=False)  # waited for once stage 1 is done (a hung one is found there)

    def finish() -> torch.Tensor | None:
        y = x
        for s, (start, _) in enumerate(ranks.stages[1:], start=1):
            if start >= depth:
                break
            out = serve_stage(inboxes[s * tp], tap, alive, timeout_s)
            if s == 1:
                sent()
            if out is not None:
                y = out
        return None if depth < total else final_norm(model, tap, y)

    return finish
