"""The ASGI middleware in front of every route: metrics label, shutdown, auth, body limits.

In order, before the request body is read or parsed:

1. the request is labelled by its route template (``/v1/completions``; ``unmatched`` for
   any unknown path), so ``/metrics`` has a bounded number of series;
2. while the server shuts down, new requests get 503;
3. with an API key, everything but ``/health`` needs ``Authorization: Bearer KEY``
   (docs and metrics included): 401 comes before any parsing;
4. a POST to a route must be ``Content-Type: application/json`` (415 otherwise);
5. the body is read here, at most ``max_body_bytes`` (413, from Content-Length before
   anything is read, or counted for a chunked body) within ``body_timeout`` seconds (408),
   and handed to the app in one piece.

After a request with a large body (1 MiB or more), and once no request has been in flight for
:data:`IDLE_TRIM_S` seconds, the free heap is handed back to the kernel (``malloc_trim``, on a
worker thread; when idle, after a full garbage collection), so rare large bodies and bursts of
requests (their encoded states, their responses) do not leave the process bigger.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterable
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tapllm.server.errors import encode, error_body
from tapllm.server.launcher import Lifecycle
from tapllm.utils.platform import release_free_memory

UNMATCHED = "unmatched"
LARGE_BODY = 1 << 20
IDLE_TRIM_S = 2.0
OPEN_PATHS = frozenset({"/health"})


class _Refuse(Exception):
    def __init__(self, status: int, message: str, close: bool = False,
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close
        self.headers = list(headers)


class Guard:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, *, routes: Callable[[], Iterable[BaseRoute]], lifecycle: Lifecycle,
                 count: Callable[[str, int], None], api_key: str | None, max_body_bytes: int,
                 body_timeout: float) -> None:
        self.app = app
        self.routes = routes
        self.lifecycle = lifecycle
        self.count = count
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self._trimming: asyncio.Future | None = None
        self._inflight = 0
        self._idle_trim: asyncio.TimerHandle | None = None

    def route_of(self, scope: Scope) -> tuple[str, bool]:
        """The template of the route ``scope`` goes to (also on a wrong method), or ``unmatched``;
        and whether the route takes this method."""
        for route in self.routes():
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return getattr(route, "path", UNMATCHED), match is Match.FULL
        return UNMATCHED, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label, takes_method = self.route_of(scope)

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(label, message["status"])
            await send(message)

        try:
            receive = await self._admit(scope, receive, takes_method)
        except _Refuse as r:
            body = encode(error_body(r.message, r.status))
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       *r.headers]
            if r.close:
                headers.append((b"connection", b"close"))
            await counted_send({"type": "http.response.start", "status": r.status, "headers": headers})
            await counted_send({"type": "http.response.body", "body": body})
            return
        if receive is None:  # the client left while sending its body
            return
        self._inflight += 1
        if self._idle_trim is not None:
            self._idle_trim.cancel()
            self._idle_trim = None
        try:
            await self.app(scope, receive, counted_send)
        finally:
            self._inflight -= 1
            if getattr(receive, "body_size", 0) >= LARGE_BODY:
                self._trim_soon()
            elif self._inflight == 0:
                self._idle_trim = asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._trim_soon, True)

    def _trim_soon(self, collect: bool = False) -> None:
        """``release_free_memory`` on a worker thread, unless one runs already; ``collect`` (when idle):
        a full garbage collection first."""
        if self._trimming is None or self._trimming.done():
            self._trimming = asyncio.ensure_future(asyncio.to_thread(release_free_memory, collect))

    async def _admit(self, scope: Scope, receive: Receive, takes_method: bool) -> Receive | None:
        path = scope["path"]
        if path not in OPEN_PATHS:
            if self.lifecycle.draining:
                raise _Refuse(503, "the server is shutting down and takes no new requests", close=True)
            if self.expected_auth is not None:
                given = _header(scope, b"authorization") or b""
                if not secrets.compare_digest(given, self.expected_auth):
                    raise _Refuse(401, "missing or incorrect API key (send Authorization: Bearer KEY)",
                                  headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH") or not takes_method:
            return receive  # nothing to read (the app answers 404 / 405 without reading a body)
        ctype = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            shown = ctype.decode("latin-1") or "missing"
            raise _Refuse(415, f"Content-Type must be application/json (got {shown})")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _Refuse(413, f"request body too large: Content-Length {int(declared):,} is over this server's "
                          f"limit of {self.max_body_bytes:,} bytes (--max-request-bytes)", close=True)
        body = await self._read_body(receive)
        if body is None:
            return None
        return _replay(body, receive)

    async def _read_body(self, receive: Receive) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _Refuse(408, f"the request body did not arrive within {self.body_timeout:g} s "
                              "(--body-read-timeout)", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refuse(413, f"request body too large: more than this server's limit of "
                              f"{self.max_body_bytes:,} bytes (--max-request-bytes)", close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the whole body first, then defers to the client's (disconnects)."""
    pending: list[Any] = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    replay.body_size = len(body)  # type: ignore[attr-defined]
    return replay
