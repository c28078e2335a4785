"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, hidden states, models, health, metrics.

Cost per request is bounded before the engine sees it: the ``Guard`` middleware limits and
reads the body (after auth); the routes (``routes/``) parse and validate bodies, admit
their prompts (``admission``: length-checked, tokenized and prepared by the engine) and
serialize responses (``formatting``) off the event loop, so ``/health`` stays responsive
while a large request is handled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tapllm.engine.llm_engine import LLMEngine
from tapllm.server.admission import Admission
from tapllm.server.async_engine import AsyncEngine
from tapllm.server.bodies import validation_error
from tapllm.server.context import RouteContext
from tapllm.server.core_client import CoreClient
from tapllm.server.errors import APIError
from tapllm.server.guard import Guard
from tapllm.server.launcher import Lifecycle
from tapllm.server.metrics import ServerMetrics
from tapllm.server.routes import BODIES, add_routes

logger = logging.getLogger("tapllm")


def create_app(engine: LLMEngine | CoreClient, served_model_name: str, api_key: str | None = None, *,
               max_request_bytes: int = 8 << 20, max_prompts_per_request: int = 256, body_read_timeout: float = 30.0,
               lifecycle: Lifecycle | None = None) -> FastAPI:
    """Build the app around ``engine``; its runner starts and stops with the app.

    ``engine`` is an ``LLMEngine`` (run on a thread of this process: ``AsyncEngine``) or a
    ``CoreClient`` connected to an engine-core process. ``lifecycle`` is shared with the
    uvicorn server (``tapllm.server.launcher``) for shutdown.
    """
    runner: AsyncEngine | CoreClient = AsyncEngine(engine) if isinstance(engine, LLMEngine) else engine
    metrics = ServerMetrics(runner)
    lifecycle = lifecycle or Lifecycle()
    lifecycle.abort_inflight = runner.abort_all
    runner.on_fatal = lambda why: lifecycle.fail(why)  # the engine died for good: 503s, then the server exits
    admission = Admission(runner.engine.input_processor, served_model_name, max_prompts_per_request)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            runner.shutdown()

    app = FastAPI(title="tapllm", lifespan=lifespan)
    app.state.engine = runner
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.add_middleware(
        Guard, routes=lambda: app.router.routes, lifecycle=lifecycle,
        count=lambda route, status: metrics.requests.labels(route, str(status)).inc(),
        api_key=api_key, max_body_bytes=max_request_bytes, body_timeout=body_read_timeout,
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    _add_error_handlers(app)
    ctx = RouteContext(runner, admission, metrics, lifecycle, served_model_name, runner.engine.tokenizer)
    add_routes(app.router, ctx)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with the request bodies' schemas (they are parsed off the event loop)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in BODIES.items():
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[name] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is answered with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return await _api_error(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return await _api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return await _api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
