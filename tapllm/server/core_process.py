"""The engine core in its own process: adds, steps and aborts requests for API server processes.

One ``LLMEngine`` runs here, in a loop that reads the API servers' messages (a ZMQ ROUTER
socket: each API server is a DEALER with an identity of its own) whenever the engine is idle
or between steps, runs a step while anything is in flight, and sends each API server one
``Outputs`` message per step with the updates of its requests (``tapllm.server.ipc``).

Admission ran in the API server (refusals are its 400s) and prepared each request once: what
arrives here is its ``EngineCoreRequest``, which the engine's ``add`` only turns into device
state (tensors and SAEs on this process's device, a grammar matcher) and schedules. Stop
strings are checked where tokens are sampled, so the text of each update is made here; the
API server encodes everything else (states, logprobs, JSON, SSE).

The core ignores SIGINT and SIGTERM: the API server drains its requests on a signal and then
sends :class:`~tapllm.server.ipc.Shutdown`. It also exits when its parent process is gone, and
when its engine died for good (a tensor-parallel rank died: ``runner.fatal_reason``, found by a
step or while idle): it then tells every API server why (:class:`~tapllm.server.ipc.Fatal`; they
answer 503 and exit) and exits with status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.llm_engine import LLMEngine
from tapllm.engine.request import Request
from tapllm.server import ipc
from tapllm.server.records import FinishedRecord
from tapllm.server.runner import Publisher, Update, fatal_reason

logger = logging.getLogger("tapllm")

_IDLE_POLL_MS = 500  # how long an idle core waits for a message before it sends its figures again


@dataclass(slots=True)
class _Stream:
    """A request in the engine, and the API server waiting for it."""

    request: Request
    identity: bytes
    publisher: Publisher = field(default_factory=Publisher)


class _Observer:
    """Collects what the latency metrics of one API server are to be told (``RequestObserver``)."""

    def __init__(self) -> None:
        self.observed = ipc.Observed([], [], [])

    def inter_token(self, seconds: float, count: int) -> None:
        self.observed.inter_token.append((seconds, count))

    def finished(self, record: FinishedRecord) -> None:
        self.observed.finished.append(record)

    def step(self, tokens: int) -> None:
        self.observed.steps.append(tokens)


class EngineCore:
    """Serves one engine to the API servers connected to ``address`` (see the module docstring)."""

    def __init__(self, engine: LLMEngine, address: str, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.bind(address)
        self.streams: dict[str, _Stream] = {}
        self.clients: set[bytes] = set()
        self.step_errors = 0
        self.fatal: str | None = None  # why the engine died for good (the process then exits with 1)
        self._stop = False
        self._last_sent = 0.0

    def run(self) -> None:
        """Serve until told to stop or the parent process is gone."""
        engine = self.engine
        try:
            while not self._stop:
                busy = engine.has_unfinished_requests()
                if self.sock.poll(0 if busy else _IDLE_POLL_MS):
                    self._drain()
                if self._stop or self._orphaned():
                    break
                if engine.has_unfinished_requests():
                    self._step()
                    continue
                if time.monotonic() - self._last_sent > _IDLE_POLL_MS / 1000:
                    self._check_alive()
                    if self._stop:
                        break
                    self._send_figures()
                engine.release_memory_if_idle()
        finally:
            self.sock.close()
            self.ctx.term()
            ipc.unlink_leftovers(os.getpid())

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # ---- messages in ------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, msg = frames[0].bytes, ipc.decode_inbound(frames[1].buffer)
            if isinstance(msg, ipc.AddRequest):
                self._add(identity, msg, ipc.unpack_payload(frames[1:]))
            elif isinstance(msg, ipc.Abort):
                for rid in msg.request_ids:
                    self._abort(rid)
            elif isinstance(msg, ipc.Hello):
                self.clients.add(identity)
                self._send(identity, ipc.Ready(self.engine.blocks.num_blocks, self.engine.context_limited_by_cache,
                                                {k: list(v) for k, v in self.engine.input_processor.point_shapes.items()}),
                           self.engine.model_config)
            elif isinstance(msg, ipc.Shutdown):
                self._stop = True

    def _add(self, identity: bytes, msg: ipc.AddRequest, prepared: EngineCoreRequest) -> None:
        try:
            req = self.engine.add(prepared)
        except Exception as exc:  # admitted by the API server, so this is unexpected; it fails alone
            logger.exception("could not add request %s", msg.request_id)
            kind = "invalid_request_error" if isinstance(exc, ValueError | TypeError) else "server_error"
            update = Update("", [], None, True, error=str(exc), error_type=kind)
            self._send_updates({identity: [(msg.request_id, update)]}, {})
            return
        stream = self.streams[req.request_id] = _Stream(req, identity)
        if req.group_finished:  # it failed alone as it was added (a reducer plugin's start())
            self._publish([stream])

    def _abort(self, rid: str) -> None:
        if self.streams.pop(rid, None) is not None:  # (the API server counts and logs the abort)
            self.engine.abort(rid)

    # ---- the step and messages out ----------------------------------------------------------
    def _step(self) -> None:
        engine = self.engine
        try:
            engine.step()
        except Exception as exc:  # keep serving: fail what was in flight, free its memory
            why = fatal_reason(exc)
            if why is not None:
                self._die(why)
                return
            logger.exception("engine step failed")
            self.step_errors += 1
            out: dict[bytes, list[tuple[str, Update]]] = {}
            for rid, stream in list(self.streams.items()):
                engine.abort(rid)
                del self.streams[rid]
                out.setdefault(stream.identity, []).append(
                    (rid, Update("", [], None, True, error=f"engine error: {exc}", error_type="server_error")))
            self._send_updates(out, {})
            return
        observers: dict[bytes, _Observer] = {}
        streams = list(self.streams.values())
        if engine.last_step_tokens and streams:  # counted once, by the server of the first request
            observers.setdefault(streams[0].identity, _Observer()).step(engine.last_step_tokens)
        self._publish(streams, observers)

    def _check_alive(self) -> None:
        try:
            self.engine.check_alive()
        except Exception as exc:
            why = fatal_reason(exc)
            if why is None:
                raise
            self._die(why)

    def _die(self, why: str) -> None:
        """The engine can never step again: tell every API server (each fails its requests with a 503 and
        exits) and stop."""
        logger.error("%s: the engine core is exiting", why)
        self.fatal = why
        self._stop = True
        for identity in self.clients | {s.identity for s in self.streams.values()}:
            self._send(identity, ipc.Fatal(why))
        self.streams.clear()

    def _publish(self, streams: list[_Stream], observers: dict[bytes, _Observer] | None = None) -> None:
        observers = {} if observers is None else observers
        out: dict[bytes, list[tuple[str, Update]]] = {}
        for stream in streams:
            observer = observers.setdefault(stream.identity, _Observer())
            req = stream.request
            for update in stream.publisher.updates(self.engine, req, observer):
                if update.finished:
                    self.streams.pop(req.request_id, None)
                out.setdefault(stream.identity, []).append((req.request_id, update))
        self._send_updates(out, observers)

    def _send_updates(self, out: dict[bytes, list[tuple[str, Update]]], observers: dict[bytes, _Observer]) -> None:
        stats = self.engine.stats()
        for identity in set(out) | set(observers):
            msgs, payload = [], []
            for rid, u in out.get(identity, []):
                heavy = u.logprobs is not None or u.output is not None
                msgs.append(ipc.UpdateMsg(rid, u.text, u.token_ids, u.index, u.finished, u.error, u.error_type,
                                           heavy))
                if heavy:
                    payload.append((u.logprobs, u.output))
            obs = observers.get(identity)
            header = ipc.Outputs(msgs, stats, self.step_errors,
                                  obs.observed if obs is not None else None)
            self._send(identity, header, payload or None)

    def _send_figures(self) -> None:
        stats = self.engine.stats()
        for identity in self.clients:
            self._send(identity, ipc.Outputs([], stats, self.step_errors))

    def _send(self, identity: bytes, header: Any, payload: Any = None) -> None:
        self._last_sent = time.monotonic()
        try:
            self.sock.send_multipart([identity, *ipc.pack(header, payload)], copy=False)
        except zmq.ZMQError as exc:  # an API server gone: its requests are aborted when it says so, or at exit
            logger.warning("could not send to an API server: %s", exc)


def run_core(config: Any, sae_entries: list[str], address: str, parent_pid: int, quiet: bool,
             cpus: list[int] | None = None, index: int = 0) -> None:
    """The engine-core process's entry point (``multiprocessing`` spawn target).

    ``cpus``: the cores this replica's threads are pinned to (data parallelism: each its share).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when to stop (see the module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format=f"%(asctime)s %(levelname)s [core {index}] %(message)s")
    if cpus:
        import torch

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
        logger.info("engine core %d pinned to CPUs %s", index, cpus)
    from tapllm.sae.features import register_sae

    for entry in sae_entries:
        name, _, path = entry.partition("=")
        register_sae(name, path)
    engine = LLMEngine.from_config(config)
    engine.input_processor.grammars.warm_in_background()
    core = EngineCore(engine, address, parent_pid)
    try:
        core.run()
    finally:
        engine.close()  # the tensor-parallel ranks, if any
    if core.fatal is not None:
        raise SystemExit(1)
