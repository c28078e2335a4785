"""``POST /v1/chat/completions``: a conversation, rendered with the chat template, completed."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from tapllm.server.bodies import parse
from tapllm.server.context import PostRoute, RouteContext, arrived
from tapllm.server.protocol import ChatCompletionRequest
from tapllm.server.routes.responses import Responder


class ChatRoute(PostRoute):
    """``POST /v1/chat/completions``."""

    path = "/v1/chat/completions"
    name = "chat"

    def __init__(self, ctx: RouteContext) -> None:
        super().__init__(ctx)
        self.responder = Responder(ctx)

    async def handle(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = arrived([await asyncio.to_thread(self.ctx.admission.chat, body, rid)], arrival)[0]
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, [req], head, chat=True)
