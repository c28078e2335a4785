"""``POST /v1/chat/completions``: a conversation, rendered with the chat template, completed."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from tapllm.server.routes.responses import GenerationRoute
from tapllm.server.schema import ChatCompletionRequest


class ChatRoute(GenerationRoute):
    """``POST /v1/chat/completions``."""

    path = "/v1/chat/completions"
    name = "chat"

    async def handle(self, request: Request) -> Response:
        body, rid, (req,) = await self.admit(request, ChatCompletionRequest,
                                             lambda b, r: [self.ctx.admission.chat(b, r)], "chatcmpl")
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": self.ctx.served_model_name}
        return await self.responder.respond(request, body, [req], head, chat=True)
