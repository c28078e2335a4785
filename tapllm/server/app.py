"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, hidden states, models, health, metrics.

Cost per request is bounded before the engine sees it: the ``Guard`` middleware limits and
reads the body (after auth), bodies are parsed and validated, prompts length-checked and
tokenized, and responses serialized off the event loop, so ``/health`` stays responsive
while a large request is handled. A string prompt whose UTF-8 length could not fit the
context even at the vocabulary's longest token is refused without tokenizing it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pydantic
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tapllm.hidden_states.wire import hidden_states_to_wire
from tapllm.llm import LLM
from tapllm.outputs import Logprob, RequestOutput
from tapllm.sampling_params import SamplingParams
from tapllm.server.async_engine import AsyncEngine, Update
from tapllm.server.errors import ERROR_STATUS, APIError, check_text, dumps, encode, finite_or_none
from tapllm.server.guard import Guard
from tapllm.server.metrics import ServerMetrics
from tapllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HiddenStatesOnlyRequest,
    PromptInput,
    _Sampling,
)
from tapllm.server.serving import Lifecycle

logger = logging.getLogger("tapllm")

Model = TypeVar("Model", bound=pydantic.BaseModel)
Staged = tuple[str | None, list[int], SamplingParams]

# What OpenAI-compatible servers write for a log probability of -inf (vLLM's value).
MIN_LOGPROB = -9999.0

_BODIES = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
           "HiddenStatesOnlyRequest": HiddenStatesOnlyRequest}


