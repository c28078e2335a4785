"""Data-parallel collection on a Ray cluster: one actor (one engine) per part of the input.

Each actor writes its part's shards and manifest into the shared output folder; the driver
writes the one ``metadata.json`` once every part is complete. An actor that dies (node lost,
out of memory, killed) is replaced and its part resumes from the part's manifest. Only this
module imports Ray, and only when ``--ray-address`` is given.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from tapllm.collect.inputs import Item, fingerprint
from tapllm.collect.run import CollectConfig, build_llm, describe, prepare_output, run_part, split_parts
from tapllm.collect.writer import remove_library_temporaries

logger = logging.getLogger("tapllm")
MAX_RESTARTS = 2


class CollectWorker:
    """A Ray actor holding one engine; ``run`` collects one part."""

    def __init__(self, cfg: CollectConfig, threads: int) -> None:
        self.cfg = cfg
        self.llm = build_llm(cfg, threads)

    def identity(self, input_sha256: str) -> dict[str, Any]:
        """The run description as this worker's engine sees it."""
        return describe(self.cfg, self.llm, input_sha256)

    def run(self, items: list[Item], part: int, start: int, end: int) -> int:
        """Collect input [start, end) as part ``part``; returns the number of shards."""
        return len(run_part(self.llm, self.cfg, items, part, start, end, show_progress=False))


def run_with_ray(cfg: CollectConfig, items: list[Item], address: str, show_progress: bool
                 ) -> tuple[dict[str, Any] | None, list[tuple[int, int]], float]:
    """Run every part on its own actor.

    Returns the run description (None if the dataset was already complete), the parts, and
    the seconds the parts took once the actors were up.
    """
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
    cfg = replace(cfg, input=cfg.input.resolve(), out=cfg.out.resolve())
    parts = split_parts(len(items), cfg.workers)
    actors = [Actor.remote(cfg, per_worker) for _ in parts]
    # The driver hashes the input: worker nodes get their records shipped, not the file.
    run = ray.get(actors[0].identity.remote(fingerprint(cfg.input)))
    if prepare_output(cfg.out, run, cfg.overwrite):
        return None, parts, 0.0
    remove_library_temporaries(cfg.out)  # no worker writes yet
    t0 = time.perf_counter()
    refs = {}
    for k, (a, b) in enumerate(parts):
        refs[actors[k].run.remote(items[a:b], k, a, b)] = k
    restarts = [0] * len(parts)
    bar = tqdm(total=len(parts), desc=f"collecting on {cfg.workers} Ray workers", unit="part",
               disable=not show_progress)
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
                actors[k] = Actor.remote(cfg, per_worker)
                a, b = parts[k]
                refs[actors[k].run.remote(items[a:b], k, a, b)] = k
    seconds = time.perf_counter() - t0
    for actor in actors:
        ray.kill(actor)
    return run, parts, seconds
