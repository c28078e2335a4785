"""The shared memory region the tensor-parallel ranks of one machine meet in (the collectives
themselves are compiled: ``shm_all_reduce`` and ``shm_all_gather`` in the fused CPU kernels).

gloo's loopback TCP costs 0.3-0.8 ms a collective on a small VM, and a step runs two per block;
copying a step's rows through memory costs microseconds. Every rank of the group decides alike,
through the group's gloo collectives: the region is used only where every rank is on the same
machine (host name and boot id), has the kernels, maps the region and passes a trial all-reduce
through it; else every rank keeps gloo. ``TAPLLM_TP_SHM=0`` keeps gloo too.

The file lives in ``/dev/shm`` only while the ranks map it: rank 0 removes it once every rank
has, so a crash leaves nothing behind.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("tapllm")

SHM_ENV = "TAPLLM_TP_SHM"  # "0": the collectives stay on gloo
SLOT_BYTES = 4 << 20  # one rank's part of one round; larger tensors go through in chunks
LINE = 64  # the kernels' per-rank flag line
WAIT_SLICE_S = 0.25  # how long the kernel spins before the group checks whether a rank is gone


def region_bytes(size: int) -> int:
    """The region's size for ``size`` ranks: a flag line per rank, two banks of a slot per rank."""
    return size * LINE + 2 * size * SLOT_BYTES


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _all(pg: Any, ok: bool) -> bool:
    """Whether every rank says ``ok`` (a gloo all-reduce of one number)."""
    flag = torch.tensor([1.0 if ok else 0.0])
    pg.allreduce([flag]).wait()
    return int(flag.item()) == pg.size()


def _ops() -> Any | None:
    if os.environ.get(SHM_ENV, "1") == "0":
        return None
    from tapllm.kernels import fused_kernels

    ops = fused_kernels()
    return ops if ops is not None and hasattr(ops, "shm_all_reduce") else None


def _map(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)  # keeps ``buffer`` alive


def open_region(store: dist.Store, pg: Any, rank: int, size: int, key: str = "tapllm/shm"
                ) -> tuple[Any, torch.Tensor] | tuple[None, str]:
    """Every rank calls this together: ``(ops, region)`` where the ranks meet in shared memory, else
    ``(None, why not)`` on every rank alike."""
    ops = _ops()
    store.set(f"{key}/host/{rank}", _host())
    same_host = all(store.get(f"{key}/host/{r}").decode() == _host() for r in range(size))
    if not _all(pg, ops is not None and same_host):
        return None, "gloo (" + ("ranks on other machines" if not same_host else
                                 f"{SHM_ENV}=0" if os.environ.get(SHM_ENV) == "0" else "no fused CPU kernels on "
                                 "some rank") + ")"
    nbytes = region_bytes(size)
    path = ""
    if rank == 0:
        try:
            fd, path = tempfile.mkstemp(prefix="tapllm-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # no space: an error now, not a SIGBUS mid-step
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("tensor parallel: no shared memory region (%s); the collectives use gloo", exc)
            if path:
                os.unlink(path)
            path = ""
        store.set(f"{key}/path", path)
    else:
        path = store.get(f"{key}/path").decode()
    region = None
    try:
        region = _map(path, nbytes) if path else None
    except OSError:
        region = None
    try:
        if not _all(pg, region is not None):
            return None, "gloo (the shared memory region could not be made or mapped)"
        trial = torch.full((1000,), float(rank + 1))
        passed = bool(ops.shm_all_reduce(trial, region, rank, size, 1, 10.0)) and \
            bool((trial == size * (size + 1) / 2).all())
        if not _all(pg, passed):
            return None, "gloo (the shared memory trial all-reduce failed)"
    finally:
        if path:
            _all(pg, True)  # every rank has mapped the file (or given up): its name can go
            if rank == 0:
                os.unlink(path)
    return ops, region