def create_app(llm: LLM, served_model_name: str, api_key: str | None = None, *, max_request_bytes: int = 8 << 20,
               max_prompts_per_request: int = 256, body_read_timeout: float = 30.0,
               lifecycle: Lifecycle | None = None) -> FastAPI:
    """Build the app around ``llm``; its engine thread starts and stops with the app.

    ``lifecycle`` is shared with the uvicorn server (``tapllm.server.serving``) for shutdown.
    """
    engine = AsyncEngine(llm)
    metrics = ServerMetrics(engine)
    lifecycle = lifecycle or Lifecycle()
    lifecycle.abort_inflight = engine.abort_all
    max_len = llm.engine.model_config.max_model_len
    hs_limit = llm.engine.config.hidden_states_max_bytes_per_request
    max_logprobs = llm.engine.config.max_logprobs
    longest_token, text_limit = _text_limit(llm.tokenizer, max_len)
    logger.info("prompts over %s bytes of UTF-8 are refused before tokenizing (%d tokens x %d bytes, the "
                "longest token)", f"{text_limit:,}", max_len, longest_token)

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
    app.state.lifecycle = lifecycle
    app.add_middleware(
        Guard, routes=lambda: app.router.routes, lifecycle=lifecycle,
        count=lambda route, status: metrics.requests.labels(route, str(status)).inc(),
        api_key=api_key, max_body_bytes=max_request_bytes, body_timeout=body_read_timeout,
    )

    def openapi() -> dict[str, Any]:
        # Bodies are parsed off the event loop (not by FastAPI), so their schemas are added here.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODIES.items():
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[name] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def body_of(model: str) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{model}"}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return await _api_error(request, _validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return await _api_error(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return await _api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                  "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "tapllm", "max_model_len": max_len}]}

    # ---- staging: runs in a worker thread ------------------------------------------------
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
        if isinstance(body, _Sampling):
            stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
            for i, s in enumerate(stops):
                check_text(s, "stop" if isinstance(body.stop, str) else f"stop[{i}]")

    def check_logprobs(value: int | None, field: str) -> None:
        if value is None:
            return
        if value < 0:
            raise APIError(400, f"{field} must be >= 0, got {value}", param=field)
        if value > max_logprobs:
            raise APIError(400, f"{field}: {value} requested, more than this server's max_logprobs={max_logprobs}",
                           param=field)

    def make_params(body: _Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None

    def tokenize(prompt: str | list[int], name: str) -> tuple[str | None, list[int]]:
        """Check a prompt's text, refuse one that cannot fit without tokenizing it, tokenize."""
        if isinstance(prompt, str):
            # A character is at least one byte: only a prompt that may fit is encoded to measure it.
            ascii_only = prompt.isascii()
            exact = ascii_only or len(prompt) <= text_limit
            size = len(prompt) if ascii_only or not exact else len(prompt.encode("utf-8", "surrogatepass"))
            if size > text_limit:
                raise APIError(400, f"{name} is {'' if exact else 'at least '}{size:,} bytes of text, more than the "
                               f"model's context of {max_len} tokens can hold (at most {longest_token} bytes a "
                               "token): shorten it", param=name)
            check_text(prompt, name)
        try:
            return llm.engine.tokenize(prompt)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from None

    def admit(text: str | None, ids: list[int], params: SamplingParams, encode_only: bool,
              prefix: str) -> tuple[Staged, int]:
        """Validate one tokenized prompt; returns it staged and the bytes its states could take."""
        try:
            llm.engine.validate_prompt(ids, params, encode_only)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"{prefix}{exc}") from None
        if not encode_only and len(ids) + params.max_tokens > max_len:
            raise APIError(400, f"{prefix}max_tokens: the prompt has {len(ids)} tokens and max_tokens is "
                           f"{params.max_tokens}, over the model's context of {max_len}; use max_tokens <= "
                           f"{max_len - len(ids)}", param="max_tokens")
        return (text, ids, params), llm.engine.hidden_states_bytes(ids, params, encode_only)

    def check_total_states(total: int, count: int) -> None:
        if hs_limit is not None and total > hs_limit:
            raise APIError(400, f"hidden_states: the {count} prompts of this request could capture up to {total:,} "
                           f"bytes together, over this server's limit of {hs_limit:,} bytes a request "
                           "(--hidden-states-max-bytes); send fewer prompts per request, or select fewer layers "
                           "or positions, reduce, project, or use a smaller dtype", param="hidden_states")

    def stage(prompts: Sequence[str | list[int]], params: SamplingParams, encode_only: bool, field: str
              ) -> list[Staged]:
        staged, total = [], 0
        for i, prompt in enumerate(prompts):
            name = f"{field}[{i}]" if len(prompts) > 1 else field
            prefix = f"{field}[{i}]: " if len(prompts) > 1 else ""
            text, ids = tokenize(prompt, name)
            item, capture = admit(text, ids, params, encode_only, prefix)
            staged.append(item)
            total += capture
        check_total_states(total, len(staged))
        return staged

    def stage_completion(body: CompletionRequest) -> list[Staged]:
        check_common(body)
        check_logprobs(body.logprobs, "logprobs")
        prompts = _prompt_list(body.prompt, "prompt", max_prompts_per_request)
        max_tokens = body.max_tokens if body.max_tokens is not None else max_len
        return stage(prompts, make_params(body, max_tokens, body.logprobs), False, "prompt")

    def stage_chat(body: ChatCompletionRequest) -> Staged:
        check_common(body)
        if body.logprobs:
            check_logprobs(body.top_logprobs, "top_logprobs")
        conversation = _conversation(body)
        try:
            prompt = llm.apply_chat_template(conversation, body.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - the template refused these messages (jinja raises its own)
            raise APIError(400, f"messages: the chat template failed on them: {type(exc).__name__}: {exc}",
                           param="messages") from None
        text, ids = tokenize(prompt, "messages")  # once: the default max_tokens needs the length
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          max(1, max_len - len(ids)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return admit(text, ids, make_params(body, max_tokens, logprobs), False, "")[0]

    def stage_states(body: HiddenStatesOnlyRequest) -> list[Staged]:
        check_common(body)
        prompts = _prompt_list(body.input, "input", max_prompts_per_request)
        try:
            params = SamplingParams(max_tokens=1, temperature=0, hidden_states=body.hidden_states.to_spec())
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        return stage(prompts, params, True, "input")

    # ---- running -------------------------------------------------------------------------
    async def collect(rid: str, text: str | None, ids: list[int], params: SamplingParams,
                      encode_only: bool) -> Update:
        last = None
        async for update in engine.generate(rid, text, ids, params, encode_only):
            last = update
        assert last is not None and last.finished
        if last.error:
            kind = last.error_type or "server_error"
            raise APIError(ERROR_STATUS.get(kind, 500), last.error, kind)
        return last

    async def run_all(request: Request, rid: str, staged: list[Staged], encode_only: bool) -> list[Update]:
        """All of a request's prompts; the first to fail ends the others (and the client leaving, all)."""
        tasks = [asyncio.ensure_future(collect(f"{rid}-{i}", *s, encode_only)) for i, s in enumerate(staged)]
        try:
            return await until_disconnect(request, asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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

    def count_tokens(updates: list[Update]) -> None:
        for u in updates:
            if u.output is not None:
                metrics.prompt_tokens.inc(len(u.output.prompt_token_ids))
                if u.output.outputs:
                    metrics.generation_tokens.inc(len(u.output.outputs[0].token_ids))

    def wire_states(out: RequestOutput | None, body_hs: Any) -> dict[str, Any] | None:
        if out is None or out.hidden_states is None:
            return None
        hs = out.hidden_states
        metrics.hidden_states_bytes.inc(hs.nbytes)
        wire = hidden_states_to_wire(hs, body_hs.encoding)
        if body_hs.encoding == "list":  # JSON has no NaN: an empty reduction window is written as null
            for point, tensor in hs.items():
                if not bool(torch.isfinite(tensor).all()):
                    wire["points"][point]["data"] = finite_or_none(wire["points"][point]["data"])
        return wire

    async def json_response(build: Callable[[], dict[str, Any]]) -> Response:
        # Large hidden states make big bodies: build and serialize off the event loop.
        data = await asyncio.to_thread(lambda: encode(build()))
        return Response(data, media_type="application/json")

    def usage(updates: list[Update]) -> dict[str, int]:
        p = sum(len(u.output.prompt_token_ids) for u in updates if u.output)
        c = sum(len(u.output.outputs[0].token_ids) for u in updates if u.output and u.output.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ---- /v1/completions ---------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=body_of("CompletionRequest"))
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        staged = await asyncio.to_thread(stage_completion, body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
        if body.stream:
            return StreamingResponse(stream_chunks(staged, rid, head, body, chat=False),
                                     media_type="text/event-stream")
        updates = await run_all(request, rid, staged, False)
        count_tokens(updates)

        def build() -> dict[str, Any]:
            choices = []
            for i, u in enumerate(updates):
                c = u.output.outputs[0]
                entry = {"index": i, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "logprobs": _completion_logprobs(c.token_ids, c.logprobs, llm, body.logprobs)
                         if body.logprobs is not None else None}
                hs = wire_states(u.output, body.hidden_states)
                if hs is not None:
                    entry["hidden_states"] = hs
                choices.append(entry)
            return {**head, "choices": choices, "usage": usage(updates)}

        return await json_response(build)

    # ---- /v1/chat/completions ----------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=body_of("ChatCompletionRequest"))
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        staged = await asyncio.to_thread(stage_chat, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(stream_chunks([staged], rid, head, body, chat=True),
                                     media_type="text/event-stream")
        (u,) = await run_all(request, rid, [staged], False)
        count_tokens([u])

        def build() -> dict[str, Any]:
            c = u.output.outputs[0]
            entry: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": {"content": _chat_logprobs(c.token_ids, c.logprobs, llm, body.top_logprobs or 0)}
                if body.logprobs else None,
            }
            hs = wire_states(u.output, body.hidden_states)
            if hs is not None:
                entry["hidden_states"] = hs
            return {**head, "choices": [entry], "usage": usage([u])}

        return await json_response(build)

    # ---- streaming ----------------------------------------------------------------------
    async def stream_chunks(staged: list[Staged], rid: str, head: dict[str, Any], body: _Sampling,
                            chat: bool) -> AsyncIterator[str]:
        """SSE chunks; any failure ends the stream with an error event and ``data: [DONE]``."""
        merged: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()

        async def pump(i: int, text: str | None, ids: list[int], params: SamplingParams) -> None:
            try:
                async for update in engine.generate(f"{rid}-{i}", text, ids, params):
                    await merged.put((i, update))
            except Exception as exc:  # noqa: BLE001 - delivered to the consumer below
                await merged.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, *s)) for i, s in enumerate(staged)]
        finals: list[Update] = []
        try:
            if chat:
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            while len(finals) < len(tasks):
                i, u = await merged.get()
                if isinstance(u, BaseException):
                    logger.error("stream %s failed: %s: %s", rid, type(u).__name__, u)
                    yield _sse_error(f"internal error: {type(u).__name__}: {u}", "server_error")
                    return
                if u.error:
                    yield _sse_error(u.error, u.error_type or "server_error")
                    return
                c: dict[str, Any] = {"index": i, "finish_reason": None}
                if chat:
                    c["delta"] = {"content": u.text} if u.text else {}
                    c["logprobs"] = {"content": _chat_logprobs(u.token_ids, u.logprobs, llm, body.top_logprobs or 0)} \
                        if body.logprobs else None
                else:
                    c["text"] = u.text
                    c["logprobs"] = _completion_logprobs(u.token_ids, u.logprobs, llm, body.logprobs) \
                        if body.logprobs is not None else None
                if u.finished:
                    finals.append(u)
                    out = u.output.outputs[0]
                    c["finish_reason"], c["stop_reason"] = out.finish_reason, out.stop_reason

                    def final_chunk(c: dict[str, Any] = c, u: Update = u) -> str:
                        hs = wire_states(u.output, body.hidden_states)
                        if hs is not None:
                            c["hidden_states"] = hs
                        return _sse({**head, "choices": [c]})

                    yield await asyncio.to_thread(final_chunk)
                elif u.text or u.token_ids:
                    yield _sse({**head, "choices": [c]})
            if body.include_usage():
                yield _sse({**head, "choices": [], "usage": usage(finals)})
            yield _DONE
            count_tokens(finals)
        finally:
            for t in tasks:  # client gone or done: cancelling a pump aborts its engine request
                t.cancel()

    def _sse_error(message: str, kind: str) -> str:
        return _sse({"error": {"message": message, "type": kind, "param": None, "code": None}}) + _DONE

    # ---- /v1/hidden_states ---------------------------------------------------------------
    @app.post("/v1/hidden_states", openapi_extra=body_of("HiddenStatesOnlyRequest"))
    async def hidden_states(request: Request) -> Response:
        body = await _parse(request, HiddenStatesOnlyRequest)
        staged = await asyncio.to_thread(stage_states, body)
        rid = f"hs-{uuid.uuid4().hex}"
        updates = await run_all(request, rid, staged, True)
        count_tokens(updates)

        def build() -> dict[str, Any]:
            data = [{"index": i, "object": "hidden_states", "prompt_tokens": len(u.output.prompt_token_ids),
                     "hidden_states": wire_states(u.output, body.hidden_states)} for i, u in enumerate(updates)]
            n = sum(d["prompt_tokens"] for d in data)
            return {"object": "list", "model": served_model_name, "data": data,
                    "usage": {"prompt_tokens": n, "total_tokens": n}}

        return await json_response(build)

    return app


_DONE = "data: [DONE]\n\n"


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
        raise _validation_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "request body nested too deeply") from None


