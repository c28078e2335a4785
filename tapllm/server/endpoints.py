"""The routes of the API: completions, chat, hidden states, models, health and metrics.

A handler parses its body and admits its prompts off the event loop (``admission``), runs
them on the engine thread (``async_engine``), and writes the response off the loop too
(``formatting``), so ``/health`` stays responsive while a large request is handled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tapllm.engine.request import Request as EngineRequest
from tapllm.outputs import CompletionOutput, RequestOutput
from tapllm.server import formatting
from tapllm.server.admission import Admission
from tapllm.server.async_engine import AsyncEngine, Update
from tapllm.server.errors import ERROR_STATUS, APIError, encode
from tapllm.server.formatting import ChoiceFormat, sse, sse_error
from tapllm.server.metrics import ServerMetrics
from tapllm.server.protocol import ChatCompletionRequest, CompletionRequest, HiddenStatesOnlyRequest, _Sampling
from tapllm.server.serving import Lifecycle

logger = logging.getLogger("tapllm")

Model = TypeVar("Model", bound=pydantic.BaseModel)

# Bodies are parsed off the event loop (not by FastAPI): their schemas are added to the OpenAPI
# document by name (``app.create_app``).
BODIES: dict[str, type[pydantic.BaseModel]] = {
    "CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
    "HiddenStatesOnlyRequest": HiddenStatesOnlyRequest,
}


def _body_of(model: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


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
        body = await _parse(request, CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = await asyncio.to_thread(self.admission.completion, body, rid)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.served_model_name}
        return await self._respond(request, body, reqs, head, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = await asyncio.to_thread(self.admission.chat, body, rid)
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": self.served_model_name}
        return await self._respond(request, body, [req], head, chat=True)

    async def hidden_states(self, request: Request) -> Response:
        body = await _parse(request, HiddenStatesOnlyRequest)
        reqs = await asyncio.to_thread(self.admission.hidden_states, body, f"hs-{uuid.uuid4().hex}")
        outputs = await self._run_all(request, reqs)

        def build() -> dict[str, Any]:
            data = [{"index": i, "object": "hidden_states", "prompt_tokens": len(out.prompt_token_ids),
                     "hidden_states": self._states(out, body.hidden_states.encoding)}
                    for i, out in enumerate(outputs)]
            n = sum(d["prompt_tokens"] for d in data)
            return {"object": "list", "model": self.served_model_name, "data": data,
                    "usage": {"prompt_tokens": n, "total_tokens": n}}

        return await _json_response(build)

    # ---- completions and chat ----------------------------------------------------------------
    async def _respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                       reqs: list[EngineRequest], head: dict[str, Any], chat: bool) -> Response:
        fmt = ChoiceFormat(self.tokenizer, chat=chat, stream=body.stream, top_logprobs=body.num_logprobs())
        if body.stream:
            return StreamingResponse(self._stream(reqs, head, body, fmt), media_type="text/event-stream")
        outputs = await self._run_all(request, reqs)
        encoding = body.hidden_states.encoding if body.hidden_states is not None else None

        def build() -> dict[str, Any]:
            choices = []
            echo = isinstance(body, CompletionRequest) and body.echo
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
            return {**head, "choices": choices, "usage": formatting.usage(outputs)}

        return await _json_response(build)

    async def _stream(self, reqs: list[EngineRequest], head: dict[str, Any], body: _Sampling, fmt: ChoiceFormat
                      ) -> AsyncIterator[str]:
        """SSE chunks; any failure ends the stream with an error event and ``data: [DONE]``."""
        merged: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()
        encoding = body.hidden_states.encoding if body.hidden_states is not None else None

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
                            return sse({**head, "choices": [c]})
                        # n > 1: the text came in the samples' updates; each choice ends here
                        return "".join(sse({**head, "choices": [fmt.choice(
                            i * body.n + j, "", [], None, final=c, hidden_states=self._states(c, encoding))]})
                            for j, c in enumerate(out.outputs))

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
    async def _run_all(self, request: Request, reqs: list[EngineRequest]) -> list[RequestOutput]:
        """All of a request's prompts; the first to fail ends the others (and the client leaving, all)."""
        tasks = [asyncio.ensure_future(self._result(r)) for r in reqs]
        try:
            outputs = await _until_disconnect(request, asyncio.gather(*tasks))
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


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        task.cancel()


async def _json_response(build: Callable[[], dict[str, Any]]) -> Response:
    # Large hidden states make big bodies: build and serialize off the event loop.
    data = await asyncio.to_thread(lambda: encode(build()))
    return Response(data, media_type="application/json")


async def _parse(request: Request, model: type[Model]) -> Model:
    """The request's JSON body as ``model``, parsed and validated in a worker thread."""
    raw = await request.body()
    return await asyncio.to_thread(_parse_body, raw, model)


def _parse_body(raw: bytes, model: type[Model]) -> Model:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body at character {exc.pos}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise APIError(400, "malformed JSON body: it is not valid UTF-8") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "request body nested too deeply") from None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's errors: the first, naming its field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = f"{loc}: {first['msg']}" if loc else first["msg"]
    return APIError(400, msg, param=loc or None)
