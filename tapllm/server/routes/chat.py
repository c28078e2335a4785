"""``POST /v1/chat/completions``: a conversation, rendered with the chat template, completed."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tapllm.server.bodies import parse
from tapllm.server.context import RouteContext, arrived
from tapllm.server.protocol import ChatCompletionRequest
from tapllm.server.routes.responses import Responder


class ChatRoutes:
    """The ``/v1/chat/completions`` route, over the app's ``RouteContext``."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx
        self.responder = Responder(ctx)

    def add_routes(self, router: APIRouter, openapi_extra: dict[str, Any]) -> None:
        """Register ``POST /v1/chat/completions`` on ``router``."""
        router.add_api_route("/v1/chat/completions", self.chat, methods=["POST"],
                             openapi_extra=openapi_extra)

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = arrived([await asyncio.to_thread(self.ctx.admission.chat, body, rid)], arrival)[0]
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, [req], head, chat=True)
