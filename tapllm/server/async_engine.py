"""The engine loop of the server: one background thread steps the engine; asyncio handlers await updates.

Handlers prepare a request (``InputProcessor.prepare``, off the event loop), then hand it to the
engine thread through a queue. The thread adds it, steps the engine while anything is in flight,
and after each step pushes every request's new tokens and text to that request's asyncio
queue (``call_soon_threadsafe``). Aborts (a client gone) travel the same queue.

A request that fails alone in the engine (``Request.error``) finishes with that error and
its type; the others go on. An exception of a whole step (rare: the engine isolates what
it can) fails the requests in flight instead of killing the thread; one that leaves the engine
dead for good (``runner.fatal_reason``: a tensor-parallel rank died, found by a step or while
idle) ends the thread, every request in flight gets a 503 naming it, and ``on_fatal`` has the
server exit. At shutdown, ``abort_all`` ends every request in flight at once from the event loop,
without waiting for the engine's current step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.llm_engine import LLMEngine
from tapllm.engine.request import Request
from tapllm.server.runner import LoopStats, Publisher, RequestObserver, Update, failed, fatal_reason

logger = logging.getLogger("tapllm")


@dataclass(slots=True)
class _Stream:
    """A prepared request on its way through the engine (``request`` once added), and where its updates go."""

    prepared: EngineCoreRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    publisher: Publisher = field(default_factory=Publisher)  # what each sample has sent so far
    request: Request | None = None


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread for concurrent asyncio clients.

    The inbox carries a ``_Stream`` (an ``EngineCoreRequest`` to add) or a request id to abort.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        engine.input_processor.grammars.warm_in_background()
        self.stats = LoopStats(engine.stats())
        self._inbox: queue.SimpleQueue[_Stream | str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tapllm-engine", daemon=True)
        # Loop side: the streams being awaited, so shutdown can end them without the thread.
        self._active: dict[str, _Stream] = {}
        self._closed: str | None = None  # set by abort_all: new requests fail with this message
        self.observer: RequestObserver | None = None  # set before start()
        self.on_fatal: Callable[[str], None] = lambda why: None  # set by the server: exit
        self.fatal: str | None = None  # why the engine died for good
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache."""
        return self.engine.blocks.num_blocks

    def start(self) -> None:
        """Start the engine thread (on the running event loop, if any: a fatal error is reported there)."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight are abandoned)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def abort_all(self, message: str) -> int:
        """End every request in flight now with a 503 error, and refuse later ones (event loop only).

        Returns how many were ended. The engine thread frees their memory at its next chance.
        """
        self._closed = message
        aborted = 0
        for rid, stream in list(self._active.items()):
            stream.queue.put_nowait(failed(message, "service_unavailable"))
            self._inbox.put(rid)
            aborted += 1
        self._active.clear()
        self._wake.set()
        self.stats.requests_aborted += aborted
        return aborted

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[Update]:
        """Add a request prepared by the input processor and yield its updates until it finishes.

        Leaving the iteration early (client gone, task cancelled) aborts the request, which
        frees its KV blocks and capture buffers, and counts it as aborted: whether or not the engine
        had finished it, its client never got the result.
        """
        if self._closed is not None:
            yield failed(self._closed, "service_unavailable")
            return
        rid = request.request_id
        stream = _Stream(request, asyncio.get_running_loop(), asyncio.Queue())
        self._active[rid] = stream
        self._inbox.put(stream)
        self._wake.set()
        finished = False
        try:
            while True:
                update = await stream.queue.get()
                finished = update.finished  # (abort_all has told the engine thread itself)
                yield update
                if finished:
                    return
        finally:
            if self._active.get(rid) is stream:  # else abort_all ended (and counted) it
                del self._active[rid]
                if not finished:
                    self.stats.requests_aborted += 1
            if not finished:
                self._inbox.put(rid)
                self._wake.set()

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            if not engine.has_unfinished_requests():
                self.stats.engine = engine.stats()
                engine.release_memory_if_idle()
                try:
                    engine.check_alive()
                except Exception as exc:
                    if (why := fatal_reason(exc)) is None:
                        raise
                    return self._die(why)
                self._wake.wait(timeout=0.5)
                continue
            try:
                engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, free its memory
                if (why := fatal_reason(exc)) is not None:
                    return self._die(why)
                logger.exception("engine step failed")
                self.stats.step_errors += 1
                for rid in list(self._streams):
                    engine.abort(rid)
                    self._push(self._streams.pop(rid), failed(f"engine error: {exc}", "server_error"))
                continue
            if self.observer is not None and engine.last_step_tokens:
                self.observer.step(engine.last_step_tokens)
            for stream in list(self._streams.values()):
                self._publish(stream)
            self.stats.engine = engine.stats()

    def _die(self, why: str) -> None:
        """The engine can never step again (engine thread): the thread ends; the event loop fails what is
        in flight and has the server exit."""
        logger.error("%s: failing the requests in flight and exiting", why)
        self.fatal = why
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail, why)
            return
        self._closed = f"{why}; the server is exiting"  # no event loop to tell: fail what the thread holds
        for stream in self._streams.values():
            self._push(stream, failed(self._closed, "service_unavailable"))

    def _fail(self, why: str) -> None:
        """Every request in flight, and every later one, ends with a 503 naming ``why`` (event loop)."""
        self._closed = f"{why}; the server is exiting"
        for stream in self._active.values():
            stream.queue.put_nowait(failed(self._closed, "service_unavailable"))
        self._active.clear()
        self.on_fatal(why)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                self._abort(item)
            else:
                self._add(item)

    def _add(self, stream: _Stream) -> None:
        try:
            req = stream.request = self.engine.add(stream.prepared)
        except Exception as exc:  # prepared before, so this is unexpected; it fails alone
            logger.exception("could not add request %s", stream.prepared.request_id)
            kind = "invalid_request_error" if isinstance(exc, ValueError | TypeError) else "server_error"
            self._push(stream, failed(str(exc), kind))
            return
        self._streams[req.request_id] = stream
        if req.group_finished:  # it failed alone as it was added (a reducer plugin's start())
            self._publish(stream)

    def _abort(self, rid: str) -> None:
        if self._streams.pop(rid, None) is not None:  # (generate and abort_all count and log the abort)
            self.engine.abort(rid)

    def _publish(self, stream: _Stream) -> None:
        """Push what the request produced since its last update (see ``Publisher.updates``)."""
        req = stream.request
        assert req is not None
        for update in stream.publisher.updates(self.engine, req, self.observer):
            if update.finished:
                del self._streams[req.request_id]
            self._push(stream, update)

    def _push(self, stream: _Stream, update: Update) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)
