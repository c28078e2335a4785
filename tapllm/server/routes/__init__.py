"""The routes of the API, one small module each, over one narrow ``RouteContext``.

A handler parses its body and admits its prompts off the event loop (``admission``), runs
them on the engine thread (``async_engine``), and writes the response off the loop too
(``formatting``), so ``/health`` stays responsive while a large request is handled.
"""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter

from tapllm.server.context import RouteContext
from tapllm.server.routes.chat import ChatRoute
from tapllm.server.routes.completions import CompletionRoute
from tapllm.server.routes.embeddings import EmbeddingRequest, EmbeddingRoute
from tapllm.server.routes.hidden_states import HiddenStatesRoute
from tapllm.server.routes.status import StatusRoutes
from tapllm.server.schema import ChatCompletionRequest, CompletionRequest, HiddenStatesOnlyRequest
from tapllm.server.routes.tokenize import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                           TokenizeRoutes)

__all__ = ["BODIES", "add_routes"]

# Bodies are parsed off the event loop (not by FastAPI): their schemas are added to the OpenAPI
# document by name (``app.create_app``).
BODIES: dict[str, type[pydantic.BaseModel]] = {
    "CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
    "HiddenStatesOnlyRequest": HiddenStatesOnlyRequest, "EmbeddingRequest": EmbeddingRequest,
    "TokenizeCompletionRequest": TokenizeCompletionRequest, "TokenizeChatRequest": TokenizeChatRequest,
    "DetokenizeRequest": DetokenizeRequest,
}


def _body_of(*models: str) -> dict[str, Any]:
    refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_routes(router: APIRouter, ctx: RouteContext) -> None:
    """Register every route on ``router`` itself (the app's: the ``Guard`` labels metrics by route)."""
    StatusRoutes(ctx).add_routes(router)
    CompletionRoute(ctx).add_routes(router, _body_of("CompletionRequest"))
    ChatRoute(ctx).add_routes(router, _body_of("ChatCompletionRequest"))
    HiddenStatesRoute(ctx).add_routes(router, _body_of("HiddenStatesOnlyRequest"))
    EmbeddingRoute(ctx).add_routes(router, _body_of("EmbeddingRequest"))
    TokenizeRoutes(ctx).add_routes(router, {
        "/tokenize": _body_of("TokenizeCompletionRequest", "TokenizeChatRequest"),
        "/detokenize": _body_of("DetokenizeRequest")})
