"""What every route shares, and nothing more: the one narrow object route modules are given.

The route modules (``routes/``) import this module, and one another only downward (completions
and chat use ``responses``, which uses ``hidden_states``), so the server's import graph has no
circle back to a hub. :class:`PostRoute` is the shape of a ``POST`` route over the context.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.outputs import RequestOutput
from tapllm.server.admission import Admission
from tapllm.server.bodies import parse, until_disconnect
from tapllm.server.errors import ERROR_STATUS, APIError
from tapllm.server.launcher import Lifecycle
from tapllm.server.metrics import ServerMetrics
from tapllm.server.runner import EngineRunner


@dataclass(slots=True)
class RouteContext:
    """The engine thread, admission, metrics and lifecycle of one app, and how routes run requests."""

    engine: EngineRunner
    admission: Admission
    metrics: ServerMetrics
    lifecycle: Lifecycle
    served_model_name: str
    tokenizer: Any  # decodes logprob tokens

    async def run_all(self, request: Request, reqs: list[EngineCoreRequest]) -> list[RequestOutput]:
        """All of a request's prompts; the first to fail ends the others (and the client leaving, all)."""
        tasks = [asyncio.ensure_future(self._result(r)) for r in reqs]
        try:
            outputs = await until_disconnect(request, asyncio.gather(*tasks), ", ".join(r.request_id for r in reqs))
        finally:
            for t in tasks:
                t.cancel()
        self.count_tokens(outputs)
        return outputs

    async def _result(self, req: EngineCoreRequest) -> RequestOutput:
        last = None
        async for update in self.engine.generate(req):
            last = update
        assert last is not None and last.finished
        if last.error:
            kind = last.error_type or "server_error"
            raise APIError(ERROR_STATUS.get(kind, 500), last.error)
        assert last.output is not None
        return last.output

    def count_tokens(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.metrics.generation_tokens.inc(len(c.token_ids))


def arrived(reqs: list[EngineCoreRequest], arrival: float) -> list[EngineCoreRequest]:
    """``reqs`` stamped with when their HTTP request came in (latency metrics start there)."""
    for r in reqs:
        r.arrival = arrival
    return reqs


class PostRoute:
    """A route answering ``POST path`` with :meth:`handle`, over the app's :class:`RouteContext`.

    ``name`` is the route's name (its OpenAPI operation id starts with it).
    """

    path: ClassVar[str]
    name: ClassVar[str]

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    def add_routes(self, router: APIRouter, openapi_extra: dict[str, Any]) -> None:
        """Register ``POST path`` on ``router``."""
        router.add_api_route(self.path, self.handle, methods=["POST"], name=self.name, openapi_extra=openapi_extra)

    async def handle(self, request: Request) -> Response:
        """Answer one request."""
        raise NotImplementedError

    async def admit(self, request: Request, body_type: Any, admit: Callable[[Any, str], list[EngineCoreRequest]],
                    prefix: str) -> tuple[Any, str, list[EngineCoreRequest]]:
        """Parse the body, admit its prompts off the event loop (``admit(body, request_id)``) and stamp
        when they arrived; returns the body, the request id (``prefix-<hex>``) and the prepared requests."""
        arrival = time.monotonic()
        body = await parse(request, body_type)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return body, rid, arrived(await asyncio.to_thread(admit, body, rid), arrival)
