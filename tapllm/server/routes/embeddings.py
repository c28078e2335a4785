"""``POST /v1/embeddings``: pooled hidden states of the served model, in the OpenAI shape.

An embedding is one state per prompt, pooled over the prompt on the engine's device, by the
same capture path as ``LLM.encode``: by default ``final`` (what the LM head reads) at the last
prompt position, L2-normalised, as decoder embedding models do. Extensions (``extra_body``)
choose ``point``, ``layer``, ``pooling`` (``last``, ``mean``, ``first``) and ``normalize``.
``encoding_format="base64"`` is the little-endian float32 bytes, base64-encoded, as OpenAI
sends them (the official client asks for it by default and decodes it).

Like vLLM, which serves embeddings only from a pooling runner, the server serves them only when
started with ``--enable-hidden-states``.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import torch
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from tapllm.hidden_states.spec import HIDDEN_POINTS, PSEUDO_POINTS, HiddenStatesSpec
from tapllm.server.bodies import json_response
from tapllm.server.context import PostRoute
from tapllm.server.errors import APIError
from tapllm.server.schema import PromptInput



class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's fields, vLLM's ``add_special_tokens``, and the pooling extensions."""

    model_config = ConfigDict(extra="forbid")
    input: PromptInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # accepted only as the point's full width: no truncation
    user: str | None = None  # OpenAI's end-user id: metadata, accepted and not used
    add_special_tokens: bool = True
    point: str = "final"
    layer: int | None = None  # a block (negative: from the end); only for block points
    pooling: Literal["last", "mean", "first"] = "last"
    normalize: bool = True

    def spec(self) -> HiddenStatesSpec:
        """The capture behind the embedding; ``APIError`` names the field."""
        if self.point not in HIDDEN_POINTS:
            raise APIError(400, f"point must be one of {', '.join(HIDDEN_POINTS)} (a hidden-size state), got "
                           f"{self.point!r}", param="point")
        if self.point in PSEUDO_POINTS and self.layer is not None:
            raise APIError(400, f"layer does not apply to point {self.point!r} (one pseudo-layer); leave it out",
                           param="layer")
        layers: list[int] | str = "all" if self.point in PSEUDO_POINTS else [-1 if self.layer is None else self.layer]
        # Only the rows pooled are captured: "last" lets the prefix cache serve the rest of the prompt.
        positions: Any = {"last": "last_prompt", "first": (0, 1), "mean": "prompt"}[self.pooling]
        return HiddenStatesSpec(layers=layers, points=[self.point], positions=positions, reduce=self.pooling,
                                dtype="float32")


class EmbeddingRoute(PostRoute):
    """``POST /v1/embeddings``."""

    path = "/v1/embeddings"
    name = "embeddings"

    async def handle(self, request: Request) -> Response:
        body, rid, reqs = await self.admit(request, EmbeddingRequest, self._admit, "embd")
        outputs = await self.ctx.run_all(request, reqs)

        def build() -> dict[str, Any]:
            data = []
            for i, out in enumerate(outputs):
                vector = pooled_vector(out.hidden_states[body.point], body.normalize)
                data.append({"object": "embedding", "index": i,
                             "embedding": encode_vector(vector, body.encoding_format)})
            n = sum(len(out.prompt_token_ids) for out in outputs)
            return {"id": rid, "object": "list", "created": int(time.time()), "model": self.ctx.served_model_name,
                    "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}

        return await json_response(build)

    def _admit(self, body: EmbeddingRequest, request_id: str) -> list[Any]:
        admission = self.ctx.admission
        admission.check_model(body.model)
        mc = admission.processor.model_config
        width = mc.hidden_size
        if body.layer is not None and not -mc.num_layers <= body.layer < mc.num_layers:
            raise APIError(400, f"layer {body.layer} is out of range: the model has {mc.num_layers} blocks "
                           f"(-{mc.num_layers} to {mc.num_layers - 1})", param="layer")
        if body.dimensions is not None and body.dimensions != width:
            raise APIError(400, f"dimensions: this server returns the full {width} numbers of the state; "
                           f"shortening embeddings to {body.dimensions} is not supported", param="dimensions")
        try:
            spec = body.spec()
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return admission.encode_prompts(body.input, spec, "input", request_id, body.add_special_tokens)


def pooled_vector(state: torch.Tensor, normalize: bool) -> torch.Tensor:
    """A reduced state ``[1, hidden]`` as one float32 vector, L2-normalised if asked."""
    vector = state.reshape(-1).float()
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A float list, or base64 of the little-endian float32 bytes (OpenAI's ``base64``)."""
    if encoding_format == "float":
        return vector.tolist()
    raw = vector.to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
    return base64.b64encode(raw).decode("ascii")
