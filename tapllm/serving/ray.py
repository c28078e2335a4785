"""tapllm on Ray Serve: one engine replica per node behind a front that routes by prompt prefix.

The application has ``num_replicas`` engine deployments (``tapllm-engine-0`` ..), each of one
replica holding one in-process ``LLMEngine`` and the very app ``tapllm serve`` runs
(``tapllm.server.create_app``: every route, check, error, state encoding and ``/metrics``),
and one ``tapllm-front`` deployment, the HTTP ingress. Each engine replica reserves
``cpus_per_replica`` CPUs; set it to a node's CPU count and Ray places one per node (the front
reserves none). The front keeps a handle to each engine deployment and routes as
``tapllm serve --data-parallel-size N`` does, with the same ``PrefixRouter``: a request goes to
the replica holding the longest prefix of its prompt (by the chained hashes of its KV blocks)
unless that one is much busier than the least busy, else to the least busy. Every response
carries the replica that answered in the ``x-tapllm-replica`` header; a request that sends
that header goes to that replica (e.g. ``GET /metrics`` of one replica).

Run it with Ray Serve's CLI on a running cluster (``ray start`` on each node first)::

    serve run tapllm.serving.ray:build_app model=/models/smollm2 num_replicas=2 \\
        cpus_per_replica=8 enable_hidden_states=true

or from Python: ``serve.run(app(RayServeOptions(model=..., num_replicas=2)))``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tapllm.serving.asgi import HTTPCall, Lifespan, ResponseStart, call_app
from tapllm.serving.options import RayServeOptions
from tapllm.serving.prompt_tokens import PromptTokens
from tapllm.server.errors import APIError
from tapllm.server.router import PrefixRouter

logger = logging.getLogger("tapllm")

REPLICA_HEADER = "x-tapllm-replica"
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class EngineReplica:
    """One engine and ``tapllm serve``'s app around it; the front calls :meth:`serve_http` per request."""

    async def __init__(self, options: RayServeOptions, index: int) -> None:
        from tapllm.engine.llm_engine import LLMEngine
        from tapllm.server import create_app

        torch.set_num_threads(options.torch_threads)
        self.index = index
        engine = await asyncio.to_thread(LLMEngine.from_config, options.engine_config())
        self.app = create_app(engine, options.model_name, api_key=options.api_key,
                              max_request_bytes=options.max_request_bytes,
                              max_prompts_per_request=options.max_prompts_per_request)
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        logger.info("tapllm engine replica %d ready", index)

    async def serve_http(self, call: HTTPCall) -> Any:
        """Answer one request: yields its :class:`ResponseStart`, then its body's chunks (a stream)."""
        async for item in call_app(self.app, call, self.lifespan.state):
            yield item

    def tokenizer(self) -> Any:
        """The engine's tokenizer (its chat template set), for the front's routing."""
        return self.app.state.engine.engine.tokenizer

    def where(self) -> dict[str, Any]:
        """This replica's index, Ray node and process."""
        return {"index": self.index, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "torch_threads": torch.get_num_threads()}

    def check_health(self) -> None:
        """Ray Serve's health check: the engine thread must run."""
        if not self.app.state.engine.alive:
            raise RuntimeError(f"the engine thread of replica {self.index} stopped")

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


