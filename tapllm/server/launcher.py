"""Running the app under uvicorn: header-read timeout, connection limits (in all and per client address),
and a bounded shutdown.

Shutdown, on SIGTERM or SIGINT:

1. The first signal stops the server taking work: the listening socket closes, idle
   keep-alive connections close, and any request that still arrives is answered 503
   (``Lifecycle.draining``). Requests in flight keep running.
2. After ``shutdown_timeout`` seconds (or at once on a second signal) whatever is still in
   flight is aborted: each stream gets an error event and ``data: [DONE]``, each other
   request a 503. The process exits as soon as those responses are written (uvicorn's own
   graceful timeout, a few seconds later, is the last resort for clients that do not read).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("tapllm")

# Seconds uvicorn waits past the abort for the last responses before it cancels their tasks.
_ABORT_FLUSH_S = 3.0
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BUSY_BODY = (b'{"error": {"message": "too many connections from this address (--max-connections-per-client)", '
              b'"type": "ServiceUnavailableError", "param": null, "code": 503}}')
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(_BUSY_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY_BODY)


@dataclass
class Lifecycle:
    """Shutdown state shared by the middleware (refuses new work) and the uvicorn server."""

    draining: bool = False
    abort_inflight: Callable[[str], int] = field(default=lambda message: 0)
    # Set by the server: abort what is in flight and exit with a failure status (the engine died).
    fail: Callable[[str], None] = field(default=lambda why: None)
    failed: str | None = None  # why the server is exiting on a failure


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and a limit of connections per client address.

    Header timeout: the clock starts when the connection is made and again after each response (a
    kept-alive connection waits for its next request). A connection whose request headers are still
    incomplete when it runs out is closed (with a 408 if it had sent part of them), so half-open
    connections cannot be held; requests in progress are not affected.

    Per-client limit: a connection from an address that already holds ``max_per_client`` is answered
    503 and closed as it is made. It is counted here, when the connection is made, because that is
    where a half-open connection starts to hold its place: uvicorn's ``limit_concurrency`` counts every
    open connection towards one total (one client's half-open connections fill it for everyone), and
    an ASGI middleware sees a request only once its headers are complete, which theirs never are.
    """

    header_timeout: float = 10.0
    max_per_client: int | None = None
    # Open connections by client address, and the addresses refused since they reached the limit (warned
    # about once); one of each per server (``guarded_protocol`` makes the class).
    per_client: ClassVar[Counter[str]] = Counter()
    at_limit: ClassVar[set[str]] = set()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._partial = False
        self._peer: str | None = None
        self._refused = False
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else None  # None on a Unix socket
        if host is not None and self.max_per_client is not None:
            if self.per_client[host] >= self.max_per_client:
                self._refuse(transport, host)
                return
            self.per_client[host] += 1
            self._peer = host
        super().connection_made(transport)
        self._arm_header_timer()

    def _refuse(self, transport: asyncio.Transport, host: str) -> None:
        """Answer 503 and close, before the connection counts anywhere (uvicorn never sees it)."""
        self._refused = True
        if host not in self.at_limit:  # once each time the address reaches its limit
            self.at_limit.add(host)
            logger.warning("%s holds %d connections (--max-connections-per-client): refusing more",
                           host, self.max_per_client)
        transport.write(_BUSY_RESPONSE)
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:
            self._partial = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._partial = False
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_header_timer()
        if self._peer is not None:
            self.per_client[self._peer] -= 1
            if not self.per_client[self._peer]:
                del self.per_client[self._peer]
            self.at_limit.discard(self._peer)
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed already, or a request is in progress: not ours to time
        if self._partial:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def guarded_protocol(header_timeout: float, max_per_client: int | None) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` subclass with these limits and its own per-client table, for
    ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout": float(header_timeout), "max_per_client": max_per_client, "per_client": Counter(),
        "at_limit": set()})


class TapllmServer(uvicorn.Server):
    """``uvicorn.Server`` with a bounded, two-stage shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout = shutdown_timeout
        self.signals_received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self._aborted = False
        lifecycle.fail = self.fail

    def fail(self, why: str) -> None:
        """Abort what is in flight and exit (from the event loop's thread); ``run`` then returns 1."""
        self.lifecycle.failed = why
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._abort, why)

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread (the loop's) between bytecodes: defer the work to the loop.
        self.signals_received += 1
        first = self.signals_received == 1
        if first:
            self.should_exit = True
        if self._loop is None:  # not serving yet
            self.force_exit = not first
            return
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        self._loop.call_soon_threadsafe(self._drain if first else self._abort, name)

    def _drain(self, signame: str) -> None:
        self.lifecycle.draining = True
        logger.warning("%s: not accepting new requests; requests in flight have %.1f s to finish "
                       "(send the signal again to abort them now)", signame, self.shutdown_timeout)
        assert self._loop is not None
        self._abort_timer = self._loop.call_later(self.shutdown_timeout, self._abort, "shutdown timeout")

    def _abort(self, why: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        self.lifecycle.draining = True
        self.should_exit = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        n = self.lifecycle.abort_inflight(f"the server is shutting down ({why}): request aborted")
        logger.warning("%s: aborted %d request(s) in flight", why, n)
        assert self._loop is not None
        self._loop.call_later(_ABORT_FLUSH_S, self._give_up)

    def _give_up(self) -> None:
        self.force_exit = True


def run(app: Any, lifecycle: Lifecycle, *, host: str, port: int, log_level: str, shutdown_timeout: float,
        keep_alive_timeout: float, header_read_timeout: float, max_connections: int | None,
        max_connections_per_client: int | None = None, sock: socket.socket | None = None) -> int:
    """Serve ``app`` until a signal stops it (0) or its engine dies (1); the exit status.

    ``sock``: a listening socket to accept on (shared by several API server processes) instead
    of binding ``host:port``.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        http=guarded_protocol(header_read_timeout, max_connections_per_client),
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]  # uvicorn takes a float fine
        limit_concurrency=max_connections,
        # Our own abort comes at shutdown_timeout; uvicorn cancels what still hangs after that.
        timeout_graceful_shutdown=int(shutdown_timeout + 2 * _ABORT_FLUSH_S + 1),
    )
    TapllmServer(config, lifecycle, shutdown_timeout).run(sockets=[sock] if sock is not None else None)
    if lifecycle.failed is not None:
        logger.error("exiting: %s", lifecycle.failed)
        return 1
    return 0
