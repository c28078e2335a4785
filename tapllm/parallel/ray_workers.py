"""Ranks 1..N-1 as Ray actors (``distributed_executor_backend="ray"``), so the ranks may span machines.

A placement group reserves one bundle (one CPU) per worker rank, packed onto as few nodes as it can
(``PACK``: one node where it has room, several otherwise). Each actor runs the very loop of a
spawned worker (:func:`tapllm.parallel.worker.serve_rank`), over a TCP connection back to rank 0
(``multiprocessing.connection``, authenticated by a random key) instead of a pipe, so rank 0
drives both kinds of workers alike. That connection and the group's rendezvous (rank 0's
``TCPStore``) are served on this node's IP as Ray knows it, so actors on other nodes reach them.

Ray is imported only here, and this module only when the ray backend is asked for. Rank 0 joins
the Ray that is already initialised in its process, else the cluster at ``$RAY_ADDRESS``, else it
starts a Ray instance on this machine (:func:`tapllm.utils.ray_connect.connect`).
"""

from __future__ import annotations

import os
import socket
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

from tapllm.parallel.group import TensorParallelError
from tapllm.parallel.worker import WorkerArgs, serve_rank
from tapllm.utils.ray_connect import connect

PLACEMENT_STRATEGY = "PACK"
CPUS_PER_RANK = 1


class RankActor:
    """The Ray actor of one worker rank."""

    def run(self, args: WorkerArgs, address: tuple[str, int], authkey: bytes) -> int:
        """Connect back to rank 0, say which rank this is, then serve as a spawned worker does;
        returns the loop's exit status (0, or 1 after the error went to rank 0)."""
        import ray

        conn = Client(address, authkey=authkey)
        try:
            conn.send(("rank", args.rank, os.getpid(), ray.util.get_node_ip_address()))
            return serve_rank(args, conn)
        finally:
            conn.close()


class RayRank:
    """One worker rank's actor as rank 0 sees it: the part of ``multiprocessing.Process`` the driver
    uses (``pid``, ``is_alive``, ``exitcode``, ``join``, ``terminate``, ``kill``) and ``ended``."""

    def __init__(self, ray: Any, actor: Any, ref: Any) -> None:
        self.ray, self.actor, self.ref = ray, actor, ref
        self.pid: int | None = None  # the actor's process and node, once it has connected
        self.node_ip: str | None = None

    def is_alive(self) -> bool:
        """Whether the rank's loop still runs (its actor may outlive it until it is killed)."""
        if not self.ray.is_initialized():  # Ray was shut down: its actors with it
            return False
        ready, _ = self.ray.wait([self.ref], timeout=0)
        return not ready

    def _result(self) -> tuple[int | None, str | None]:
        try:
            return self.ray.get(self.ref, timeout=0), None
        except self.ray.exceptions.RayActorError as exc:
            lines = str(exc).strip().splitlines()
            return None, lines[0] if lines else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - a task error or a timeout, told as it is
            return None, f"{type(exc).__name__}: {exc}"

    @property
    def exitcode(self) -> int | None:
        """The loop's exit status once it returned, else None (running, or its actor died)."""
        return None if self.is_alive() else self._result()[0]

    def ended(self) -> str:
        """How the rank ended, for an error message."""
        where = f"(Ray actor, pid {self.pid} on {self.node_ip})"
        code, why = self._result()
        return f"{where} exited with code {code}" if why is None else f"{where} died: {why}"

    def join(self, timeout: float | None = None) -> None:
        if self.is_alive():
            self.ray.wait([self.ref], timeout=timeout)

    def terminate(self) -> None:
        if self.ray.is_initialized():
            self.ray.kill(self.actor, no_restart=True)

    kill = terminate


class RayWorkers:
    """The actors and placement group of one engine's worker ranks."""

    def __init__(self, workers: int) -> None:
        self.ray = connect(os.environ.get("RAY_ADDRESS") or "local", workers)
        self.host: str = self.ray.util.get_node_ip_address()  # where the actors reach rank 0
        self.pg: Any = None
        self.ranks: list[RayRank] = []

    def start(self, args: list[WorkerArgs], timeout_s: float) -> tuple[list[RayRank], list[Connection]]:
        """Place and start one actor per ``args`` (ranks 1..N-1 in order); their ranks and connections in
        rank order, once each has connected (the rank's hello follows on its connection)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        self.pg = placement_group([{"CPU": CPUS_PER_RANK}] * len(args), strategy=PLACEMENT_STRATEGY)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TensorParallelError(
                f"Ray could not place {len(args)} worker ranks of {CPUS_PER_RANK} CPU each within {timeout_s:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()})") from None
        authkey = os.urandom(32)
        with socket.create_server((self.host, 0)) as server:
            server.settimeout(0.2)
            actor_class = ray.remote(num_cpus=CPUS_PER_RANK, max_restarts=0)(RankActor)
            for i, a in enumerate(args):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
                actor = actor_class.options(scheduling_strategy=strategy).remote()
                self.ranks.append(RayRank(ray, actor, actor.run.remote(a, server.getsockname()[:2], authkey)))
            conns = self._accept(server, authkey, [a.rank for a in args], timeout_s)
        return self.ranks, [conns[a.rank] for a in args]

    def _accept(self, server: socket.socket, authkey: bytes, ranks: list[int], timeout_s: float
                ) -> dict[int, Connection]:
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        while len(conns) < len(ranks):
            try:
                sock, _ = server.accept()
            except TimeoutError:
                for rank, r in zip(ranks, self.ranks):
                    if rank not in conns and not r.is_alive():
                        raise TensorParallelError(f"tensor parallel rank {rank} {r.ended()} while starting") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(ranks) - set(conns))
                    raise TensorParallelError(f"tensor parallel ranks {missing} (Ray actors) did not connect "
                                              f"within {timeout_s:.0f} s") from None
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            try:  # as multiprocessing's Listener.accept authenticates
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
                _, rank, pid, node_ip = conn.recv()
                ray_rank = self.ranks[ranks.index(rank)]
            except Exception:  # noqa: BLE001 - not one of ours (wrong key, stray client): drop it
                conn.close()
                continue
            ray_rank.pid, ray_rank.node_ip = pid, node_ip
            conns[rank] = conn
        return conns

    def release(self) -> None:
        """Kill the actors and remove the placement group (idempotent; a no-op once Ray is shut down)."""
        ray = self.ray
        if not ray.is_initialized():
            return
        try:
            for r in self.ranks:
                ray.kill(r.actor, no_restart=True)
            if self.ranks:  # a killed actor answers at once (with an error): wait until each is gone
                ray.wait([r.actor.__ray_ready__.remote() for r in self.ranks], num_returns=len(self.ranks), timeout=10)
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - Ray going down under us (interpreter exit): nothing left to free
            pass
        self.ranks, self.pg = [], None