class PrefixFront:
    """The HTTP ingress: reads a request, picks an engine replica by prompt prefix, relays the answer."""

    async def __init__(self, options: RayServeOptions, *replicas: DeploymentHandle) -> None:
        if len(replicas) != options.num_replicas:
            raise ValueError(f"expected {options.num_replicas} engine replicas, got {len(replicas)}")
        self.replicas = list(replicas)
        self.options = options
        self.router = PrefixRouter(len(replicas), options.block_size)
        tokenizer = await self.replicas[0].tokenizer.remote()
        self.tokens = PromptTokens(tokenizer, max_body_tokens=1 << 20)

    async def __call__(self, request: Request) -> Response:
        try:
            pinned = self._pinned(request)
            raw = await self._body(request)
        except APIError as exc:
            return Response(exc.body(), status_code=exc.status, media_type="application/json")
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if pinned is not None:
            return await self._relay(pinned, request, path, raw, routed=False)
        tokens: list[int] = []
        if request.method == "POST" and self._authorized(request):
            tokens = await asyncio.to_thread(self.tokens.of, path, raw)
        return await self._relay(self.router.choose(tokens), request, path, raw, routed=True)

    def routing(self) -> list[dict[str, int]]:
        """Per replica: requests routed there, of them by prefix affinity, and in flight now."""
        return [{"routed": r.routed, "affinity_routed": r.affinity_routed, "in_flight": r.in_flight}
                for r in self.router.replicas]

    async def _relay(self, index: int, request: Request, path: str, raw: bytes, routed: bool) -> Response:
        call = HTTPCall(request.method, path, request.scope.get("query_string", b""),
                        tuple((bytes(k), bytes(v)) for k, v in request.headers.raw), raw,
                        tuple(request.client) if request.client else None)
        released = False

        def release() -> None:
            nonlocal released
            if routed and not released:
                released = True
                self.router.done(index)

        stream = self.replicas[index].serve_http.options(stream=True).remote(call)
        try:
            start = await stream.__anext__()
            assert isinstance(start, ResponseStart), start
        except Exception as exc:
            release()
            stream.cancel()
            logger.exception("engine replica %d failed a request", index)
            err = APIError(503, f"engine replica {index} could not answer: {type(exc).__name__}")
            return Response(err.body(), status_code=503, media_type="application/json",
                            headers={REPLICA_HEADER: str(index)})
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in _HOP_HEADERS}
        headers[REPLICA_HEADER] = str(index)
        if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return StreamingResponse(self._chunks(stream, release), status_code=start.status, headers=headers)
        try:
            body = b"".join([chunk async for chunk in stream])
        finally:
            release()
        return Response(body, status_code=start.status, headers=headers)

    @staticmethod
    async def _chunks(stream: Any, release: Any) -> Any:
        """Relay a stream; if the client leaves first, cancel it in the replica (which aborts the request)."""
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        finally:
            release()
            if not finished:
                stream.cancel()

    def _pinned(self, request: Request) -> int | None:
        value = request.headers.get(REPLICA_HEADER)
        if value is None:
            return None
        if not value.strip().isdigit() or int(value) >= len(self.replicas):
            raise APIError(400, f"{REPLICA_HEADER} must be a replica index in [0, {len(self.replicas)}), got "
                           f"{value!r}")
        return int(value)

    async def _body(self, request: Request) -> bytes:
        """The whole body, refused with a 413 past ``max_request_bytes``."""
        limit = self.options.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {int(declared):,} bytes is over this server's limit of "
                           f"{limit:,} bytes")
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over this server's limit of {limit:,} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def _authorized(self, request: Request) -> bool:
        """Whether to spend tokenizing on this body (the replica's app checks the key itself)."""
        key = self.options.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"


def app(options: RayServeOptions) -> Any:
    """The Ray Serve application (for ``serve.run``): the engine deployments and the front."""
    engines = []
    for i in range(options.num_replicas):
        deployment = serve.deployment(EngineReplica, name=f"tapllm-engine-{i}", num_replicas=1,
                                      max_ongoing_requests=options.max_ongoing_requests,
                                      ray_actor_options={"num_cpus": options.cpus_per_replica})
        engines.append(deployment.bind(options, i))
    front = serve.deployment(PrefixFront, name="tapllm-front", num_replicas=1,
                             max_ongoing_requests=options.max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    return front.bind(options, *engines)


def build_app(args: dict[str, str]) -> Any:
    """The application builder of ``serve run tapllm.serving.ray:build_app key=value ...`` (see the module)."""
    return app(RayServeOptions.from_strings(args))
