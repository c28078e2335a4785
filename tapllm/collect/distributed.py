"""Data-parallel collection on a Ray cluster: one actor (one engine) per part of the input.

With ``--input`` the driver reads the records and ships each actor its contiguous range. With
``--dataset`` each actor opens the dataset itself and reads only its own part (see
:mod:`tapllm.collect.dataset_parts`): the driver reads no record.

Each actor writes its part's shards and manifest into the shared output folder; the driver
holds the folder's lock for the whole run, shows the progress of every part in one bar (read
from the parts' manifests) and writes the one ``metadata.json`` once every part is complete.
An actor that dies (node lost, out of memory, killed) is replaced and its part resumes from
the part's manifest. Actors are named after the output folder, the part and the attempt
(namespace ``tapllm-collect``), so a rerun after its driver was killed first ends any actor
the dead driver left writing there. Only this module imports Ray, and only with ``--ray-address``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tapllm.collect.contexts import ContextSettings
from tapllm.collect.dataset_parts import open_part
from tapllm.collect.part import CollectConfig, build_engine, check_engine
from tapllm.collect.recipes import part_runner
from tapllm.collect.prompt_records import Item
from tapllm.collect.sources import DatasetSource, ItemSource
from tapllm.collect.writer import Manifest
from tapllm.utils.ray_connect import connect

logger = logging.getLogger("tapllm")
MAX_RESTARTS = 2
NAMESPACE = "tapllm-collect"


class CollectWorker:
    """A Ray actor holding one engine; ``run`` / ``run_dataset`` collect one part."""

    def __init__(self, cfg: CollectConfig, run: dict[str, Any], threads: int) -> None:
        self.cfg = cfg
        self.run_info = run
        self.engine = build_engine(cfg, threads)
        check_engine(self.engine, run)

    def run(self, items: list[Item], part: int, start: int, end: int) -> dict[str, float]:
        """Collect ``--input`` records [start, end) as part ``part``."""
        return self._collect(ItemSource(items, start, end), part)

    def run_dataset(self, part: int, parts: int, settings: ContextSettings) -> dict[str, float]:
        """Read part ``part`` of ``parts`` of ``--dataset`` here and collect its contexts."""
        spec = self.cfg.dataset
        if spec is None:
            raise ValueError("run_dataset needs a --dataset run")
        ds = open_part(spec, part, parts, self.cfg.max_rows, self.run_info["dataset"]["fingerprint"])
        return self._collect(DatasetSource(ds, spec, settings), part)

    def _collect(self, source: ItemSource | DatasetSource, part: int) -> dict[str, float]:
        before = sum(e.rows for e in Manifest(self.cfg.out, part).load())
        t0 = time.perf_counter()
        entries = part_runner(self.cfg)(self.engine, self.cfg, source, part, show_progress=False)
        return {"shards": len(entries), "rows": sum(e.rows for e in entries) - before,
                "seconds": time.perf_counter() - t0}


def actor_name(out: Path, part: int, attempt: int = 0) -> str:
    """The Ray name of the actor collecting ``part`` into ``out`` (``attempt``: 0, then one
    more for each replacement: a dead actor's name may stay taken while its handle lives)."""
    return f"collect-{hashlib.sha256(str(out).encode()).hexdigest()[:12]}-part{part:03d}-{attempt}"


def _end(ray: Any, name: str, timeout: float = 60.0) -> None:
    """End the live actor named ``name`` (if any) and wait until it is dead."""
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    ray.kill(handle)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.2)
    raise RuntimeError(f"Ray actor {name} is still alive {timeout:.0f} s after it was ended")


def _show(bar: tqdm, out: Path, parts: int, t0: float, rows0: int) -> int:
    """Set the bar from the parts' manifests (requests or contexts done, rows/s); returns the rows."""
    entries = [e for k in range(parts) for e in Manifest(out, k).load()]
    bar.n = sum(e.requests[1] - e.requests[0] for e in entries)
    rows = sum(e.rows for e in entries)
    bar.set_postfix_str(f"{(rows - rows0) / max(time.perf_counter() - t0, 1e-9):.0f} rows/s", refresh=False)
    bar.refresh()
    return rows


def run_with_ray(cfg: CollectConfig, run: dict[str, Any], items: list[Item], parts: list[tuple[int, int]],
                 address: str, show_progress: bool, settings: ContextSettings | None = None) -> float:
    """Run every part on its own actor (``--out`` is checked, locked and initialised by the
    caller); returns the seconds the parts took once the actors were asked to start.

    ``--input``: ``items`` and their ``parts`` ranges. ``--dataset``: ``settings`` (the
    driver's context settings), one part per entry of ``parts`` (ranges unused)."""
    if cfg.dataset is not None and settings is None:
        raise ValueError("a --dataset run needs its context settings")
    ray = connect(address, cfg.workers)
    cpus = ray.cluster_resources().get("CPU", cfg.workers)
    per_worker = max(1, int(cpus // cfg.workers))
    Actor = ray.remote(num_cpus=per_worker, max_restarts=0)(CollectWorker)
    # Ray may run the actor on another machine: give it absolute paths on the shared storage.
    cfg = replace(cfg, input=cfg.input.resolve() if cfg.input is not None else None, out=cfg.out.resolve())
    if cfg.dataset is not None and Path(cfg.dataset.name).expanduser().exists():
        cfg = replace(cfg, dataset=replace(cfg.dataset, name=str(Path(cfg.dataset.name).expanduser().resolve())))
    for k in range(len(parts)):  # a killed driver's actors may still be writing here
        for attempt in range(MAX_RESTARTS + 1):
            _end(ray, actor_name(cfg.out, k, attempt))
    restarts = [0] * len(parts)

    def start(k: int) -> Any:
        actor = Actor.options(name=actor_name(cfg.out, k, restarts[k]), namespace=NAMESPACE).remote(
            cfg, run, per_worker)
        if cfg.dataset is not None:
            ref = actor.run_dataset.remote(k, len(parts), settings)
        else:
            a, b = parts[k]
            ref = actor.run.remote(items[a:b], k, a, b)
        refs[ref] = k
        return actor

    refs: dict[Any, int] = {}
    t0 = time.perf_counter()
    actors = [start(k) for k in range(len(parts))]
    unit = "req" if cfg.dataset is None else "ctx"
    bar = tqdm(total=len(items) if cfg.dataset is None else None, unit=unit, dynamic_ncols=True,
               desc=f"collecting on {len(parts)} Ray workers", disable=not show_progress)
    try:
        with bar:
            rows0 = _show(bar, cfg.out, len(parts), t0, 0)
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
                _show(bar, cfg.out, len(parts), t0, rows0)
                if not ready:
                    continue
                k = refs.pop(ready[0])
                try:
                    stats = ray.get(ready[0])
                    logger.info("part %d: %d rows in %.1f s (%.0f rows/s)", k, stats["rows"], stats["seconds"],
                                stats["rows"] / max(stats["seconds"], 1e-9))
                except ray.exceptions.RayActorError as exc:
                    if restarts[k] >= MAX_RESTARTS:
                        raise RuntimeError(f"Ray worker for part {k} died {restarts[k] + 1} times: {exc}") from None
                    restarts[k] += 1
                    logger.warning("Ray worker for part %d died; rerunning the part from its last complete shard", k)
                    actors[k] = start(k)
    finally:
        # The lock is released when the caller returns: no actor may still be writing then.
        for actor in actors:
            ray.kill(actor)
        for k in range(len(parts)):
            _end(ray, actor_name(cfg.out, k, restarts[k]))
    return time.perf_counter() - t0
