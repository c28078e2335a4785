"""The response of a completions or chat request: one JSON body, or a stream of server-sent events.

Both run the admitted requests on the engine thread (``RouteContext.run_all`` or
``AsyncEngine.generate``) and write the response off the event loop (``formatting``), so
``/health`` stays responsive while a large request is handled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.outputs import CompletionOutput, RequestOutput
from tapllm.server import formatting
from tapllm.server.bodies import json_response
from tapllm.server.context import PostRoute, RouteContext
from tapllm.server.formatting import ChoiceFormat, sse, sse_error
from tapllm.server.routes.hidden_states import wire_states
from tapllm.server.runner import Update
from tapllm.server.schema import ChatCompletionRequest, CompletionRequest, _Sampling

logger = logging.getLogger("tapllm")


class Responder:
    """Answers completions and chat requests, over the app's ``RouteContext``."""

    def __init__(self, ctx: RouteContext) -> None:
        self.ctx = ctx

    async def respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                       reqs: list[EngineCoreRequest], head: dict[str, Any], chat: bool) -> Response:
        fmt = ChoiceFormat(self.ctx.tokenizer, chat=chat, stream=body.stream, top_logprobs=body.num_logprobs())
        if body.stream:
            return StreamingResponse(self.stream(reqs, head, body, fmt), media_type="text/event-stream")
        outputs = await self.ctx.run_all(request, reqs)
        encoding = body.states_encoding()

        echo = isinstance(body, CompletionRequest) and body.echo
        if echo and body.max_tokens == 0:  # the prompt alone: drop the one token run to score it
            outputs = [_without_completion(out) for out in outputs]

        def build() -> dict[str, Any]:
            choices = []
            for i, out in enumerate(outputs):
                prompt_text = "" if not echo else \
                    out.prompt if out.prompt is not None else self.ctx.tokenizer.decode(out.prompt_token_ids)
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

    async def stream(self, reqs: list[EngineCoreRequest], head: dict[str, Any], body: _Sampling, fmt: ChoiceFormat
                      ) -> AsyncIterator[str]:
        """SSE chunks; any failure ends the stream with an error event and ``data: [DONE]``."""
        merged: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()
        encoding = body.states_encoding()

        async def pump(i: int, req: EngineCoreRequest) -> None:
            try:
                async for update in self.ctx.engine.generate(req):
                    await merged.put((i, update))
            except Exception as exc:  # noqa: BLE001 - delivered to the consumer below
                await merged.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        finals: list[RequestOutput] = []
        ended = False  # the stream's last event was written (else the client left first)
        try:
            if fmt.chat:
                for j in range(body.n):
                    yield sse({**head, "choices": [fmt.choice(j, "", [], None, role="assistant")]})
            elif isinstance(body, CompletionRequest) and body.echo:  # each prompt first (no logprobs: refused)
                for i, r in enumerate(reqs):
                    text = r.prompt if r.prompt is not None else self.ctx.tokenizer.decode(r.prompt_token_ids)
                    for j in range(body.n):
                        yield sse({**head, "choices": [fmt.choice(i * body.n + j, text, [], None)]})
            while len(finals) < len(tasks):
                i, u = await merged.get()
                if isinstance(u, BaseException):
                    logger.error("stream %s failed: %s: %s", head["id"], type(u).__name__, u)
                    yield sse_error(f"internal error: {type(u).__name__}: {u}", "server_error")
                    ended = True
                    return
                if u.error:
                    yield sse_error(u.error, u.error_type or "server_error")
                    ended = True
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
            ended = True
            self.ctx.count_tokens(finals)
        finally:
            if not ended:
                logger.debug("the client of stream %s disconnected: aborted", head["id"])
            for t in tasks:  # client gone or done: cancelling a pump aborts its engine request
                t.cancel()


    def _states(self, out: RequestOutput | CompletionOutput, encoding: str | None) -> dict[str, Any] | None:
        return wire_states(self.ctx, out, encoding)


class GenerationRoute(PostRoute):
    """A route whose requests generate: answered by a :class:`Responder` (completions, chat)."""

    def __init__(self, ctx: RouteContext) -> None:
        super().__init__(ctx)
        self.responder = Responder(ctx)

def _without_completion(out: RequestOutput) -> RequestOutput:
    """``out`` with its completion emptied (echo with max_tokens=0 returns the prompt alone)."""
    empty = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                 cumulative_logprob=None, finish_reason="length", stop_reason=None)
             for c in out.outputs]
    return dataclasses.replace(out, outputs=empty)
