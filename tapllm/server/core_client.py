"""The API server's side of the engine-core process: start it, connect to it, run requests on it.

:class:`CoreProcess` spawns the core (``tapllm.server.core_process``) with a private IPC
address and stops it. :func:`connect` makes a DEALER socket, says hello and waits for the core
to be ready (or to die while loading: an error, not a hang). :class:`CoreClient` is the routes'
``EngineRunner`` over that socket: one task reads the core's messages and hands each update to
its request's queue; a watchdog notices a dead core, ends every request in flight with a 503
and has the server exit. A core whose engine died for good says why before it exits
(``ipc.Fatal``): the same 503s and exit, with that reason.
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
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.llm_engine import EngineStats
from tapllm.server import ipc
from tapllm.server.frontend import EngineFrontend
from tapllm.server.router import PrefixRouter
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

    def __init__(self, config: Any, sae_entries: list[str], quiet: bool, cpus: list[int] | None = None,
                 index: int = 0) -> None:
        from tapllm.server.core_process import run_core

        self.folder = tempfile.mkdtemp(prefix="tapllm-core-")  # mode 0700: only this user reaches the socket
        self.address = f"ipc://{self.folder}/core.sock"
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_core, args=(config, sae_entries, self.address, os.getpid(), quiet, cpus, index),
                                name=f"tapllm-engine-core-{index}", daemon=False)
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
            sock.send_multipart(ipc.pack(ipc.Shutdown()))
            self.proc.join(timeout)
            sock.close()
            if self.proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s: killing it", timeout)
                self.proc.kill()
                self.proc.join(5)
        ipc.unlink_leftovers(self.pid)
        shutil.rmtree(self.folder, ignore_errors=True)
        return self.proc.exitcode


def connect(addresses: list[str], core_pids: list[int], config: Any, timeout: float = 600.0) -> CoreClient:
    """Say hello to each core (one per data-parallel replica) and wait until all are ready.

    ``timeout`` covers loading the model; a core that dies meanwhile is an error, not a hang.
    """
    ctx = zmq.Context()
    socks = []
    identity = f"api-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode()
    for address in addresses:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(ipc.pack(ipc.Hello()))
        socks.append(sock)
    deadline = time.monotonic() + timeout
    readies = []
    for sock, pid in zip(socks, core_pids, strict=True):
        while not sock.poll(200):
            if not pid_alive(pid) or time.monotonic() > deadline:
                for s in socks:
                    s.close()
                ctx.term()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")
                raise RuntimeError(f"the engine core process {pid} exited while loading the model (its error is "
                                   "in the log above)")
        frames = sock.recv_multipart(copy=False)
        ready = ipc.decode_outbound(frames[0].buffer)
        assert isinstance(ready, ipc.Ready), ready
        readies.append((ready, ipc.unpack_payload(frames)))
    ready, model_config = readies[0]
    shapes = {k: tuple(v) for k, v in ready.point_shapes.items()}
    frontend = EngineFrontend(config, model_config, shapes, ready.context_limited_by_cache)
    replicas = [_Replica(sock, pid) for sock, pid in zip(socks, core_pids, strict=True)]
    return CoreClient(ctx, replicas, frontend, ready.num_kv_blocks)


@dataclass(slots=True)
class _Replica:
    """One engine-core process and what it last reported."""

    sync_sock: zmq.Socket
    pid: int
    sock: zmq.asyncio.Socket | None = None
    stats: EngineStats = field(default_factory=lambda: EngineStats(0, 0, 0.0, 0, 0, 0))
    step_errors: int = 0


class CoreClient:
    """Runs prepared requests on engine-core processes (an ``EngineRunner``; see the module docstring).

    With several cores (data-parallel replicas) a :class:`PrefixRouter` picks each request's;
    ``stats`` then sums theirs (the KV cache usage is their mean).
    """

    def __init__(self, ctx: zmq.Context, replicas: list[_Replica], frontend: EngineFrontend,
                 num_kv_blocks: int) -> None:
        self.engine = frontend
        self.stats = LoopStats(EngineStats(0, 0, 0.0, 0, 0, 0))
        self.observer: RequestObserver | None = None
        self.on_fatal: Callable[[str], None] = lambda why: None  # set by the server: exit
        self.replicas = replicas
        self.router = PrefixRouter(len(replicas), frontend.config.block_size)
        self._ctx = ctx
        self._num_kv_blocks = num_kv_blocks
        self._queues: dict[str, asyncio.Queue[Update]] = {}
        self._where: dict[str, int] = {}  # request id -> replica
        self._closed: str | None = None
        self._dead = False
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        """Whether every core process runs."""
        return not self._dead

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of each core's KV cache."""
        return self._num_kv_blocks

    def replica_figures(self) -> list[tuple[int, int, int, int]]:
        """Per replica: requests routed there, of them by prefix affinity, prefix-cache hit and queried tokens."""
        return [(load.routed, load.affinity_routed, r.stats.prefix_cache_hit_tokens, r.stats.prefix_cache_queried_tokens)
                for load, r in zip(self.router.replicas, self.replicas, strict=True)]

    def start(self) -> None:
        """Start reading the cores' messages and watching their processes (on the running event loop)."""
        for i, r in enumerate(self.replicas):
            r.sock = zmq.asyncio.Socket.shadow(r.sync_sock.underlying)
            self._tasks.append(asyncio.ensure_future(self._read(i)))
        self._tasks.append(asyncio.ensure_future(self._watch()))

    def shutdown(self) -> None:
        """Stop reading (the cores themselves are stopped by whoever started them)."""
        for t in self._tasks:
            t.cancel()
        for r in self.replicas:
            r.sync_sock.close(linger=0)
        self._ctx.term()

    def abort_all(self, message: str) -> int:
        """End every request in flight now with a 503 error and refuse later ones; how many were ended
        (counted as aborted unless the core died: those failed)."""
        self._closed = message
        rids = list(self._queues)
        for rid in rids:
            self._queues.pop(rid).put_nowait(failed(message, "service_unavailable"))
            self._release(rid, abort=not self._dead)
        if not self._dead:
            self.stats.requests_aborted += len(rids)
        return len(rids)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[Update]:
        """Send a request prepared by admission to a core and yield its updates until it finishes.

        Leaving the iteration early (client gone, task cancelled) aborts it in the core, and counts it as
        aborted: whether or not the core had finished it, its client never got the result.
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
        replica = self._where[rid] = self.router.choose(request.prompt_token_ids)
        self._send(replica, ipc.AddRequest(rid), request)
        finished = False
        try:
            while True:
                update = await queue.get()
                finished = update.finished
                yield update
                if finished:
                    return
        finally:
            if self._queues.get(rid) is queue:  # else abort_all ended (and counted) it
                del self._queues[rid]
                if not finished and not self._dead:
                    self.stats.requests_aborted += 1
            self._release(rid, abort=not finished and not self._dead)

    def _release(self, rid: str, abort: bool) -> None:
        replica = self._where.pop(rid, None)
        if replica is None:
            return
        self.router.done(replica)
        if abort:
            self._send(replica, ipc.Abort([rid]))

    def _send(self, replica: int, header: Any, payload: Any = None) -> None:
        sock = self.replicas[replica].sock
        assert sock is not None
        sock.send_multipart(ipc.pack(header, payload), copy=False)

    async def _read(self, replica: int) -> None:
        sock = self.replicas[replica].sock
        assert sock is not None
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                self._dispatch(replica, frames)
            except Exception:  # one bad message must not stop the server's reading
                logger.exception("could not read a message of the engine core")

    def _dispatch(self, replica: int, frames: list[Any]) -> None:
        msg = ipc.decode_outbound(frames[0].buffer)
        if isinstance(msg, ipc.Fatal):
            self._fail(msg.reason)
            return
        if not isinstance(msg, ipc.Outputs):
            return
        r = self.replicas[replica]
        r.stats, r.step_errors = msg.stats, msg.step_errors
        self._sum_stats()
        if msg.observed is not None and self.observer is not None:
            self._observe(msg.observed)
        payload = iter(ipc.unpack_payload(frames) or ())
        for u in msg.updates:
            logprobs, output = next(payload) if u.has_payload else (None, None)
            queue = self._queues.get(u.request_id)
            if queue is None:  # aborted here meanwhile
                continue
            if u.finished:  # its queue stays until its reader has taken this (or left: an abort)
                self._release(u.request_id, abort=False)
            queue.put_nowait(Update(u.text, u.token_ids, logprobs, u.finished, output, u.error, u.error_type,
                                    u.index))

    def _sum_stats(self) -> None:
        rs = self.replicas
        s = [r.stats for r in rs]
        self.stats.engine = EngineStats(
            sum(x.running for x in s), sum(x.waiting for x in s), sum(x.kv_cache_usage for x in s) / len(s),
            sum(x.prefix_cache_hit_tokens for x in s), sum(x.prefix_cache_queried_tokens for x in s),
            sum(x.generated_tokens for x in s), sum(x.graph_steps for x in s),
            dict(sum((Counter(x.graph_fallbacks) for x in s), Counter())))
        self.stats.step_errors = sum(r.step_errors for r in rs)

    def _observe(self, observed: ipc.Observed) -> None:
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
        while True:
            dead = [r.pid for r in self.replicas if not pid_alive(r.pid)]
            if dead:
                break
            await asyncio.sleep(_WATCH_S)
        await asyncio.sleep(_WATCH_S)  # a core that exited on purpose said why just before: read that first
        self._fail(f"the engine core process (pid {dead[0]}) died")

    def _fail(self, why: str) -> None:
        """The engine is gone: end every request in flight with a 503 naming ``why``, refuse later ones, and
        have the server exit (once)."""
        if self._dead:
            return
        self._dead = True
        logger.error("%s: failing the requests in flight and exiting", why)
        self.abort_all(f"{why}; the server is exiting")
        self.on_fatal(why)
