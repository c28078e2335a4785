"""Pipeline parallelism: the blocks split into stages, the residual stream handed from stage to stage.

Stage ``s`` holds a contiguous run of blocks (:func:`~tapllm.parallel.layout.stage_layers`); stage 0,
whose first rank is the engine's process, also holds the embedding, the final norm and the LM head:
the sampler and the step's tap live with rank 0, so the residual comes back there anyway. The
other stages hold neither embedding nor head. Each stage is a tensor-parallel group of its own
(``tensor_parallel_size`` ranks, all holding the stage's blocks split by heads and neurons); rank
``t`` of stage ``s`` sends the whole residual stream (whole on every rank of a stage after its
all-reduces) to rank ``t`` of stage ``s + 1`` (:class:`StageLink`, gloo point-to-point), and the
stage that runs the step's last block returns it to rank 0, which applies the final norm.

A step runs its stages one after the other; how taps in another stage's blocks reach rank 0's tap
is :mod:`tapllm.parallel.relay`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tapllm.models.base import CausalLM
from tapllm.models.residual import Residual, add_norm
from tapllm.parallel.group import TensorParallelError
from tapllm.tap import PSEUDO_LAYER, Tap

# The residual's wait for the stage before can last as long as that stage's blocks run; a dead or
# hung rank is found by rank 0 (which asks whether each worker is alive while it waits), which then
# stops them all, so the workers' own wait only has to end eventually.
LINK_TIMEOUT_S = 600.0


class Absent(nn.Module):
    """What another stage holds (a block, the embedding, the LM head): no parameters, never called."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.what} is held by another pipeline stage")


def keep_stage(model: CausalLM, start: int, stop: int, first: bool) -> None:
    """Drop from ``model`` what its stage does not hold: blocks outside ``[start, stop)``, and the
    embedding and LM head unless it is the ``first`` stage. Built weights are uninitialised, so the
    dropped modules' storage was never touched and goes back at once."""
    for i in range(len(model.layers)):
        if not start <= i < stop:
            model.layers[i] = Absent(f"block {i}")
    if not first:
        model.embed_tokens = Absent("the embedding")
        model.lm_head = Absent("the LM head")


def run_stage(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any], meta: Any,
              tap: Tap, start: int, stop: int, x: torch.Tensor | None,
              progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Blocks ``[start, stop)`` of one step, from the embedding when ``start`` is 0 (``x`` None), else from
    the residual ``x`` the stage before sent; returns the whole residual after block ``stop - 1``, its
    pending points tapped (as the next block would on one device). ``progress(i)`` after each block ``i``."""
    if start == 0:
        x = model.embed(input_ids, positions)
        res = Residual(x, on_sum=(("embed", PSEUDO_LAYER),)) if model.fused_blocks else \
            Residual(tap("embed", PSEUDO_LAYER, x))
    else:
        assert x is not None
        res = Residual(x)
    ctx = model.block_context(positions, x.dtype, meta)
    for i in range(start, stop):
        block = model.layers[i]
        if model.fused_blocks:
            res = block(res, i, tap, ctx, kv_caches[i], meta)
        else:
            res = Residual(block(res.whole(tap), i, tap, ctx, kv_caches[i], meta))
        if progress is not None:
            progress(i)
    path = "fused" if model.backend is not None and model.backend.fused else "eager"
    model.last_runs = ((start, stop, path),)
    return res.whole(tap)


def final_norm(model: CausalLM, tap: Tap, x: torch.Tensor) -> torch.Tensor:
    """The final norm over the whole residual after the last block, ``final`` tapped (rank 0)."""
    if model.fused_blocks:
        return add_norm(model.norm, tap, Residual(x), out=(("final", PSEUDO_LAYER),))[1]
    return tap("final", PSEUDO_LAYER, model.norm(x))


def _tag(seq: int) -> int:
    return seq % (1 << 30)


class StageLink:
    """The residual stream's sends between stages: point-to-point over a gloo group of every rank.
    Constructing it is collective (every rank of every stage)."""

    def __init__(self, store: dist.Store, rank: int, world: int, hidden: int, dtype: torch.dtype) -> None:
        self.rank = rank
        self.hidden, self.dtype = hidden, dtype
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("pipeline", store), rank, world,
                                        timedelta(seconds=LINK_TIMEOUT_S))
        self.bytes_moved = 0

    def send(self, x: torch.Tensor, dst: int, seq: int, wait: bool = True) -> Callable[[], None]:
        """Send the residual ``x`` ``[rows, hidden]`` of step ``seq`` to rank ``dst``; returns what waits for
        the send to end (already waited for, unless ``wait`` is False)."""
        x = x.to(self.dtype).contiguous()
        self.bytes_moved += x.numel() * x.element_size()
        work = self.pg.send([x], dst, _tag(seq))

        def done() -> None:
            self._wait(work, f"sending the residual to rank {dst}")
            del x_alive[:]

        x_alive = [x]  # the buffer stays alive until the send ends
        if wait:
            done()
        return done

    def recv(self, rows: int, src: int, seq: int) -> torch.Tensor:
        """The residual ``[rows, hidden]`` of step ``seq`` that rank ``src`` sends."""
        x = torch.empty(rows, self.hidden, dtype=self.dtype)
        self._wait(self.pg.recv([x], src, _tag(seq)), f"receiving the residual from rank {src}")
        return x

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError and its own kinds
            raise TensorParallelError(f"pipeline rank {self.rank} failed {what}: {type(exc).__name__}: {exc}") \
                from exc
