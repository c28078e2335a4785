"""What the routes need of whatever runs the engine, and the updates it yields.

Two runners implement :class:`EngineRunner`: ``AsyncEngine`` (the engine on a thread of the
server's process, ``--no-engine-process``) and ``CoreClient`` (the engine in its own process,
over ZMQ: the default of ``tapllm serve``). Both turn a step's progress into :class:`Update`
objects with :func:`publish`, so a stream reads the same either way. An engine that died for good
(:func:`fatal_reason`) makes either runner end its requests with a 503 and call ``on_fatal``: the
server then exits.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.llm_engine import EngineStats, LLMEngine
from tapllm.engine.output_processor import StreamCursor
from tapllm.engine.request import Request
from tapllm.outputs import Logprob, RequestOutput
from tapllm.parallel import TensorParallelError
from tapllm.server.records import FinishedRecord, record_of

logger = logging.getLogger("tapllm")


@dataclass(slots=True)
class Update:
    """What a request produced since its previous update."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finished: bool = False
    output: RequestOutput | None = None  # the complete result, with the final update
    error: str | None = None  # why the request failed (it is finished)
    error_type: str | None = None  # "invalid_request_error" | "server_error" | "service_unavailable"
    index: int = 0  # the sample (n > 1) the text and tokens belong to


def failed(message: str, error_type: str) -> Update:
    """The final update of a request that failed with ``message``."""
    return Update("", [], None, True, error=message, error_type=error_type)


def fatal_reason(exc: BaseException) -> str | None:
    """Why ``exc`` leaves the engine dead for good, or None when it can go on (the step's requests fail,
    the next step runs). A broken tensor-parallel group is fatal: its ranks can never meet again, so the
    server answers 503 and exits rather than fail every later request."""
    if isinstance(exc, TensorParallelError):
        return str(exc)  # names the rank and how it failed
    return None


class RequestObserver(Protocol):
    """Told what each request produced and when (the server's latency metrics)."""

    def inter_token(self, seconds: float, count: int) -> None:
        """``count`` tokens followed the previous one by ``seconds`` each."""

    def finished(self, record: FinishedRecord) -> None:
        """A request completed (not aborted, not failed)."""

    def step(self, tokens: int) -> None:
        """An engine step ran ``tokens`` tokens."""


@dataclass(slots=True)
class LoopStats:
    """What ``/metrics`` reads of the engine (its latest snapshot and the runner's counters)."""

    engine: EngineStats  # the engine's latest snapshot (``LLMEngine.stats``), replaced whole
    # Requests whose client never got their result: it left before their final update (whether or not the
    # engine had finished them), or the shutdown ended them. Counted on the event loop, where that is known.
    requests_aborted: int = 0
    step_errors: int = 0


class EngineRunner(Protocol):
    """Runs prepared requests for the routes: ``AsyncEngine`` or ``CoreClient``."""

    engine: Any  # its ``input_processor`` prepares requests: ``LLMEngine`` or ``EngineFrontend``
    stats: LoopStats
    observer: RequestObserver | None

    @property
    def alive(self) -> bool:
        """Whether the engine runs."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache."""

    on_fatal: Callable[[str], None]  # called once (from any thread) when the engine died for good, with why

    def abort_all(self, message: str) -> int:
        """End every request in flight with a 503 error and refuse later ones; how many were ended."""

    def generate(self, request: EngineCoreRequest) -> AsyncIterator[Update]:
        """Run a prepared request; yield its updates until it finishes (leaving early aborts it)."""


@dataclass(slots=True)
class Publisher:
    """Where one request's stream stands: what it has sent, and when its previous token came."""

    cursor: StreamCursor = field(default_factory=StreamCursor)
    last_token_time: float | None = None

    def updates(self, engine: LLMEngine, req: Request, observer: RequestObserver | None) -> list[Update]:
        """What each sample produced since the last call; once all have finished, the result too.

        With one sample the final update carries the last text too; with several (n > 1) each
        sample's text comes in updates with its ``index`` and the final update carries none.
        """
        group = req.group
        out = []
        for d in engine.output_processor.deltas(req, self.cursor):  # stop-string hold-back is done there
            if d.token_ids and d.index == 0 and observer is not None:
                self._observe(req, len(d.token_ids), observer)
            out.append(Update(d.text, d.token_ids, d.logprobs, index=d.index))
        if req.group_finished:
            final = out.pop() if len(group) == 1 and out else Update("", [], None)
            final.finished = True
            final.output = engine.make_output(req)
            if final.output.error is not None:  # this request alone failed; the others go on
                final.error = final.output.error
                final.error_type = final.output.error_type or "server_error"
            elif observer is not None:
                try:
                    observer.finished(record_of(req))
                except Exception:  # metrics must never stop the engine
                    logger.exception("recording the metrics of request %s failed", req.request_id)
            out.append(final)
        return out

    def _observe(self, req: Request, count: int, observer: RequestObserver) -> None:
        """Inter-token latencies of the ``count`` tokens the request sampled since its last update."""
        now = req.times.last_token
        try:
            if self.last_token_time is not None and now is not None:
                observer.inter_token((now - self.last_token_time) / count, count)
        except Exception:  # metrics must never stop the engine
            logger.exception("recording inter-token latency failed")
        self.last_token_time = now
