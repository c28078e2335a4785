"""Per-step scheduling under one token budget (decodes and prefill chunks share a batch)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tapllm.config import EngineConfig
from tapllm.engine.block_manager import BlockManager
from tapllm.engine.request import Request, RequestStatus

logger = logging.getLogger("tapllm")


@dataclass(slots=True)
class ScheduledItem:
    """``num_tokens`` tokens of ``request`` starting at ``start`` run this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and what the scheduler had to give up to run it."""

    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)  # can never fit the cache


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix-cache hits and preemption.

    Running requests are served first (in arrival order), each taking as many tokens as
    it needs from the step's budget: one for a decode, up to the rest of the budget for a
    prompt. When the KV cache runs out, the most recently admitted running request is
    preempted: its blocks are freed and it is recomputed later from its tokens.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Pipeline stages with several steps in flight (engine/pipelined_step.py): a request whose token is
        # on the way is not scheduled, nor preempted, until its step is taken; and a step takes at most its
        # share of the requests, so that the steps in flight (as many as the stages) each have some.
        self.in_flight = 1

    @property
    def pipelined(self) -> bool:
        return self.in_flight > 1

    def add(self, req: Request) -> None:
        """Queue a new request."""
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        share = -(-(len(self.running) + len(self.waiting)) // self.in_flight)  # requests per step
        i = 0
        while i < len(self.running) and budget > 0 and len(out.items) < share:
            req = self.running[i]
            if req.num_pending and (self.pipelined or len(req.output_token_ids) + req.num_pending >= req.max_tokens):
                i += 1  # its token on the way is its last (the host is a step ahead), or in a pipeline's batch
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0 and self.pipelined:  # all its tokens are in a batch in flight (an encode's last chunk)
                i += 1
                continue
            room = True
            while room and not self.blocks.allocate(req, n):
                victim = self._victim(i)
                room = victim is not None  # None: every later request is in flight, this one waits for them
                if victim is not None:
                    self._preempt(victim)
                    out.preempted.append(victim)
                if victim is req:
                    break
            if not room or req.status is not RequestStatus.RUNNING:
                break
            out.items.append(ScheduledItem(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(out.items) < share
            # a prompt's samples waiting to fork from it (n > 1) will run too
            and len(self.running) + 1 + len(self.waiting[0].forks) <= self.config.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self.blocks.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            if cached:
                # Positions it still has to capture (states, prompt logprobs) are recomputed for it.
                cached = cached[: req.first_needed() // self.blocks.block_size]
            start = req.num_computed_tokens + len(cached) * self.blocks.block_size
            n = min(req.num_tokens - start, budget)
            if not self.blocks.allocate(req, n, cached):
                if not self.running and self.blocks.num_free_blocks == self.blocks.num_blocks:
                    # Even an empty cache cannot hold it: it has grown past the cache size.
                    self.waiting.popleft()
                    out.dropped.append(req)
                    continue
                break
            self.waiting.popleft()
            req.num_computed_tokens = start
            if req.num_preemptions == 0:
                req.num_cached_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.items.append(ScheduledItem(req, start, n))
            budget -= n
        return out

    def _victim(self, first: int) -> Request | None:
        """The running request to preempt: the latest admitted (not before index ``first``: those are
        scheduled), with pipeline stages the latest that has no token on the way (None: there is none)."""
        for j in range(len(self.running) - 1, first - 1, -1):
            if not (self.pipelined and self.running[j].num_pending):
                return self.running.pop(j)
        return None

    def _preempt(self, req: Request) -> None:
        self.blocks.free_request(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted request %s (%d tokens)", req.request_id, req.num_tokens)

    def finish(self, req: Request) -> None:
        """Release a finished request's blocks and forget it."""
        self.blocks.free_request(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
