"""``POST /v1/completions``: text completions of one or more prompts."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from tapllm.server.bodies import parse
from tapllm.server.context import PostRoute, RouteContext, arrived
from tapllm.server.protocol import CompletionRequest
from tapllm.server.routes.responses import Responder


class CompletionRoute(PostRoute):
    """``POST /v1/completions``."""

    path = "/v1/completions"
    name = "completions"

    def __init__(self, ctx: RouteContext) -> None:
        super().__init__(ctx)
        self.responder = Responder(ctx)

    async def handle(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = arrived(await asyncio.to_thread(self.ctx.admission.completion, body, rid), arrival)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, reqs, head, chat=False)
