"""Several API server processes in front of one engine core (``tapllm serve --api-server-count N``).

The parent process opens the listening socket (before anything loads: ``tapllm/cli/preflight.py``),
starts the core, then N API server processes that share that socket and accept on it (the kernel
spreads connections among them) and each talk to the core over their own ZMQ connection. Each
does HTTP, validation, tokenization, chat templates and the encoding of states for the requests it
accepted; each keeps its own Prometheus counters (the engine's gauges, read from the core, are
the same in all).

The parent forwards SIGTERM/SIGINT to the API servers (which sit in process groups of their
own, so a terminal's Ctrl-C reaches them once, through the parent); each drains as a single
server does. When every API server has exited the parent stops the core. If one exits on its
own (its core died, or it crashed) the parent stops the rest and exits with status 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from tapllm.server.core_client import CoreProcess

logger = logging.getLogger("tapllm")


def serve_many(count: int, cores: list[CoreProcess], sock: socket.socket, target: Callable[..., Any],
               args: tuple) -> int:
    """Run ``target(sock, addresses, pids, *args)`` in ``count`` processes until they end; the exit status.

    ``addresses`` and ``pids`` are the cores' (one per data-parallel replica).
    """
    ctx = multiprocessing.get_context("spawn")
    addresses, pids = [c.address for c in cores], [c.pid for c in cores]
    procs = [ctx.Process(target=_api_server_main, args=(target, sock, addresses, pids, *args),
                         name=f"tapllm-api-server-{i}") for i in range(count)]
    for p in procs:
        p.start()
    sock.close()  # the children hold it now
    received: list[int] = []

    def forward(sig: int, frame: Any) -> None:
        received.append(sig)
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                if p.exitcode is not None and p.exitcode != 0 and status == 0:
                    status = 1
                    if not received:  # not a shutdown: one failed on its own, so stop the others
                        logger.error("API server %s exited with status %s: stopping the others", p.name, p.exitcode)
                        forward(signal.SIGTERM, None)
                        forward(signal.SIGTERM, None)  # a second signal: abort at once
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if any(p.exitcode for p in procs):
        status = 1
    return status


def _exit_before_serving(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def _api_server_main(target: Callable[..., Any], sock: socket.socket, addresses: list[str], pids: list[int],
                     *args: Any) -> None:
    os.setpgid(0, 0)  # signals come from the parent, once (see the module docstring)
    for sig in (signal.SIGTERM, signal.SIGINT):  # until uvicorn serves (and installs its own): nothing to drain
        signal.signal(sig, _exit_before_serving)
    raise SystemExit(target(sock, addresses, pids, *args))
