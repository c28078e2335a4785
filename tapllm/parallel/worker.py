"""A non-zero rank: one process that holds its shard of the model and KV cache, and joins each
call rank 0 makes (see :mod:`tapllm.parallel.messages`).

:func:`serve_rank` is the rank's whole life, the same for both ways of starting it: a process
spawned by rank 0 (:func:`run_worker`, talking over a pipe) or a Ray actor
(:mod:`tapllm.parallel.ray_workers`, talking over a TCP connection back to rank 0). A spawned
process dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and a check of the parent while
idle), so a killed engine leaves no orphan; it exits when a collective fails, after telling rank 0
why over its connection. A Ray actor's loop ends when rank 0's connection closes; its actor is
then killed by rank 0, or by Ray with the job.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tapllm.backends import Backend
from tapllm.config import ModelConfig
from tapllm.parallel.backend import prepare_shard, shard_backend
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.messages import CopyBlocks, Forward, InitCache, Lens, Logits, Shutdown
from tapllm.parallel.ranks import Ranks, forward_stage, join
from tapllm.parallel.shard_tap import ShardTap, StepSteering
from tapllm.parallel.shard_load import ShardWeights, load_shard
from tapllm.parallel.sharding import Stage, layout_for, weight_bytes


@dataclass(slots=True)
class WorkerArgs:
    """What a worker process is started with."""

    rank: int  # among every stage's ranks: stage ``rank // size``, its rank ``rank % size`` there
    size: int  # ranks of each stage (tensor_parallel_size)
    port: int
    model_config: ModelConfig
    dummy_seed: int | None  # load_format="dummy": random weights from this seed
    timeout_s: float
    threads: int
    parent_pid: int | None  # a spawned process exits when this process is gone (None: no such check)
    enforce_eager: bool  # with ``backend``: the engine's choice of forward path (shard_backend)
    backend: str
    host: str = "127.0.0.1"  # where rank 0 serves the group's TCPStore
    stages: int = 1  # pipeline_parallel_size
    weights: ShardWeights = ShardWeights()  # quantization


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """The worker process's entry point (``multiprocessing`` spawn target)."""
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
    os._exit(serve_rank(args, conn))


def serve_rank(args: WorkerArgs, conn: Connection) -> int:
    """Build this rank's shard, join the group, then join rank 0's calls until it says to stop or goes
    away; returns 0, or 1 after sending rank 0 the traceback of whatever failed."""
    torch.set_num_threads(args.threads)
    try:
        conn.send(("hello", os.getpid()))
        store = dist.TCPStore(args.host, args.port, None, False, timeout=timedelta(seconds=args.timeout_s))
        ranks = join(store, args.model_config, args.rank, args.size, args.stages, args.timeout_s)
        group = ranks.group
        if args.parent_pid is not None:
            group.gone = lambda: "rank 0 exited" if os.getppid() != args.parent_pid else None
        layout = layout_for(args.model_config, args.rank % args.size, args.size, args.weights.quant)
        model = load_shard(args.model_config, layout, group, args.dummy_seed, ranks.stage, args.rank, args.weights)
        own = weight_bytes(model)  # before packing: the packed copies are not parameters
        backend = shard_backend(torch.device("cpu"), args.model_config.dtype, args.size, args.enforce_eager,
                                args.backend)
        prepare_shard(model, backend)
        conn.send(("ready", (own, backend.describe())))
        _serve(conn, args, model, layout, ranks, backend)
    except BaseException:  # noqa: BLE001 - whatever it was, rank 0 hears it before this rank exits
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        return 1
    return 0


def _serve(conn: Connection, args: WorkerArgs, model: torch.nn.Module, layout: ShardLayout, ranks: Ranks,
           backend: Backend) -> None:
    """Join rank 0's calls until it says to stop, closes the pipe, or dies."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    group = ranks.group
    while True:
        if not ranks.inbox and not conn.poll(1.0):
            if args.parent_pid is not None and os.getppid() != args.parent_pid:
                return
            continue
        try:
            msg = ranks.inbox.popleft() if ranks.inbox else pickle.loads(conn.recv_bytes())
        except (EOFError, ConnectionError):  # rank 0 closed the connection: the engine is gone
            return
        if isinstance(msg, Shutdown):
            return
        with torch.inference_mode():
            if isinstance(msg, Forward):
                if msg.kernels:
                    msg.meta.attn = backend.attention
                if ranks.stage is not None:
                    forward_stage(msg, model, kv, layout, ranks, conn)
                    continue
                tap = ShardTap(StepSteering(msg.steer_ops, msg.pattern_layers), layout, group, msg.gathered,
                               msg.layers, msg.pattern_layers, msg.from_rank0, msg.folded, msg.heads)
                model(msg.input_ids, msg.positions, kv, msg.meta, tap, num_layers=msg.num_layers)
            elif isinstance(msg, Logits):  # sent to stage 0's ranks only: the head is theirs
                model.compute_logits(msg.hidden)
            elif isinstance(msg, Lens):
                model.lens_logits(msg.point, msg.x)
            elif isinstance(msg, CopyBlocks):
                _copy_blocks(kv, msg.copies)
            elif isinstance(msg, InitCache):
                kv = kv_cache(args.model_config, layout, ranks.stage, msg.num_blocks, msg.block_size)
            else:
                raise TypeError(f"unknown message {type(msg).__name__}")


def kv_cache(cfg: ModelConfig, layout: ShardLayout, stage: Stage | None, num_blocks: int, block_size: int
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's KV cache: its KV heads of every block its stage holds (``[kv_heads, num_blocks + 1, block_size,
    head_dim]``, the last block the padding one), and an empty pair (no heads) for every other block."""
    out = []
    for i in range(cfg.num_layers):
        heads = layout.kv_heads if stage is None or stage.start <= i < stage.stop else 0
        shape = (heads, num_blocks + 1, block_size, layout.head_dim)
        out.append((torch.zeros(shape, dtype=cfg.dtype), torch.zeros(shape, dtype=cfg.dtype)))
    return out


def _copy_blocks(kv: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
    src = torch.tensor([a for a, _ in copies])
    dst = torch.tensor([b for _, b in copies])
    for k, v in kv:
        k.index_copy_(1, dst, k.index_select(1, src))
        v.index_copy_(1, dst, v.index_select(1, src))