def _validation_error(errors: Sequence[Any]) -> APIError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = f"{loc}: {first['msg']}" if loc else first["msg"]
    return APIError(400, msg, param=loc or None)


def _text_limit(tokenizer: Any, max_len: int) -> tuple[int, int]:
    """``(longest token in UTF-8 bytes, most bytes of text a prompt of max_len tokens can be)``.

    A token stands for at most as many bytes of text as its longest spelling, in the vocabulary
    (byte-level, SentencePiece: never shorter than the text) or decoded. A tokenizer with a
    normalizer may shrink text before splitting it (NFKC, stripped accents), so the limit
    keeps a margin of 4x there: a heuristic bound; tokenization still has the final word.
    """
    vocab = tokenizer.get_vocab()
    longest = 1
    for token in vocab:
        spelled = len(token.encode("utf-8", "surrogatepass"))
        decoded = len(tokenizer.convert_tokens_to_string([token]).encode("utf-8", "surrogatepass"))
        longest = max(longest, spelled, decoded)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    margin = 4 if backend is None or backend.normalizer is not None else 1
    return longest, max_len * longest * margin


def _prompt_list(prompt: PromptInput, field: str, limit: int) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field} is empty", param=field)
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > limit:
        raise APIError(400, f"{field}: {len(prompt)} prompts in one request, more than this server's limit of "
                       f"{limit} (--max-prompts-per-request)", param=field)
    return list(prompt)  # type: ignore[arg-type]


