"""A step whose forward later pipeline stages finish while the engine starts the next one.

Under pipeline parallelism (:mod:`tapllm.parallel`), launching a step runs stage 0's blocks in this
process and hands the residual to the next stage; the rest (the later stages' blocks and taps, the
final norm, the logits, the sampling) is done when the step's tokens are taken. In between, the
engine schedules and launches the next step on requests that have no token on the way
(``Scheduler.pipelined``), so stage 0 works on one batch while the later stages work on the ones
before it: up to ``pipeline_parallel_size`` batches in flight, as vLLM's batch queue. Every stage
runs its steps in the order they were launched, so each request's KV and captures are what one
process writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tapllm.engine.launched_step import LaunchedStep, StepResult
from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure
from tapllm.engine.scheduler import ScheduledItem
from tapllm.parallel.group import TensorParallelError

logger = logging.getLogger("tapllm")


class PipelinedStep:
    """A launched step whose forward is finished when it is delivered or its tokens are taken (then it is a
    :class:`LaunchedStep`)."""

    graph_sampled = False
    pipelined = True

    def __init__(self, items: list[ScheduledItem], requests: list[Request], finish: Callable[[], LaunchedStep]) -> None:
        self.items = items
        self.requests = requests  # one per sampled row, known at launch (the scheduler skips them until taken)
        self._finish = finish
        self._step: LaunchedStep | _Failed | None = None

    def _done(self) -> LaunchedStep | _Failed:
        if self._step is None:
            try:
                with torch.inference_mode():  # as the launch was
                    self._step = self._finish()
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001 - the forward is done: the step's requests fail, not the engine
                logger.exception("a pipelined step of %d requests failed after its launch", len(self.items))
                failure = RowFailure(f"the step failed after its forward: {type(exc).__name__}: {exc}", "server_error")
                self._step = _Failed({it.request: failure for it in self.items})
        return self._step

    def deliver(self, stopped: set[Request] | frozenset = frozenset()) -> None:
        """Finish the forward, then hand the captured rows to their requests (except ``stopped``)."""
        self._done().deliver(stopped)

    def result(self) -> StepResult:
        """Finish the forward and the sampling; the step's tokens and the requests that failed alone."""
        return self._done().result()


class _Failed:
    def __init__(self, failed: dict[Request, RowFailure]) -> None:
        self._failed = failed

    def deliver(self, stopped: set[Request] | frozenset = frozenset()) -> None:
        return None

    def result(self) -> StepResult:
        return StepResult(failed=dict(self._failed))
