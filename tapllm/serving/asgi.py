"""Running tapllm's ASGI app in-process, one request at a time, from plain data.

A Ray Serve replica holds the same FastAPI app ``tapllm serve`` runs (every route, check and
error the same), but its requests come from the front deployment as method calls, not as
HTTP on a socket. :func:`call_app` plays the server's part of the ASGI protocol for one
:class:`HTTPCall` and yields the response as it is sent (a :class:`ResponseStart`, then the
body's chunks), so a stream stays a stream. :class:`Lifespan` runs the app's startup and
shutdown (its engine thread starts and stops there).

Stopping the iteration early (the client went away: the front cancels the call) tells the app
the client disconnected, as uvicorn would, so the app aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# ASGI 2.3: the app learns of a disconnect by receiving ``http.disconnect``, which we send.
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_DRAIN_S = 5.0  # how long an app may take to end a request after its client left


@dataclass(frozen=True, slots=True)
class HTTPCall:
    """One HTTP request as plain, picklable data (it crosses between Ray actors)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """The status and headers of a response (the first item :func:`call_app` yields)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        """The value of header ``name`` (lower case), if present."""
        return next((v for k, v in self.headers if k.lower() == name), None)


async def call_app(app: Any, call: HTTPCall, state: dict[str, Any] | None = None
                   ) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``call`` through the ASGI ``app``; yield its :class:`ResponseStart`, then its body chunks.

    ``state`` is the lifespan's state (``Lifespan.state``), given to the request as a server would.
    """
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if not gone.is_set():  # after a disconnect, what the app still sends goes nowhere
            sent.put_nowait(message)

    scope = {
        "type": "http", "asgi": dict(_ASGI), "http_version": "1.1", "method": call.method.upper(),
        "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "query_string": call.query_string,
        "root_path": "", "headers": list(call.headers), "client": call.client, "server": ("tapllm-replica", 0),
        "state": dict(state or {}),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    started = False
    try:
        while True:
            message = await sent.get()
            if message is None:  # the app returned (or raised) before the body ended
                task.result()
                if not started:
                    raise RuntimeError(f"the app sent no response to {call.method} {call.path}")
                return
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(int(message["status"]), tuple((bytes(k), bytes(v))
                                                                  for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=_DRAIN_S)
            task.cancel()


class Lifespan:
    """The app's ASGI lifespan: :meth:`startup` runs its startup, :meth:`shutdown` its shutdown."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Future | None = None

    async def startup(self) -> None:
        """Run the app's startup; ``RuntimeError`` if it fails."""
        if self._task is not None:
            raise RuntimeError("the app was started already")
        scope = {"type": "lifespan", "asgi": dict(_ASGI), "state": self.state}
        self._task = asyncio.ensure_future(self.app(scope, self._inbox.get, self._outbox.put))
        await self._exchange("startup")

    async def shutdown(self) -> None:
        """Run the app's shutdown (nothing if it never started)."""
        if self._task is None or self._task.done():
            return
        await self._exchange("shutdown")
        await asyncio.wait({self._task}, timeout=_DRAIN_S)

    async def _exchange(self, phase: str) -> None:
        assert self._task is not None
        self._inbox.put_nowait({"type": f"lifespan.{phase}"})
        reply = asyncio.ensure_future(self._outbox.get())
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            self._task.result()  # raises what the app raised
            raise RuntimeError(f"the app ended during its lifespan {phase}")
        message = reply.result()
        if message["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"the app's lifespan {phase} failed: {message.get('message', message['type'])}")
