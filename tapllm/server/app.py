"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, hidden states, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tapllm.hidden_states.wire import hidden_states_to_wire
from tapllm.llm import LLM
from tapllm.outputs import Logprob, RequestOutput
from tapllm.sampling_params import SamplingParams
from tapllm.server.async_engine import AsyncEngine, Update
from tapllm.server.metrics import ServerMetrics
from tapllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HiddenStatesOnlyRequest,
    PromptInput,
    _Sampling,
)

logger = logging.getLogger("tapllm")


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def create_app(llm: LLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """Build the app around ``llm``; its engine thread starts and stops with the app."""
    engine = AsyncEngine(llm)
    metrics = ServerMetrics(engine)
    max_len = llm.engine.model_config.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="tapllm", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or incorrect API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            where = first.get("loc", ("body", "?"))[-1]
            detail = (first.get("ctx") or {}).get("error", "")
            return await _api_error(request, APIError(400, f"malformed JSON body at character {where}: {detail}"))
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first['msg']}" if loc else first["msg"]
        return await _api_error(request, APIError(400, msg, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return await _api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return await _api_error(request, APIError(500, f"internal error: {exc}", "server_error"))

    auth = [Depends(check_key)]

    @app.get("/health")
    async def health() -> Response:
        if not engine._thread.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "tapllm", "max_model_len": max_len}]}

    # ---- shared request handling -------------------------------------------------------
    def check_common(body: _Sampling | HiddenStatesOnlyRequest) -> None:
        if body.model is not None and body.model != served_model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {served_model_name!r}",
                           code="model_not_found", param="model")
        if isinstance(body, _Sampling) and (problem := body.unsupported()):
            raise APIError(400, problem)
        wants_states = isinstance(body, HiddenStatesOnlyRequest) or body.hidden_states is not None
        if wants_states and not llm.engine.config.enable_hidden_states:
            raise APIError(400, "this server does not serve hidden states (start it with --enable-hidden-states)",
                           param="hidden_states")
        if isinstance(body, _Sampling) and body.steering and not llm.engine.config.enable_steering:
            raise APIError(400, "this server does not serve steering (start it with --enable-steering)",
                           param="steering")

    def stage(prompts: Sequence[str | list[int]], params: list[SamplingParams], encode: bool
              ) -> list[tuple[str | None, list[int], SamplingParams]]:
        staged = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            where = f"prompt[{i}]: " if len(prompts) > 1 else ""
            try:
                text, ids = llm.engine.tokenize(prompt)
                llm.engine.validate_prompt(ids, p, encode)
            except ValueError as exc:
                raise APIError(400, f"{where}{exc}") from None
            if not encode and len(ids) + p.max_tokens > max_len:
                raise APIError(400, f"{where}max_tokens: the prompt has {len(ids)} tokens and max_tokens is "
                               f"{p.max_tokens}, over the model's context of {max_len}; use max_tokens <= "
                               f"{max_len - len(ids)}", param="max_tokens")
            staged.append((text, ids, p))
        return staged

    def make_params(body: _Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def wire_states(out: RequestOutput | None, body_hs: Any) -> dict[str, Any] | None:
        if out is None or out.hidden_states is None:
            return None
        metrics.hidden_states_bytes.inc(out.hidden_states.nbytes)
        return hidden_states_to_wire(out.hidden_states, body_hs.encoding)

    async def collect(rid: str, text: str | None, ids: list[int], params: SamplingParams, encode: bool) -> Update:
        last = None
        async for update in engine.generate(rid, text, ids, params, encode):
            last = update
        assert last is not None and last.finished
        if last.error:
            raise APIError(500, last.error, "server_error")
        return last

    async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
        """Await ``work``; cancel it (aborting its requests) if the client goes away."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")

    def finish(endpoint: str, updates: list[Update]) -> None:
        metrics.requests.labels(endpoint, "200").inc()
        for u in updates:
            if u.output is not None:
                metrics.prompt_tokens.inc(len(u.output.prompt_token_ids))
                if u.output.outputs:
                    metrics.generation_tokens.inc(len(u.output.outputs[0].token_ids))

    async def json_response(body: dict[str, Any]) -> Response:
        # Large hidden states make big bodies: serialize off the event loop.
        text = await asyncio.to_thread(json.dumps, body, ensure_ascii=False)
        return Response(text, media_type="application/json")

    def usage(updates: list[Update]) -> dict[str, int]:
        p = sum(len(u.output.prompt_token_ids) for u in updates if u.output)
        c = sum(len(u.output.outputs[0].token_ids) for u in updates if u.output and u.output.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ---- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_common(body)
        prompts = _prompt_list(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else max_len
        params = make_params(body, max_tokens, body.logprobs)
        staged = stage(prompts, [params] * len(prompts), encode=False)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}

        if body.stream:
            return StreamingResponse(
                stream_chunks(request, "/v1/completions", staged, rid, head, body, chat=False),
                media_type="text/event-stream",
            )
        updates = await until_disconnect(request, asyncio.gather(
            *(collect(f"{rid}-{i}", t, ids, p, False) for i, (t, ids, p) in enumerate(staged))
        ))
        choices = []
        for i, u in enumerate(updates):
            c = u.output.outputs[0]
            entry = {"index": i, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "logprobs": _completion_logprobs(c.token_ids, c.logprobs, llm, body.logprobs) if body.logprobs is not None
                     else None}
            hs = wire_states(u.output, body.hidden_states)
            if hs is not None:
                entry["hidden_states"] = hs
            choices.append(entry)
        finish("/v1/completions", updates)
        return await json_response({**head, "choices": choices, "usage": usage(updates)})

    # ---- /v1/chat/completions ----------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_common(body)
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
            if not conversation:
                raise ValueError("messages is empty")
            prompt = llm.apply_chat_template(conversation, body.add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        ids_len = len(llm.engine.tokenize(prompt)[1])
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, max_len - ids_len)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = make_params(body, max_tokens, logprobs)
        staged = stage([prompt], [params], encode=False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(
                stream_chunks(request, "/v1/chat/completions", staged, rid, head, body, chat=True),
                media_type="text/event-stream",
            )
        (u,) = await until_disconnect(request, asyncio.gather(collect(f"{rid}-0", *staged[0], False)))
        c = u.output.outputs[0]
        entry: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": {"content": _chat_logprobs(c.token_ids, c.logprobs, llm, body.top_logprobs or 0)} if body.logprobs else None,
        }
        hs = wire_states(u.output, body.hidden_states)
        if hs is not None:
            entry["hidden_states"] = hs
        finish("/v1/chat/completions", [u])
        return await json_response({**head, "choices": [entry], "usage": usage([u])})

    # ---- streaming ----------------------------------------------------------------------
    async def stream_chunks(request: Request, endpoint: str, staged: list, rid: str, head: dict[str, Any],
                            body: _Sampling, chat: bool) -> AsyncIterator[str]:
        merged: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()

        async def pump(i: int, text: str | None, ids: list[int], params: SamplingParams) -> None:
            try:
                async for update in engine.generate(f"{rid}-{i}", text, ids, params):
                    await merged.put((i, update))
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer below
                await merged.put((i, exc))
                raise

        tasks = [asyncio.ensure_future(pump(i, *s)) for i, s in enumerate(staged)]
        finals: list[Update] = []
        try:
            if chat:
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            while len(finals) < len(tasks):
                i, u = await merged.get()
                if isinstance(u, BaseException):
                    raise u
                if u.error:
                    yield _sse({"error": {"message": u.error, "type": "server_error", "param": None, "code": None}})
                    return
                c: dict[str, Any] = {"index": i, "finish_reason": None}
                if chat:
                    c["delta"] = {"content": u.text} if u.text else {}
                    c["logprobs"] = {"content": _chat_logprobs(u.token_ids, u.logprobs, llm, body.top_logprobs or 0)} if body.logprobs \
                        else None
                else:
                    c["text"] = u.text
                    c["logprobs"] = _completion_logprobs(u.token_ids, u.logprobs, llm, body.logprobs) \
                        if body.logprobs is not None else None
                if u.finished:
                    finals.append(u)
                    out = u.output.outputs[0]
                    c["finish_reason"], c["stop_reason"] = out.finish_reason, out.stop_reason
                    hs = wire_states(u.output, body.hidden_states)
                    if hs is not None:
                        c["hidden_states"] = hs
                    yield await asyncio.to_thread(_sse, {**head, "choices": [c]})
                elif u.text or u.token_ids:
                    yield _sse({**head, "choices": [c]})
            if body.include_usage():
                yield _sse({**head, "choices": [], "usage": usage(finals)})
            yield "data: [DONE]\n\n"
            finish(endpoint, finals)
        finally:
            for t in tasks:  # client gone or done: cancelling a pump aborts its engine request
                t.cancel()

    # ---- /v1/hidden_states ---------------------------------------------------------------
    @app.post("/v1/hidden_states", dependencies=auth)
    async def hidden_states(body: HiddenStatesOnlyRequest, request: Request) -> Response:
        check_common(body)
        prompts = _prompt_list(body.input)
        try:
            params = SamplingParams(max_tokens=1, temperature=0, hidden_states=body.hidden_states.to_spec())
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        staged = stage(prompts, [params] * len(prompts), encode=True)
        rid = f"hs-{uuid.uuid4().hex}"
        updates = await until_disconnect(request, asyncio.gather(
            *(collect(f"{rid}-{i}", t, ids, p, True) for i, (t, ids, p) in enumerate(staged))
        ))
        data = [{"index": i, "object": "hidden_states", "prompt_tokens": len(u.output.prompt_token_ids),
                 "hidden_states": wire_states(u.output, body.hidden_states)} for i, u in enumerate(updates)]
        finish("/v1/hidden_states", updates)
        n = sum(d["prompt_tokens"] for d in data)
        return await json_response({"object": "list", "model": served_model_name, "data": data,
                                    "usage": {"prompt_tokens": n, "total_tokens": n}})

    return app


def _prompt_list(prompt: PromptInput) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely tokens of an entry (which also holds the chosen token)."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:n]


def _completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None, llm: LLM, n: int
                         ) -> dict[str, Any] | None:
    if entries is None:
        return None
    tok = llm.tokenizer
    tokens, chosen, tops = [], [], []
    for t, entry in zip(token_ids, entries):
        tokens.append(tok.decode([t]))
        chosen.append(entry[t].logprob)
        tops.append({tok.decode([k]): v.logprob for k, v in _top(entry, n)})
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None, llm: LLM, n: int
                   ) -> list[dict[str, Any]] | None:
    if entries is None:
        return None
    tok = llm.tokenizer
    out = []
    for t, entry in zip(token_ids, entries):
        s = tok.decode([t])
        top = [{"token": tok.decode([k]), "logprob": v.logprob, "bytes": list(tok.decode([k]).encode())}
               for k, v in _top(entry, n)]
        out.append({"token": s, "logprob": entry[t].logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return out
