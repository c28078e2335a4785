"""A step whose work is queued on the device; its results are taken in two phases.

:meth:`ModelRunner.launch <tapllm.engine.model_runner.ModelRunner.launch>` lays a step out, uploads
it, queues the forward and the sampling, and starts copying the sampled tokens to the host. Then:

1. :meth:`LaunchedStep.deliver` hands the capturing requests their rows. It must run before the
   next step is launched (a graph step's capture buffer is overwritten by the next replay) and,
   with the host a step ahead, after the previous step's tokens were taken, so that a request
   that stopped there is known (its rows of this step are past its end and are dropped);
2. :meth:`LaunchedStep.result` waits for the tokens and reads them, with the failures of the
   rows that failed alone.

Run back to back they are one synchronous step (:meth:`ModelRunner.execute`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tapllm.engine.request import Request
from tapllm.engine.sampler import RowFailure
from tapllm.engine.scheduler import ScheduledItem
from tapllm.engine.staging import PendingDownload
from tapllm.hidden_states.capture import RequestCapture


@dataclass(slots=True)
class StepResult:
    """What a step produced: a token per sampling request, and requests that failed alone."""

    sampled: dict[Request, int] = field(default_factory=dict)
    failed: dict[Request, RowFailure] = field(default_factory=dict)


Deliver = Callable[[set[Request]], dict[RequestCapture, str]]  # captures' delivery (skipping stopped requests)
Read = Callable[[np.ndarray, dict[int, RowFailure]], list[int]]  # downloaded codes -> tokens (and failures)


class LaunchedStep:
    """A queued step (see the module docstring)."""

    def __init__(self, items: list[ScheduledItem], requests: list[Request], *, deliver: Deliver | None,
                 tokens: PendingDownload | None, read: Read | None, failed: dict[Request, RowFailure],
                 row_failures: dict[int, RowFailure], graph_sampled: bool) -> None:
        self.items = items
        self.requests = requests  # one per sampled row
        self.graph_sampled = graph_sampled  # the tokens also went to the device's last-token table
        self._deliver = deliver
        self._tokens = tokens
        self._read = read
        self._failed = failed
        self._row_failures = row_failures
        self.delivered = deliver is None

    def deliver(self, stopped: set[Request] | frozenset = frozenset()) -> None:
        """Hand the step's captured rows to their requests, except those in ``stopped``."""
        if self.delivered:
            return
        self.delivered = True
        failed = self._deliver(set(stopped))
        if failed:
            owner = {it.request.capture: it.request for it in self.items if it.request.capture is not None}
            for capture, message in failed.items():
                if capture in owner:
                    self._failed.setdefault(owner[capture], RowFailure(message, "server_error"))

    def result(self) -> StepResult:
        """The step's tokens (waiting for their copy) and the requests that failed alone."""
        self.deliver()
        result = StepResult(failed=dict(self._failed))
        if self._tokens is None:
            return result
        failures = dict(self._row_failures)
        tokens = self._read(self._tokens.result(), failures)
        for row, (req, token) in enumerate(zip(self.requests, tokens)):
            if row in failures:
                result.failed.setdefault(req, failures[row])
            elif req not in result.failed:
                result.sampled[req] = token
        return result
