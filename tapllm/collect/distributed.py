"""Data-parallel collection on a Ray cluster: one actor (one engine) per part of the input.

Each actor writes its part's shards and manifest into the shared output folder; the driver
holds the folder's lock for the whole run and writes the one ``metadata.json`` once every
part is complete. An actor that dies (node lost, out of memory, killed) is replaced and its
part resumes from the part's manifest. Only this module imports Ray, and only when
``--ray-address`` is given.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from tapllm.collect.sources import ItemSource
from tapllm.collect.part import CollectConfig, build_engine, check_engine, run_part
from tapllm.prompt_records import Item

logger = logging.getLogger("tapllm")
MAX_RESTARTS = 2


class CollectWorker:
    """A Ray actor holding one engine; ``run`` collects one part."""

    def __init__(self, cfg: CollectConfig, run: dict[str, Any], threads: int) -> None:
        self.cfg = cfg
        self.engine = build_engine(cfg, threads)
        check_engine(self.engine, run)

    def run(self, items: list[Item], part: int, start: int, end: int) -> int:
        """Collect input [start, end) as part ``part``; returns the number of shards."""
        return len(run_part(self.engine, self.cfg, ItemSource(items, start, end), part, show_progress=False))


def run_with_ray(cfg: CollectConfig, run: dict[str, Any], items: list[Item], parts: list[tuple[int, int]],
                 address: str, show_progress: bool) -> float:
    """Run every part on its own actor (``--out`` is checked, locked and initialised by the
    caller); returns the seconds the parts took once the actors were up."""
    import ray

    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=max(cfg.workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    cpus = ray.cluster_resources().get("CPU", cfg.workers)
    per_worker = max(1, int(cpus // cfg.workers))
    Actor = ray.remote(num_cpus=per_worker, max_restarts=0)(CollectWorker)
    # Ray may run the actor on another machine: give it absolute paths on the shared storage.
    cfg = replace(cfg, input=cfg.input.resolve() if cfg.input is not None else None, out=cfg.out.resolve())
    actors = [Actor.remote(cfg, run, per_worker) for _ in parts]
    t0 = time.perf_counter()
    refs = {}
    for k, (a, b) in enumerate(parts):
        refs[actors[k].run.remote(items[a:b], k, a, b)] = k
    restarts = [0] * len(parts)
    bar = tqdm(total=len(parts), desc=f"collecting on {cfg.workers} Ray workers", unit="part",
               disable=not show_progress)
    try:
        with bar:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                k = refs.pop(ready[0])
                try:
                    ray.get(ready[0])
                    bar.update(1)
                except ray.exceptions.RayActorError as exc:
                    if restarts[k] >= MAX_RESTARTS:
                        raise RuntimeError(f"Ray worker for part {k} died {restarts[k] + 1} times: {exc}") from None
                    restarts[k] += 1
                    logger.warning("Ray worker for part %d died; rerunning the part from its last complete shard", k)
                    actors[k] = Actor.remote(cfg, run, per_worker)
                    a, b = parts[k]
                    refs[actors[k].run.remote(items[a:b], k, a, b)] = k
    finally:
        # The lock is released when the caller returns: no actor may still be writing then.
        for actor in actors:
            ray.kill(actor)
    return time.perf_counter() - t0
