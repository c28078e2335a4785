"""``GET /health``, ``GET /metrics`` and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from tapllm.server import formatting
from tapllm.server.context import RouteContext


class StatusRoutes:
    """Liveness, Prometheus metrics and the served model, over the app's ``RouteContext``."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    def add_routes(self, router: APIRouter) -> None:
        """Register the three routes on ``router``."""
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/metrics", self.prometheus, methods=["GET"])
        router.add_api_route("/v1/models", self.models, methods=["GET"])

    async def health(self) -> Response:
        if self.ctx.lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not self.ctx.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> dict[str, Any]:
        engine = self.ctx.engine.engine  # the LLMEngine, or the API server's EngineFrontend
        root = str(engine.config.model) if engine.config.model is not None else str(engine.model_config.path)
        return {"object": "list", "data": [formatting.model_card(self.ctx.served_model_name, root,
                                                                 self.ctx.admission.max_len, engine.quantization)]}
