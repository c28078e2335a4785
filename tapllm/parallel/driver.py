"""Rank 0 of a tensor-parallel engine: starts the other ranks and drives them.

Rank 0 lives in the engine's process and holds its own shard; ranks 1..N-1 are processes started
with ``multiprocessing``'s spawn (:mod:`tapllm.parallel.worker`), or Ray actors running the same
loop (``distributed_executor_backend="ray"``, :mod:`tapllm.parallel.ray_workers`). The engine's
scheduler, block manager and sampler run on rank 0 alone; each call of the model that needs the
other ranks (a step's forward, the LM head, the logit lens, block copies) is first announced to them
with its inputs (:mod:`tapllm.parallel.messages`), then every rank runs it, meeting in the
collectives; results stay on rank 0. :class:`~tapllm.parallel.driver_model.DriverModel` is what the
model runner sees as its model.

Failure is one error: a worker that raises tells rank 0 why and exits; one that dies or hangs makes
rank 0's next collective fail or time out; either way the engine raises
:class:`~tapllm.parallel.group.TensorParallelError` naming the rank, and the remaining workers
are stopped, never left behind.
"""

from __future__ import annotations

import os
import pickle
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapllm.backends import Backend
from tapllm.config import EngineConfig, ModelConfig
from tapllm.loader.gguf_blocks import gguf_source
from tapllm.models.base import CausalLM
from tapllm.parallel.backend import prepare_shard
from tapllm.parallel.group import TensorParallelError, collective_timeout_s
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.messages import CopyBlocks, InitCache, Shutdown, dumps
from tapllm.parallel.ranks import join
from tapllm.parallel.relay import StageInbox
from tapllm.parallel.shard_load import ShardWeights, load_shard
from tapllm.parallel.sharding import kv_bytes_per_token, layout_for, stages_of, weight_bytes
from tapllm.parallel.worker import WorkerArgs, run_worker


START_TIMEOUT_S = 120.0  # a worker that has not said hello by then is taken for dead


