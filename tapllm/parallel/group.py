"""The collectives of one tensor-parallel group, over a gloo process group of its own.

The group is made directly (``ProcessGroupGloo`` on a ``TCPStore``), not as torch.distributed's
default group, so an engine leaves the process's global distributed state alone and several
engines (or a user's own ``init_process_group``) do not collide. Every collective waits at most
the group's timeout; one that fails or times out raises :class:`TensorParallelError`, and the
group is then broken for good: the ranks may no longer agree on where they are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tapllm.parallel.shm import SLOT_BYTES, WAIT_SLICE_S, open_region

DEFAULT_TIMEOUT_S = 30.0  # a collective that waits longer than this means a rank is dead or hung
TIMEOUT_ENV = "TAPLLM_TP_TIMEOUT_S"  # overrides DEFAULT_TIMEOUT_S (seconds)
SHM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the shared-memory all-reduce sums


def collective_timeout_s() -> float:
    """The collectives' timeout: ``$TAPLLM_TP_TIMEOUT_S`` when set, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died, hung or failed: the engine cannot go on."""


class TPGroup:
    """All-reduce and all-gather among ``size`` ranks (CPU tensors): in shared memory where every rank is
    on one machine (:mod:`tapllm.parallel.shm`), else gloo. Constructing it is collective."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self.pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
        self.broken: str | None = None  # why the group can no longer be used
        # Called with the exception when a collective fails, before TensorParallelError is raised:
        # rank 0 uses it to say which worker died and why.
        self.explain: Callable[[BaseException], str] | None = None
        # Asked while a shared-memory collective waits: why a rank it waits for cannot come (or None).
        self.gone: Callable[[], str | None] | None = None
        self.bytes_moved = 0  # what this rank's collectives sent, for describe() and benchmarks
        self.calls = 0
        self.wait_s = 0.0  # time this rank spent waiting in collectives
        self.seq = 1  # the last shared-memory round (round 1 was open_region's trial)
        self.ops, found = open_region(store, self.pg, rank, size) if size > 1 else (None, "none (one rank)")
        self.region: torch.Tensor | None = found if self.ops is not None else None
        self.transport = "shared memory" if self.ops is not None else found

    def _wait(self, work: dist.Work, what: str) -> None:
        self._guard(what, work.wait)

    def _meet(self, what: str, call: Callable[[float], bool]) -> None:
        """One shared-memory round: ``call(wait_s)`` until every rank arrived, asking ``gone`` between tries."""
        self.seq += 1
        deadline = time.perf_counter() + self.timeout_s

        def run() -> None:
            while not call(WAIT_SLICE_S):
                why = self.gone() if self.gone is not None else None
                if why is not None:
                    raise RuntimeError(why)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"timeout: the other ranks did not arrive within {self.timeout_s:g} s")

        self._guard(what, run)

    def fits_round(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` goes through shared memory in one round (compiled code that
        all-reduces itself, :meth:`native_rounds`, needs that)."""
        return self.ops is not None and nbytes <= SLOT_BYTES

    def native_rounds(self, what: str, rounds: int, nbytes: int, call: Callable[[float], int | None]) -> None:
        """Compiled code that runs ``rounds`` all-reduces of ``nbytes`` itself, as rounds ``seq + 1`` ..
        ``seq + rounds`` of the region: ``call(wait_s)`` returns None when done, else how far it got (a
        number that grows); a wait that makes no progress for the group's timeout, or a rank that is
        gone, breaks the group as any collective does. Its time is not counted in ``wait_s``: the
        waits are inside the compiled code, between its arithmetic."""
        self._check()
        waited = self.wait_s
        self.calls += rounds
        self.bytes_moved += rounds * nbytes

        def run() -> None:
            reached, deadline = -1, time.perf_counter() + self.timeout_s
            while (place := call(WAIT_SLICE_S)) is not None:
                if place > reached:
                    reached, deadline = place, time.perf_counter() + self.timeout_s
                why = self.gone() if self.gone is not None else None
                if why is not None:
                    raise RuntimeError(why)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"timeout: the other ranks did not arrive within {self.timeout_s:g} s")

        try:
            self._guard(what, run)
        finally:
            self.wait_s = waited
        self.seq += rounds

    def _guard(self, what: str, run: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError and its own kinds
            detail = self.explain(exc) if self.explain is not None else f"{type(exc).__name__}: {exc}"
            self.broken = f"{what} failed on rank {self.rank}: {detail}"
            raise TensorParallelError(f"tensor parallel group broken: {self.broken}") from exc
        finally:
            self.wait_s += time.perf_counter() - start

    def _check(self) -> None:
        if self.broken is not None:
            raise TensorParallelError(f"tensor parallel group broken earlier: {self.broken}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``x`` must be contiguous); returns ``x``."""
        self._check()
        if self.size == 1:
            return x
        self.calls += 1
        self.bytes_moved += x.numel() * x.element_size()
        if self.ops is None or x.dtype not in SHM_DTYPES:
            self._wait(self.pg.allreduce([x]), "all_reduce")
            return x
        self._rounds("all_reduce", x, lambda part, a, wait_s: self.ops.shm_all_reduce(
            part, self.region, self.rank, self.size, self.seq, wait_s))
        return x

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order.

        ``sizes``: each rank's length along ``dim`` where they differ (an uneven split); the parts are
        padded to the longest, gathered, and cut back. None: every rank's ``x`` has this one's shape."""
        self._check()
        if self.size == 1:
            return x
        if sizes is not None and len(set(sizes)) > 1:
            return self._gather_uneven(x, dim, sizes)
        x = x.contiguous()
        self.calls += 1
        self.bytes_moved += x.numel() * x.element_size() * (self.size - 1)
        if self.ops is None:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._wait(self.pg.allgather([parts], [x]), "all_gather")
            return torch.cat(parts, dim=dim)
        out = torch.empty(self.size, x.numel(), dtype=x.dtype)
        self._rounds("all_gather", x, lambda part, a, wait_s: self.ops.shm_all_gather(
            part, out, a, self.region, self.rank, self.size, self.seq, wait_s))
        return torch.cat(out.view(self.size, *x.shape).unbind(0), dim=dim)

    def _rounds(self, what: str, x: torch.Tensor, call: Callable[[torch.Tensor, int, float], bool]) -> None:
        """``x`` (contiguous) through shared memory a slot at a time: ``call(part, offset, wait_s)`` per round."""
        flat, step = x.view(-1), SLOT_BYTES // x.element_size()
        for a in range(0, flat.numel(), step):
            part = flat[a:a + step]
            self._meet(what, lambda wait_s: call(part, a, wait_s))

    def _gather_uneven(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        if len(sizes) != self.size or x.shape[dim] != sizes[self.rank]:
            raise ValueError(f"all_gather: rank {self.rank}'s part has {x.shape[dim]} along dim {dim}, "
                             f"sizes {sizes} (one per rank of {self.size})")
        longest = max(sizes)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
        whole = self.all_gather(padded, dim)
        return torch.cat([whole.narrow(dim, r * longest, n) for r, n in enumerate(sizes)], dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, written into ``x`` in place; returns ``x``."""
        self._check()
        if self.size == 1:
            return x
        buf = x if x.is_contiguous() else x.contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.calls += 1
        self.bytes_moved += buf.numel() * buf.element_size() if self.rank == src else 0
        self._wait(self.pg.broadcast([buf], opts), "broadcast")
        if buf is not x:
            x.copy_(buf)
        return x

    def barrier(self) -> None:
        """Wait until every rank gets here (a one-element all-reduce, under the group's timeout)."""
        self.all_reduce(torch.zeros(1))