def _conversation(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` text; ``APIError`` names the faulty field."""
    if not body.messages:
        raise APIError(400, "messages is empty", param="messages")
    conversation = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if not m.role:
            raise APIError(400, f"{where}.role must be a non-empty string", param=f"{where}.role")
        check_text(m.role, f"{where}.role")
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"{where}.content is required for a {m.role!r} message", param=f"{where}.content")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   "are supported", param=f"{where}.content")
                check_text(part["text"], f"{where}.content[{j}].text")
        elif isinstance(m.content, str):
            check_text(m.content, f"{where}.content")
        conversation.append({"role": m.role, "content": m.text()})
    return conversation


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"


def _logprob(value: float) -> float | None:
    """A log probability as JSON can carry it: -inf as ``MIN_LOGPROB``, NaN as null."""
    if math.isnan(value):
        return None
    return max(value, MIN_LOGPROB)


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
        chosen.append(_logprob(entry[t].logprob))
        tops.append({tok.decode([k]): _logprob(v.logprob) for k, v in _top(entry, n)})
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
        top = [{"token": tok.decode([k]), "logprob": _logprob(v.logprob), "bytes": list(tok.decode([k]).encode())}
               for k, v in _top(entry, n)]
        out.append({"token": s, "logprob": _logprob(entry[t].logprob), "bytes": list(s.encode()),
                    "top_logprobs": top})
    return out
