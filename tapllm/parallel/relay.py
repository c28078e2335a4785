"""Taps in another pipeline stage's blocks: the point goes to rank 0, where the step's tap is.

The engine's tap (its capture plan, SAE encoders, pattern requests, the steering that only rank 0
holds) lives in rank 0's process. A stage other than rank 0's runs the step's plain steering
operations itself, as every tensor-parallel rank does (:class:`~tapllm.parallel.shard_tap.StepSteering`);
where the step captures a point of one of its blocks, the stage's first rank sends the point (whole:
a sharded point was gathered within the stage first, :class:`~tapllm.parallel.shard_tap.ShardTap`)
to rank 0 over its connection, before steering it, and rank 0 runs the step's tap on it: the same
operations, then the same capture, as one device. A point that only rank 0 can steer (an SAE edit)
goes the same way and waits for rank 0's result, which the stage's ranks then share. Attention
patterns go as the gathered queries and key cache. Rank 0 serves these messages stage by stage
(:func:`serve_stage`, from a :class:`StageInbox`) until the stage says it is done; the last stage's
message carries the residual.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tapllm.parallel.group import TensorParallelError
from tapllm.parallel.messages import dumps
from tapllm.parallel.shard_tap import ShardTap, StepSteering

POLL_S = 0.25  # how often rank 0, waiting for a stage, asks whether every worker still runs


@dataclass(slots=True)
class Reply:
    """Rank 0's result for a point only it steers (an SAE edit), sent back to the stage that asked."""

    x: torch.Tensor


class RelayTap(StepSteering):
    """The tap of a stage's first rank (stages after rank 0's): plain steering here, capture at rank 0."""

    def __init__(self, ops: Mapping[tuple[str, int], list[Any]], pattern_layers: Iterable[int], conn: Connection,
                 relayed: Iterable[tuple[str, int]], from_rank0: Iterable[tuple[str, int]], inbox: deque[Any]) -> None:
        super().__init__(ops, pattern_layers)
        self.conn = conn
        self.inbox = inbox  # rank 0's calls of later steps that come before a reply: the worker's loop takes them
        self.relayed = frozenset(relayed)
        self.from_rank0 = frozenset(from_rank0)

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        key = (point, layer)
        if key in self.from_rank0:
            self.conn.send_bytes(dumps(("tap", point, layer, x, True)))
            while True:
                msg = pickle.loads(self.conn.recv_bytes())
                if isinstance(msg, Reply):
                    return x.copy_(msg.x)
                self.inbox.append(msg)
        if key in self.relayed:
            self.conn.send_bytes(dumps(("tap", point, layer, x, False)))
        return super().__call__(point, layer, x)

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: Any) -> None:
        self.conn.send_bytes(dumps(("pattern", layer, q, k_cache, opts)))

    def progress(self, layer: int) -> None:
        """Tell rank 0 block ``layer`` is done (rank 0 takes a stage that says nothing for long for hung)."""
        self.conn.send_bytes(dumps(("block", layer)))

    def done(self, x: torch.Tensor | None) -> None:
        """Tell rank 0 this stage's blocks are run; ``x``: the residual, from the stage that ran the last."""
        self.conn.send_bytes(dumps(("done", x)))


class StageInbox:
    """What a later stage's first rank sends rank 0, read as it comes by a thread of rank 0's, so that rank
    never waits for rank 0 to read while rank 0 works on a later step (each side would wait for the other
    where both pipes filled up); :func:`serve_stage` takes the messages in order."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self.messages: queue.Queue[Any] = queue.Queue()
        self.error: str | None = None  # the traceback the rank sent before it exited
        self.thread = threading.Thread(target=self._read, name=f"tapllm-stage-inbox-{rank}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                self.messages.put(None)  # closed: the rank exited, or the engine closed the connection
                return
            if isinstance(msg, tuple) and msg and msg[0] == "error":
                self.error = msg[1]
            self.messages.put(msg)


def serve_stage(inbox: StageInbox, tap: ShardTap, alive: Callable[[], None], timeout_s: float
                ) -> torch.Tensor | None:
    """Rank 0's side of one stage's step: run the step's tap on each point the stage's first rank (``rank``)
    sends, answering those it waits for, until it is done; returns the residual it ended with (or None).

    ``alive`` raises when a worker is gone (then the stage would never be done); a stage that sends nothing
    (it says when each block is done) for ``timeout_s`` is taken for hung. Errors of the step's tap are held by
    ``tap`` (raised after the forward, as under tensor parallelism)."""
    rank, conn = inbox.rank, inbox.conn
    while True:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = inbox.messages.get(timeout=POLL_S)
                break
            except queue.Empty:
                alive()
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"pipeline rank {rank} sent nothing for {timeout_s:g} s (timeout: a "
                                              "hung rank?)") from None
        if msg is None:
            alive()
            raise TensorParallelError(f"pipeline rank {rank} closed its connection mid-step")
        kind = msg[0]
        if kind == "tap":
            _, point, layer, x, reply = msg
            y = tap.run_inner(point, layer, x)
            if reply:
                conn.send_bytes(dumps(Reply(y)))
        elif kind == "block":
            pass
        elif kind == "pattern":
            _, layer, q, k_cache, opts = msg
            tap.inner_pattern(layer, q, k_cache, opts)
        elif kind == "done":
            return msg[1]
        elif kind == "error":
            raise TensorParallelError(f"pipeline rank {rank} raised {msg[1].strip().splitlines()[-1]}:\n{msg[1]}")
        else:
            raise RuntimeError(f"pipeline rank {rank} sent an unknown message {kind!r}")