def _stop(procs: list[Any], conns: list[Any], releases: list[Callable[[], None]], grace_s: float = 5.0) -> None:
    """Ask the workers to exit, wait up to ``grace_s`` for them, then make sure they have (terminate, kill);
    then free what started them (``releases``: a Ray backend's actors and placement group)."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(Shutdown()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()
    for release in releases:
        release()


def _ended(proc: Any) -> str:
    """How a worker that no longer runs ended, for an error message (a Ray rank tells it itself)."""
    if hasattr(proc, "ended"):
        return proc.ended()
    return f"(pid {proc.pid}) exited with code {proc.exitcode}"


class TensorParallel:
    """The ranks of one engine: rank 0's shard and group, the workers (processes or Ray actors), their connections."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, backend: Backend,
                 timeout_s: float | None = None) -> None:
        timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
        self.timeout_s = timeout_s
        size = engine_config.tensor_parallel_size
        self.size = size  # ranks of a stage
        self.pp = pp = engine_config.pipeline_parallel_size
        self.world = world = size * pp
        self.in_flight = engine_config.batches_in_flight()  # batches (engine/pipelined_step.py)
        quant = engine_config.quant()
        gguf = gguf_source(engine_config.model) if quant is not None and quant.method == "gguf" else None
        self.weights = ShardWeights(quant, engine_config.quantize_embedding, gguf)
        self.layout: ShardLayout = layout_for(model_config, 0, size, quant)  # checks the model can be split first
        self.stages = stages_of(model_config, pp)  # and that its blocks can
        self.mcfg = model_config
        self.executor = engine_config.distributed_executor_backend  # "mp" or "ray"
        # each rank's, every block it holds (ranks of an uneven split hold different numbers of KV heads)
        self.kv_bytes_per_token = [
            kv_bytes_per_token(model_config, layout_for(model_config, r % size, size, quant))
            * (self.stages[r // size][1] - self.stages[r // size][0]) // model_config.num_layers
            for r in range(world)]
        dummy = engine_config.seed if engine_config.load_format == "dummy" else None
        # The CPUs this process may run on (a pinned engine core's share), over the ranks; spawned workers
        # inherit the same affinity.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cpus // world)
        if torch.get_num_threads() > threads:  # rank 0 shares the CPUs with the workers like any rank
            torch.set_num_threads(threads)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._releases: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._releases)
        try:
            host, ray_workers = "127.0.0.1", None
            self.ray_workers: Any = None  # the actors and placement group of the ray backend
            if self.executor == "ray":
                from tapllm.parallel.ray_workers import RayWorkers

                self.ray_workers = ray_workers = RayWorkers(world - 1)
                self._releases.append(ray_workers.release)
                host = ray_workers.host
            # The rendezvous of the group: rank 0 serves it on a free port; it lives as long as the group.
            self.store = store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_s),
                                               wait_for_workers=False)
            parent_pid = os.getpid() if ray_workers is None else None
            args = [WorkerArgs(rank, size, store.port, model_config, dummy, timeout_s, threads, parent_pid,
                               engine_config.enforce_eager, engine_config.backend, host, pp, self.weights)
                    for rank in range(1, world)]
            if ray_workers is not None:
                procs, conns = ray_workers.start(args, START_TIMEOUT_S)
                self.procs.extend(procs)
                self.conns.extend(conns)
            else:
                self._spawn(args)
            self._wait_for("hello", START_TIMEOUT_S)
            self.ranks = join(store, model_config, 0, size, pp, timeout_s)
            self.group = self.ranks.group
            self.group.explain = self._explain
            self.group.gone = self._gone
            self.model: CausalLM = load_shard(model_config, self.layout, self.group, dummy, self.ranks.stage, 0,
                                              self.weights)
            own = weight_bytes(self.model)  # before packing: the packed copies are not parameters
            prepare_shard(self.model, backend)
            ready = self._wait_for("ready", None)
            for rank, (_, path) in enumerate(ready, start=1):
                if path != backend.describe():
                    raise TensorParallelError(f"tensor parallel rank {rank} chose another forward path than rank 0:\n"
                                              f"{path}\nrank 0:\n{backend.describe()}")
            self.weight_bytes = [own, *(b for b, _ in ready)]
            # what each later pipeline stage's first rank sends rank 0, read as it comes
            self.inboxes = {r: StageInbox(self.conns[r - 1], r) for r in range(size, world, size)}
        except BaseException:
            self.close()
            raise

    def _spawn(self, args: list[WorkerArgs]) -> None:
        ctx = mp.get_context("spawn")
        for a in args:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(a, child), name=f"tapllm-tp-rank{a.rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    # ---- talking to the workers ------------------------------------------------------------
    def _wait_for(self, kind: str, timeout_s: float | None) -> list[Any]:
        """Each worker's next message, which must be ``kind``; raises if one fails or dies first."""
        out = []
        start = time.monotonic()
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                if conn.poll(0.2):
                    try:
                        what, value = conn.recv()
                    except EOFError:
                        what, value = "error", f"exited with code {proc.exitcode}"
                    if what == "error":
                        raise TensorParallelError(f"tensor parallel rank {rank} failed while starting:\n{value}")
                    out.append(value)
                    break
                if not proc.is_alive():
                    raise TensorParallelError(f"tensor parallel rank {rank} {_ended(proc)} while starting")
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TensorParallelError(f"tensor parallel rank {rank} did not start within {timeout_s:.0f} s")
        return out

    def send(self, msg: object, first_stage: bool = False) -> None:
        """Announce a call to every worker (before rank 0 makes it); ``first_stage``: to stage 0's only (the
        LM head's calls)."""
        if self.group.broken is not None:
            raise TensorParallelError(f"tensor parallel group broken earlier: {self.group.broken}")
        data = dumps(msg)
        for conn in self.conns[: self.size - 1] if first_stage else self.conns:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError) as exc:
                self.group.broken = self._explain(exc)
                raise TensorParallelError(f"tensor parallel group broken: {self.group.broken}") from exc

    def _explain(self, exc: BaseException) -> str:
        """Why a collective or a send failed: which workers died or raised (then all are stopped)."""
        time.sleep(0.2)  # a worker that raised is writing its traceback and exiting
        reasons = self._reasons()
        deadline = time.monotonic() + 2.0
        while not reasons and time.monotonic() < deadline:  # a Ray actor's death reaches rank 0 a little later
            time.sleep(0.2)
            reasons = self._reasons()
        self.abort()
        found = "; ".join(reasons) if reasons else (
            f"a call failed or waited past the {self.timeout_s:g} s timeout while every worker was alive "
            f"(a hung rank?): {type(exc).__name__}: {exc}")
        return f"{found}; the engine cannot continue and its workers were stopped"

    def _reasons(self) -> list[str]:
        """The workers that raised (their error's last line) or are gone (how they ended)."""
        reasons = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            error = None
            inbox = getattr(self, "inboxes", {}).get(rank)
            try:
                while inbox is None and conn.poll(0):
                    what, value = conn.recv()
                    if what == "error":
                        error = value.strip().splitlines()[-1]
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
            if inbox is not None and inbox.error is not None:
                error = inbox.error.strip().splitlines()[-1]
            if error is not None:
                reasons.append(f"rank {rank} raised {error}")
            elif not proc.is_alive():
                reasons.append(f"rank {rank} {_ended(proc)}")
        return reasons

    def _gone(self) -> str | None:
        """Why a worker cannot join a collective any more (it exited), or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return f"rank {rank} {_ended(proc)}"
        return None

    def close(self) -> None:
        """Stop the workers (idempotent; also run when this object is collected and at exit)."""
        self._finalizer()

    def abort(self) -> None:
        """Stop the workers of a broken group: no worker has anything left to finish, so little grace."""
        if self._finalizer.alive:
            _stop(self.procs, self.conns, self._releases, grace_s=0.5)
        self.close()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    @property
    def worker_pids(self) -> list[int | None]:
        """The process ids of ranks 1..N-1, in rank order (a Ray rank's is on its node)."""
        return [p.pid for p in self.procs]

    def check_workers(self) -> None:
        """Raise :class:`TensorParallelError` if the group is broken or a worker has exited (then the others
        are stopped): what an idle engine checks, as a step would find it."""
        if self.group.broken is not None:
            raise TensorParallelError(f"tensor parallel group broken earlier: {self.group.broken}")
        dead = [f"rank {rank} {_ended(p)}" for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead:
            self.group.broken = f"{'; '.join(dead)}; the engine cannot continue and its workers were stopped"
            self.abort()
            raise TensorParallelError(f"tensor parallel group broken: {self.group.broken}")

    # ---- calls every rank joins ------------------------------------------------------------
    def init_cache(self, num_blocks: int, block_size: int) -> None:
        self.send(InitCache(num_blocks, block_size))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.send(CopyBlocks(copies))

    def kv_heads(self, layer: int) -> int:
        """Rank 0's KV heads of block ``layer`` (none where another pipeline stage holds it)."""
        return self.layout.kv_heads if self.ranks.holds(layer) else 0

    def kv_bytes(self, num_blocks: int, block_size: int) -> list[int]:
        """Bytes of each rank's KV cache of ``num_blocks`` blocks (the padding block counts as one), in rank order."""
        return [num_blocks * block_size * b for b in self.kv_bytes_per_token]

    def describe(self) -> str:
        """What each rank holds and what a step costs in collectives."""
        lay = self.layout
        per_rank = ", ".join(f"{b / 1e6:.1f} MB" for b in self.weight_bytes)
        workers = "one process each" if self.executor == "mp" else "ranks 1.. as Ray actors"
        text = (f"tensor parallel: {self.size} ranks ({workers}), collectives through {self.group.transport}; "
                f"per rank {lay.parts_text()}; weights per rank: {per_rank}; a step runs 2 all-reduces per "
                f"block, one for the embedding, one all-gather for the logits, and one all-gather per tapped head "
                f"or neuron point")
        if self.pp == 1:
            return text
        blocks = ", ".join(f"{a}-{b - 1}" for a, b in self.stages)
        return (f"pipeline parallel: {self.pp} stages of {self.size} rank(s) each (ranks {self.size} x stage + "
                f"rank in stage), blocks {blocks}; stage 0 holds the embedding, final norm and LM head; the residual "
                f"goes from stage to stage and back to rank 0 ({self.in_flight} batch(es) in flight); {text}")
