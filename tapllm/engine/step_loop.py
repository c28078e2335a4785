"""The engine's step: schedule, launch, take the tokens; with the host a step ahead of the device when asked.

Synchronous (the default off a GPU): a step is scheduled, run to its end, and its tokens taken
before the next is scheduled.

A step ahead (``EngineConfig.async_scheduling``, as vLLM's async scheduling and SGLang's overlap
scheduler): while step N runs on the device, the host schedules and launches step N+1 as if every
running request's token from N were known. That token counts as *pending* (``Request.num_pending``);
N+1's row of the request reads it on the device (the slot's last sampled token). Then the host takes
N's tokens and applies stops, and only then hands N+1's captured rows to the requests that did not
stop. A request that stopped at N ran one row too many in N+1: its token there is never taken, its
captured rows there are dropped, and its blocks, freed when it stopped, are written by that row
before any later step can use them (the device runs steps in order). ``max_tokens`` is known in
advance: a request whose pending token is its last is not scheduled again.

The host waits for N before scheduling N+1 when N+1 needs N's tokens on the host: N was sampled by
the sampling plan (logprobs, logits controls or grammars: the device's last-token table is not
written then), a running request uses a grammar or logits controls (their masks read its tokens),
or N forks a prompt's samples (they start from the prompt's state at N).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol

from tapllm.engine.launched_step import LaunchedStep, StepResult
from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure
from tapllm.engine.scheduler import ScheduledItem, Scheduler
from tapllm.parallel.group import TensorParallelError

logger = logging.getLogger("tapllm")


class Engine(Protocol):
    """What the step loop uses of ``LLMEngine``."""

    scheduler: Scheduler
    runner: Any
    blocks: Any
    output_processor: Any
    num_generated_tokens: int
    last_step_tokens: int

    def _fail(self, req: Request, message: str, error_type: str) -> None: ...

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None: ...

    def _fork(self, sample: Request) -> None: ...


class StepLoop:
    """Runs the engine's steps (see the module docstring)."""

    def __init__(self, engine: Engine, ahead: bool, depth: int = 1) -> None:
        self.engine = engine
        self.ahead = ahead
        self.inflight: LaunchedStep | None = None
        self._early: list[Request] = []  # finished by taking the in-flight step early (a failing launch)
        # Pipeline stages: up to ``depth`` steps in flight, on disjoint requests (engine/pipelined_step.py).
        self.depth = depth
        self.queue: deque[Any] = deque()

    def busy(self) -> bool:
        """True while a launched step's tokens have not been taken."""
        return self.inflight is not None or bool(self.queue)

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it (see ``LLMEngine.step``)."""
        if self.depth > 1:
            return self._step_pipelined()
        e = self.engine
        finished: list[Request] = []
        self._early: list[Request] = []
        if self.inflight is not None and self._must_wait():
            finished += self._take(self.inflight)
            self.inflight = None
        launched = self._schedule_and_launch(finished)
        if self.inflight is not None:
            finished += self._take(self.inflight)
            self.inflight = None
        if launched is not None:
            launched.deliver({r for r in finished})
            if self.ahead and launched.graph_sampled:
                self.inflight = launched
            else:
                finished += self._take(launched)
        return finished

    def _step_pipelined(self) -> list[Request]:
        """One step with pipeline stages: launch a batch of the requests with no token on the way, then take
        the oldest batch in flight once ``depth`` are (or when nothing could be launched)."""
        finished: list[Request] = []
        self._early = []
        running = self.engine.scheduler.running
        # Grammar masks and logits controls are computed one step at a time: such batches run alone.
        alone = any(r.grammar is not None or r.controls is not None for r in running)
        if alone:
            finished += self._drain()
        launched = self._schedule_and_launch(finished)
        if launched is not None and (alone or not getattr(launched, "pipelined", False)):
            finished += self._drain()
            finished += self._take(launched)
        elif launched is not None:
            self.queue.append(launched)
        while len(self.queue) >= self.depth:
            finished += self._take(self.queue.popleft())
        if launched is None and self.queue:  # nothing could run: the requests of the oldest batch are needed
            finished += self._take(self.queue.popleft())
        return finished

    def _drain(self) -> list[Request]:
        """Take every pipelined step in flight, oldest first."""
        finished: list[Request] = []
        while self.queue:
            finished += self._take(self.queue.popleft())
        return finished

    def _schedule_and_launch(self, finished: list[Request]) -> Any:
        """Schedule a batch and launch it (None: nothing to run); requests that end before it go to ``finished``."""
        e = self.engine
        sched = e.scheduler.schedule()
        for req in sched.preempted:  # its slot goes back: it takes one anew when it runs again
            e.runner.release(req)
        e.runner.copy_blocks(e.blocks.take_copies())  # copy-on-write of blocks shared by samples
        for req in sched.dropped:  # unreachable while max_model_len fits the cache; kept as a guard
            e._fail(req, f"the request needs {req.num_tokens} tokens of KV cache, more than the cache "
                    f"holds ({e.blocks.num_blocks * e.blocks.block_size})", "invalid_request_error")
            finished.append(req)
        e.last_step_tokens = sum(it.num_tokens for it in sched.items)
        now = time.monotonic()
        for it in sched.items:
            if it.request.times.scheduled is None:
                it.request.times.scheduled = now
        launched = self._launch(sched.items) if sched.items else None
        finished += self._early
        return launched

    def _must_wait(self) -> bool:
        """Whether the next step needs the in-flight step's tokens on the host (module docstring)."""
        step = self.inflight
        if not step.graph_sampled:
            return True
        if any(req.parent is not None and req in req.parent.forks for req in step.requests):
            return True
        return any(r.grammar is not None or r.controls is not None for r in self.engine.scheduler.running)

    def _launch(self, items: list[ScheduledItem]) -> LaunchedStep | None:
        """Queue ``items`` (a failing batch is run synchronously in halves, to isolate the request at fault)."""
        e = self.engine
        try:
            launched = e.runner.launch(items)
        except TensorParallelError:  # the engine's, not a request's: nothing to isolate
            raise
        except Exception:  # noqa: BLE001 - isolated below, each half run to its end
            if self.inflight is not None:  # the halves must see every earlier token
                self._early = self._take(self.inflight)
                self.inflight = None
            self._early += self._drain()
            result = self._isolated(items)
            launched = _Done(items, result)
        for it in items:
            it.request.num_computed_tokens += it.num_tokens
        for req in launched.requests:
            if not (req.parent is not None and req in req.parent.forks):  # a sample not forked yet is not running
                req.num_pending += 1
        return launched

    def _isolated(self, items: list[ScheduledItem]) -> StepResult:
        """Run ``items``; if the batch raises, rerun halves until the failing request is alone.

        Nothing a step commits (KV slots are rewritten with the same values, capture and
        sampling happen after the forward) is done twice, so the other requests' tokens and
        states equal those of an undisturbed step.
        """
        e = self.engine
        try:
            return e.runner.execute(items)
        except TensorParallelError:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(items) == 1:
                logger.exception("request %s failed in the forward pass", items[0].request.request_id)
                return StepResult(failed={items[0].request: RowFailure(
                    f"the forward pass failed for this request: {type(exc).__name__}: {exc}", "server_error")})
            logger.warning("a step of %d requests failed (%s: %s); rerunning it in halves to isolate the cause",
                           len(items), type(exc).__name__, exc)
        mid = len(items) // 2
        first, second = self._isolated(items[:mid]), self._isolated(items[mid:])
        first.sampled.update(second.sampled)
        first.failed.update(second.failed)
        return first

    def _take(self, step: LaunchedStep) -> list[Request]:
        """Take a launched step's tokens: failures, encode-only ends, forks, tokens and stops."""
        e = self.engine
        finished: list[Request] = []
        result = step.result()
        for req in step.requests:
            if req.num_pending:
                req.num_pending -= 1
        for req, failure in result.failed.items():
            if not req.finished:
                e._fail(req, failure.message, failure.error_type)
                finished.append(req)
        for it in step.items:
            req = it.request
            if req.finished:
                continue
            e.blocks.cache_full_blocks(req)
            if req.encode_only and it.samples:
                e._finish(req, "length", None)
                finished.append(req)
        for req in result.sampled:
            if req.parent is not None and req in req.parent.forks:
                e._fork(req)
        now = time.monotonic()
        for req, token in result.sampled.items():
            if req.finished:
                continue
            req.times.on_token(now)
            e.num_generated_tokens += 1
            end = e.output_processor.append_token(req, token)
            if end is None:
                continue
            if end.error_type is not None:
                e._fail(req, end.message or "", end.error_type)
            else:
                e._finish(req, end.reason, end.stop_reason)
            finished.append(req)
        return finished


class _Done:
    """A step already run to its end (the isolated halves after a failing launch)."""

    graph_sampled = False

    def __init__(self, items: list[ScheduledItem], result: StepResult) -> None:
        self.items = items
        self.requests = list(result.sampled) + [r for r in result.failed if r not in result.sampled]
        self._result = result

    def deliver(self, stopped: set[Request]) -> None:
        return None

    def result(self) -> StepResult:
        return self._result
