"""The API server's side of the engine-core process: start it, connect to it, run requests on it.

:class:`CoreProcess` spawns the core (``tapllm.server.core_process``) with a private IPC
address and stops it. :func:`connect` makes a DEALER socket, says hello and waits for the core
to be ready (or to die while loading: an error, not a hang). :class:`CoreClient` is the routes'
``EngineRunner`` over that socket: one task reads the core's messages and hands each update to
its request's queue; a watchdog notices a dead core, ends every request in flight with a 503
and has the server exit.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from tapllm.engine.llm_engine import EngineStats
from tapllm.engine.request import Request
from tapllm.server import wire
from tapllm.server.frontend import EngineFrontend
from tapllm.server.runner import LoopStats, RequestObserver, Update, failed

logger = logging.getLogger("tapllm")

_WATCH_S = 0.25  # how often the watchdog looks at the core process


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a dead child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class CoreProcess:
    """The engine-core process of one server (spawned, so no thread or lock state is inherited)."""

    def __init__(self, config: Any, sae_entries: list[str], quiet: bool) -> None:
        from tapllm.server.core_process import run_core

        self.folder = tempfile.mkdtemp(prefix="tapllm-core-")  # mode 0700: only this user reaches the socket
        self.address = f"ipc://{self.folder}/core.sock"
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_core, args=(config, sae_entries, self.address, os.getpid(), quiet),
                                name="tapllm-engine-core", daemon=False)
        self.proc.start()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        """Tell the core to stop (if it still runs), wait for it, kill it if it hangs; its exit code."""
        if self.proc.is_alive():
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 500)
            sock.connect(self.address)
            sock.send_multipart(wire.pack(wire.Shutdown()))
            self.proc.join(timeout)
            sock.close()
            if self.proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it", timeout)
                self.proc.kill()
                self.proc.join(5)
        wire.unlink_leftovers(self.pid)
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.proc.exitcode


def connect(address: str, core_pid: int, config: Any, timeout: float = 600.0) -> CoreClient:
    """Say hello to the core at ``address`` and wait until it is ready (``timeout`` covers loading the model)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"api-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart(wire.pack(wire.Hello()))
    deadline = time.monotonic() + timeout
    while not sock.poll(200):
        if not pid_alive(core_pid):
            sock.close()
            raise RuntimeError("the engine core process exited while loading the model (its error is above)")
        if time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")
    frames = sock.recv_multipart(copy=False)
    ready = wire.decode_outbound(frames[0].buffer)
    assert isinstance(ready, wire.Ready), ready
    model_config = wire.unpack_payload(frames)
    shapes = {k: tuple(v) for k, v in ready.point_shapes.items()}
    frontend = EngineFrontend(config, model_config, shapes, ready.context_limited_by_cache)
    return CoreClient(ctx, sock, core_pid, frontend, ready.num_kv_blocks)


class CoreClient:
    """Runs prepared requests on the engine-core process (an ``EngineRunner``; see the module docstring)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, core_pid: int, frontend: EngineFrontend,
                 num_kv_blocks: int) -> None:
        self.engine = frontend
        self.stats = LoopStats(EngineStats(0, 0, 0.0, 0, 0, 0))
        self.observer: RequestObserver | None = None
        self.on_core_death: Callable[[str], None] = lambda why: None  # set by the server: exit
        self.core_pid = core_pid
        self._ctx, self._sync_sock = ctx, sock
        self._sock: zmq.asyncio.Socket | None = None
        self._num_kv_blocks = num_kv_blocks
        self._queues: dict[str, asyncio.Queue[Update]] = {}
        self._closed: str | None = None
        self._dead = False
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        """Whether the core process runs."""
        return not self._dead

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the core's KV cache."""
        return self._num_kv_blocks

    def start(self) -> None:
        """Start reading the core's messages and watching its process (on the running event loop)."""
        self._sock = zmq.asyncio.Socket.shadow(self._sync_sock.underlying)
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    def shutdown(self) -> None:
        """Stop reading (the core itself is stopped by whoever started it)."""
        for t in self._tasks:
            t.cancel()
        self._sync_sock.close(linger=0)
        self._ctx.term()

    def abort_all(self, message: str) -> int:
        """End every request in flight now with a 503 error and refuse later ones; how many were ended."""
        self._closed = message
        rids = list(self._queues)
        for rid in rids:
            self._queues.pop(rid).put_nowait(failed(message, "service_unavailable"))
        if rids and not self._dead:
            self._send(wire.Abort(rids))
        return len(rids)

    async def generate(self, request: Request) -> AsyncIterator[Update]:
        """Send a request prepared by admission to the core and yield its updates until it finishes.

        Leaving the iteration early (client gone, task cancelled) aborts it in the core.
        """
        if self._closed is not None:
            yield failed(self._closed, "service_unavailable")
            return
        rid = request.request_id
        if rid in self._queues:
            yield failed(f"request_id {rid!r} is already in flight", "invalid_request_error")
            return
        queue: asyncio.Queue[Update] = asyncio.Queue()
        self._queues[rid] = queue
        prompt = request.prompt if isinstance(request.prompt, str) else None
        self._send(wire.AddRequest(rid, prompt, list(request.prompt_token_ids), request.encode_only,
                                   request.times.arrival), request.params)
        finished = False
        try:
            while True:
                update = await queue.get()
                finished = update.finished
                yield update
                if finished:
                    return
        finally:
            if self._queues.get(rid) is queue:
                del self._queues[rid]
            if not finished and not self._dead:
                self._send(wire.Abort([rid]))

    def _send(self, header: Any, payload: Any = None) -> None:
        assert self._sock is not None
        self._sock.send_multipart(wire.pack(header, payload), copy=False)

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                self._dispatch(frames)
            except Exception:  # one bad message must not stop the server's reading
                logger.exception("could not read a message of the engine core")

    def _dispatch(self, frames: list[Any]) -> None:
        msg = wire.decode_outbound(frames[0].buffer)
        if not isinstance(msg, wire.Outputs):
            return
        s = self.stats
        s.engine, s.requests_aborted, s.step_errors = msg.stats, msg.requests_aborted, msg.step_errors
        if msg.observed is not None and self.observer is not None:
            self._observe(msg.observed)
        payload = iter(wire.unpack_payload(frames) or ())
        for u in msg.updates:
            logprobs, output = next(payload) if u.has_payload else (None, None)
            queue = self._queues.get(u.request_id)
            if queue is None:  # aborted here meanwhile
                continue
            if u.finished:
                del self._queues[u.request_id]
            queue.put_nowait(Update(u.text, u.token_ids, logprobs, u.finished, output, u.error, u.error_type,
                                    u.index))

    def _observe(self, observed: wire.Observed) -> None:
        observer = self.observer
        assert observer is not None
        try:
            for tokens in observed.steps:
                observer.step(tokens)
            for seconds, count in observed.inter_token:
                observer.inter_token(seconds, count)
            for record in observed.finished:
                observer.finished(record)
        except Exception:  # metrics must never stop the server
            logger.exception("recording the engine core's metrics failed")

    async def _watch(self) -> None:
        while pid_alive(self.core_pid):
            await asyncio.sleep(_WATCH_S)
        self._dead = True
        why = f"the engine core process (pid {self.core_pid}) died"
        logger.error("%s: failing the requests in flight and exiting", why)
        self.abort_all(f"{why}: request aborted")
        self.on_core_death(why)
