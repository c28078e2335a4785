"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered with the chat template
as ``/v1/chat/completions`` renders them: ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``) and answers ``{count, max_model_len,
tokens, token_strs}``; ``token_strs`` (the vocabulary's spelling of each token) only with
``return_token_strs``. ``/detokenize`` turns ``tokens`` back into ``{prompt}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictInt

from tapllm.server.bodies import json_response, parse
from tapllm.server.context import RouteContext
from tapllm.server.errors import APIError, check_text
from tapllm.server.schema import ChatMessage



class TokenizeCompletionRequest(BaseModel):
    """``/tokenize`` of text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``/tokenize`` of a conversation, through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's default for chats: the template holds them
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``/detokenize``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def tokenize_model(data: Any) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which ``/tokenize`` body ``data`` is: a chat when it has ``messages``."""
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


class TokenizeRoutes:
    """``/tokenize`` and ``/detokenize`` over the app's ``RouteContext`` (its admission and tokenizer)."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    def add_routes(self, router: APIRouter, openapi_extra: dict[str, dict[str, Any]]) -> None:
        """Register both routes on ``router``; ``openapi_extra`` by route path."""
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"], openapi_extra=openapi_extra["/tokenize"])
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"],
                             openapi_extra=openapi_extra["/detokenize"])

    async def tokenize(self, request: Request) -> Response:
        body = await parse(request, tokenize_model)
        result = await asyncio.to_thread(self._tokenize, body)
        return await json_response(lambda: result)

    async def detokenize(self, request: Request) -> Response:
        body = await parse(request, DetokenizeRequest)
        result = await asyncio.to_thread(self._detokenize, body)
        return await json_response(lambda: result)

    def _tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        admission = self.ctx.admission
        admission.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = admission.render_chat(body)
        else:
            check_text(body.prompt, "prompt")
            text = body.prompt
        tokenizer = admission.processor.tokenizer
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": admission.max_len, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    def _detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        admission = self.ctx.admission
        admission.check_model(body.model)
        vocab = admission.processor.model_config.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is outside the vocabulary [0, {vocab})",
                               param=f"tokens[{i}]")
        return {"prompt": admission.processor.tokenizer.decode(body.tokens)}
