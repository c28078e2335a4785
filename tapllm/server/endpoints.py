"""The routes of the API: completions, chat, hidden states, models, health and metrics (and, from their
own modules, embeddings, tokenize and detokenize).

A handler parses its body and admits its prompts off the event loop (``admission``), runs
them on the engine thread (``async_engine``), and writes the response off the loop too
(``formatting``), so ``/health`` stays responsive while a large request is handled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tapllm.engine.request import Request as EngineRequest
from tapllm.outputs import CompletionOutput, RequestOutput
from tapllm.server import formatting
from tapllm.server.admission import Admission
from tapllm.server.async_engine import AsyncEngine, Update
from tapllm.server.bodies import json_response, parse, until_disconnect, validation_error
from tapllm.server.embeddings import EmbeddingRequest, EmbeddingRoutes
from tapllm.server.errors import ERROR_STATUS, APIError
from tapllm.server.formatting import ChoiceFormat, sse, sse_error
from tapllm.server.metrics import ServerMetrics
from tapllm.server.protocol import ChatCompletionRequest, CompletionRequest, HiddenStatesOnlyRequest, _Sampling
from tapllm.server.serving import Lifecycle
from tapllm.server.tokenize_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeRoutes

logger = logging.getLogger("tapllm")

__all__ = ["BODIES", "Endpoints", "validation_error"]

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


class Endpoints:
    """The API's handlers, with the helpers they share; :meth:`add_routes` puts them on a router."""

    def __init__(self, engine: AsyncEngine, admission: Admission, metrics: ServerMetrics, lifecycle: Lifecycle,
                 served_model_name: str, tokenizer: Any) -> None:
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer  # decodes logprob tokens

    def add_routes(self, router: APIRouter) -> None:
        """Register every route on ``router`` itself (the app's: the ``Guard`` labels metrics by route)."""
        add = router.add_api_route
        add("/health", self.health, methods=["GET"])
        add("/metrics", self.prometheus, methods=["GET"])
        add("/v1/models", self.models, methods=["GET"])
        add("/v1/completions", self.completions, methods=["POST"], openapi_extra=_body_of("CompletionRequest"))
        add("/v1/chat/completions", self.chat, methods=["POST"], openapi_extra=_body_of("ChatCompletionRequest"))
        add("/v1/hidden_states", self.hidden_states, methods=["POST"],
            openapi_extra=_body_of("HiddenStatesOnlyRequest"))
        EmbeddingRoutes(self).add_routes(router, _body_of("EmbeddingRequest"))
        TokenizeRoutes(self).add_routes(router, {
            "/tokenize": _body_of("TokenizeCompletionRequest", "TokenizeChatRequest"),
            "/detokenize": _body_of("DetokenizeRequest")})

    # ---- GET -----------------------------------------------------------------------------
    async def health(self) -> Response:
        if self.lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not self.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "tapllm", "max_model_len": self.admission.max_len}]}

    # ---- POST ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = arrived(await asyncio.to_thread(self.admission.completion, body, rid), arrival)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.served_model_name}
        return await self._respond(request, body, reqs, head, chat=False)

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = arrived([await asyncio.to_thread(self.admission.chat, body, rid)], arrival)[0]
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": self.served_model_name}
        return await self._respond(request, body, [req], head, chat=True)

    async def hidden_states(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await parse(request, HiddenStatesOnlyRequest)
        reqs = arrived(await asyncio.to_thread(self.admission.hidden_states, body, f"hs-{uuid.uuid4().hex}"), arrival)
        outputs = await self.run_all(request, reqs)

        def build() -> dict[str, Any]:
            data = [{"index": i, "object": "hidden_states", "prompt_tokens": len(out.prompt_token_ids),
                     "hidden_states": self._states(out, body.hidden_states.encoding)}
                    for i, out in enumerate(outputs)]
            n = sum(d["prompt_tokens"] for d in data)
            return {"object": "list", "model": self.served_model_name, "data": data,
                    "usage": {"prompt_tokens": n, "total_tokens": n}}

        return await json_response(build)

    # ---- completions and chat ----------------------------------------------------------------
    async def _respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                       reqs: list[EngineRequest], head: dict[str, Any], chat: bool) -> Response:
        fmt = ChoiceFormat(self.tokenizer, chat=chat, stream=body.stream, top_logprobs=body.num_logprobs())
        if body.stream:
            return StreamingResponse(self._stream(reqs, head, body, fmt), media_type="text/event-stream")
        outputs = await self.run_all(request, reqs)
        encoding = body.states_encoding()

        echo = isinstance(body, CompletionRequest) and body.echo
        if echo and body.max_tokens == 0:  # the prompt alone: drop the one token run to score it
            outputs = [_without_completion(out) for out in outputs]

        def build() -> dict[str, Any]:
            choices = []
            for i, out in enumerate(outputs):
                prompt_text = "" if not echo else \
                    out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
                for j, c in enumerate(out.outputs):  # n completions a prompt: choice i * n + j
                    index = i * body.n + j
                    if echo:  # the prompt, then the completion; the prompt's first token has no logprob
                        entries = None if c.logprobs is None else \
                            [None, *(out.prompt_logprobs or [])[1:], *c.logprobs]
                        choice = fmt.choice(index, prompt_text + c.text, out.prompt_token_ids + c.token_ids,
                                            entries, final=c, hidden_states=self._states(c, encoding))
                    else:
                        choice = fmt.choice(index, c.text, c.token_ids, c.logprobs, final=c,
                                            hidden_states=self._states(c, encoding))
                    if isinstance(body, CompletionRequest) and body.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = formatting.prompt_logprobs(out.prompt_logprobs)
                    choices.append(choice)
            result = {**head, "choices": choices, "usage": formatting.usage(outputs)}
            if isinstance(body, ChatCompletionRequest) and body.prompt_logprobs is not None:
                result["prompt_logprobs"] = formatting.prompt_logprobs(outputs[0].prompt_logprobs)  # vLLM's place
            return result

        return await json_response(build)

    async def _stream(self, reqs: list[EngineRequest], head: dict[str, Any], body: _Sampling, fmt: ChoiceFormat
                      ) -> AsyncIterator[str]:
        """SSE chunks; any failure ends the stream with an error event and ``data: [DONE]``."""
        merged: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()
        encoding = body.states_encoding()

        async def pump(i: int, req: EngineRequest) -> None:
            try:
                async for update in self.engine.generate(req):
                    await merged.put((i, update))
            except Exception as exc:  # noqa: BLE001 - delivered to the consumer below
                await merged.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        finals: list[RequestOutput] = []
        try:
            if fmt.chat:
                for j in range(body.n):
                    yield sse({**head, "choices": [fmt.choice(j, "", [], None, role="assistant")]})
            elif isinstance(body, CompletionRequest) and body.echo:  # each prompt first (no logprobs: refused)
                for i, r in enumerate(reqs):
                    text = r.prompt if r.prompt is not None else self.tokenizer.decode(r.prompt_token_ids)
                    for j in range(body.n):
                        yield sse({**head, "choices": [fmt.choice(i * body.n + j, text, [], None)]})
            while len(finals) < len(tasks):
                i, u = await merged.get()
                if isinstance(u, BaseException):
                    logger.error("stream %s failed: %s: %s", head["id"], type(u).__name__, u)
                    yield sse_error(f"internal error: {type(u).__name__}: {u}", "server_error")
                    return
                if u.error:
                    yield sse_error(u.error, u.error_type or "server_error")
                    return
                if u.finished:
                    out = u.output
                    assert out is not None
                    finals.append(out)

                    def final_chunk(i: int = i, u: Update = u, out: RequestOutput = out) -> str:
                        if len(out.outputs) == 1:
                            c = fmt.choice(i, u.text, u.token_ids, u.logprobs, final=out.outputs[0],
                                           hidden_states=self._states(out, encoding))
                            chunks = [{**head, "choices": [c]}]
                        else:  # n > 1: the text came in the samples' updates; each choice ends here
                            chunks = [{**head, "choices": [fmt.choice(i * body.n + j, "", [], None, final=c,
                                                                      hidden_states=self._states(c, encoding))]}
                                      for j, c in enumerate(out.outputs)]
                        if getattr(body, "prompt_logprobs", None) is not None:  # with the choice's last chunk
                            for chunk in chunks:
                                where = chunk if fmt.chat else chunk["choices"][0]
                                where["prompt_logprobs"] = formatting.prompt_logprobs(out.prompt_logprobs)
                        return "".join(sse(chunk) for chunk in chunks)

                    yield await asyncio.to_thread(final_chunk)
                elif u.text or u.token_ids:
                    yield sse({**head, "choices": [fmt.choice(i * body.n + u.index, u.text, u.token_ids,
                                                              u.logprobs)]})
            if body.include_usage():
                yield sse({**head, "choices": [], "usage": formatting.usage(finals)})
            yield formatting.DONE
            self._count_tokens(finals)
        finally:
            for t in tasks:  # client gone or done: cancelling a pump aborts its engine request
                t.cancel()

    # ---- running -----------------------------------------------------------------------------
    async def run_all(self, request: Request, reqs: list[EngineRequest]) -> list[RequestOutput]:
        """All of a request's prompts; the first to fail ends the others (and the client leaving, all)."""
        tasks = [asyncio.ensure_future(self._result(r)) for r in reqs]
        try:
            outputs = await until_disconnect(request, asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
        self._count_tokens(outputs)
        return outputs

    async def _result(self, req: EngineRequest) -> RequestOutput:
        last = None
        async for update in self.engine.generate(req):
            last = update
        assert last is not None and last.finished
        if last.error:
            kind = last.error_type or "server_error"
            raise APIError(ERROR_STATUS.get(kind, 500), last.error, kind)
        assert last.output is not None
        return last.output

    def _count_tokens(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.metrics.generation_tokens.inc(len(c.token_ids))

    def _states(self, out: RequestOutput | CompletionOutput, encoding: str | None) -> dict[str, Any] | None:
        """A request's (or one completion's) hidden states on the wire (``None`` without), counted in the metrics."""
        if encoding is None or out.hidden_states is None:
            return None
        self.metrics.hidden_states_bytes.inc(out.hidden_states.nbytes)
        return formatting.hidden_states_json(out.hidden_states, encoding)


def arrived(reqs: list[EngineRequest], arrival: float) -> list[EngineRequest]:
    """``reqs`` stamped with when their HTTP request came in (latency metrics start there)."""
    for r in reqs:
        r.times.arrival = arrival
    return reqs


def _without_completion(out: RequestOutput) -> RequestOutput:
    """``out`` with its completion emptied (echo with max_tokens=0 returns the prompt alone)."""
    empty = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                 cumulative_logprob=None, finish_reason="length", stop_reason=None)
             for c in out.outputs]
    return dataclasses.replace(out, outputs=empty)
