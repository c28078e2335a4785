"""``POST /v1/completions``: text completions of one or more prompts."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tapllm.server.bodies import parse
from tapllm.server.context import RouteContext, arrived
from tapllm.server.protocol import CompletionRequest
from tapllm.server.routes.responses import Responder


class CompletionRoutes:
    """The ``/v1/completions`` route, over the app's ``RouteContext``."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx
        self.responder = Responder(ctx)

    def add_routes(self, router: APIRouter, openapi_extra: dict[str, Any]) -> None:
        """Register ``POST /v1/completions`` on ``router``."""
        router.add_api_route("/v1/completions", self.completions, methods=["POST"], openapi_extra=openapi_extra)

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = arrived(await asyncio.to_thread(self.ctx.admission.completion, body, rid), arrival)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, reqs, head, chat=False)
