"""``POST /v1/hidden_states`` (prompt-only states, like ``LLM.encode``) and the states' wire form."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tapllm.outputs import CompletionOutput, RequestOutput
from tapllm.server import formatting
from tapllm.server.bodies import json_response
from tapllm.server.context import PostRoute, RouteContext
from tapllm.server.schema import HiddenStatesOnlyRequest


class HiddenStatesRoute(PostRoute):
    """``POST /v1/hidden_states``."""

    path = "/v1/hidden_states"
    name = "hidden_states"

    async def handle(self, request: Request) -> Response:
        body, _, reqs = await self.admit(request, HiddenStatesOnlyRequest, self.ctx.admission.hidden_states, "hs")
        outputs = await self.ctx.run_all(request, reqs)

        def build() -> dict[str, Any]:
            data = [{"index": i, "object": "hidden_states", "prompt_tokens": len(out.prompt_token_ids),
                     "hidden_states": wire_states(self.ctx, out, body.hidden_states.encoding)}
                    for i, out in enumerate(outputs)]
            n = sum(d["prompt_tokens"] for d in data)
            return {"object": "list", "model": self.ctx.served_model_name, "data": data,
                    "usage": {"prompt_tokens": n, "total_tokens": n}}

        return await json_response(build)


def wire_states(ctx: RouteContext, out: RequestOutput | CompletionOutput, encoding: str | None
                ) -> dict[str, Any] | None:
    """A request's (or one completion's) hidden states on the wire (``None`` without), counted in the metrics."""
    if encoding is None or out.hidden_states is None:
        return None
    ctx.metrics.hidden_states_bytes.inc(out.hidden_states.nbytes)
    return formatting.hidden_states_json(out.hidden_states, encoding)
