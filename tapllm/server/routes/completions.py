"""``POST /v1/completions``: text completions of one or more prompts."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from tapllm.server.routes.responses import GenerationRoute
from tapllm.server.schema import CompletionRequest


class CompletionRoute(GenerationRoute):
    """``POST /v1/completions``."""

    path = "/v1/completions"
    name = "completions"

    async def handle(self, request: Request) -> Response:
        body, rid, reqs = await self.admit(request, CompletionRequest, self.ctx.admission.completion, "cmpl")
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, reqs, head, chat=False)
