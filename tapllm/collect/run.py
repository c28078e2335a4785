"""``tapllm collect``: hidden states of a whole dataset, written to shards, resumable.

The output folder holds ``run.json`` (what this run is: a rerun must match it),
``progress-partNNN.jsonl`` manifests (complete shards per part), the shards, ``collect.lock``
(one run at a time), and at the end ``metadata.json`` (plus ``state.json`` /
``dataset_info.json`` for the Arrow format, which make the folder a Hugging Face ``datasets``
dataset).

Everything that can be refused is refused before the model's weights are loaded: the run's
identity comes from the model's config alone.

Each part of the input is cut into groups of consecutive records decided by the input alone,
and each group is computed by itself (the engine drains it before the next is admitted) and
becomes exactly one shard. A shard's batches are therefore the same in every run, so a run
resumed after ``kill -9`` writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tapllm.collect.distributed import run_with_ray
from tapllm.collect.inputs import fingerprint, read_items
from tapllm.collect.lock import LOCK_NAME, OutputLock
from tapllm.collect.part import CollectConfig, build_engine, check_engine, run_part
from tapllm.collect.shards import arrow_dtype_ok, write_file
from tapllm.collect.writer import Manifest, ShardEntry, remove_temporaries
from tapllm.dtypes import dtype_name
from tapllm.hidden_states.capture import resolve

__all__ = ["CollectConfig", "collect"]

logger = logging.getLogger("tapllm")
FORMAT = "tapllm.activations"
_OURS = ("run.json", "metadata.json", "state.json", "dataset_info.json", LOCK_NAME)
VERSION = 2  # 2: one shard per group of records decided by the input


def model_config(cfg: CollectConfig) -> Any:
    """The model's config (config.json only: no weights; a GGUF is converted once and cached)."""
    from tapllm.config import ModelConfig
    from tapllm.loader import resolve_model

    return ModelConfig.from_folder(resolve_model(cfg.engine.model), cfg.engine.dtype, cfg.engine.device)


def describe(cfg: CollectConfig, mc: Any, input_sha256: str) -> dict[str, Any]:
    """The run's identity (``run.json``) from the model's config: model, settings, resolved
    layers, input hash. ``ValueError`` for a layer or point the model lacks, or Arrow + bf16."""
    sel = resolve(cfg.spec(), num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
                  point_shapes=mc.point_shapes(),
                  num_prompt=1, max_positions=1, encode=True)
    if cfg.fmt == "arrow" and not arrow_dtype_ok(mc.dtype):
        raise ValueError(f"--format arrow cannot store {mc.dtype} (Arrow has no bfloat16); "
                         "use --dtype float32 or float16, or --format safetensors")
    return {
        "format": FORMAT, "version": VERSION, "model": str(mc.path), "architecture": mc.architecture,
        "dtype": dtype_name(mc.dtype), "hidden_size": mc.hidden_size,
        "layers": list(sel.layers), "points": list(cfg.points), "positions": cfg.spec().positions,
        "max_tokens": cfg.max_tokens, "storage": cfg.fmt, "shard_tokens": cfg.shard_tokens,
        "workers": cfg.workers, "input": str(cfg.input.resolve()), "input_sha256": input_sha256,
    }


def check_output(out: Path, run: dict[str, Any], overwrite: bool) -> str:
    """What ``out`` holds for ``run``, changing nothing: ``"complete"`` (this exact dataset),
    ``"resume"`` (this run, unfinished), ``"new"`` (nothing of ours), or ``"replace"`` (another
    run's files and ``--overwrite``). ``ValueError`` for anything else. Call under the lock
    (after ``check_foreign``)."""
    run_file = out / "run.json"
    try:
        existing = json.loads(run_file.read_text()) if run_file.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        existing = {"run.json": "unreadable"}
    if existing == run:
        return "complete" if (out / "metadata.json").exists() else "resume"
    leftovers = [f for f in out.iterdir() if f.name != LOCK_NAME]
    if existing is None and not leftovers:
        return "new"
    if not overwrite:
        if existing is not None:
            raise ValueError(f"--out {out} holds a different run's dataset ({_diff(existing, run)}); "
                             "pass --overwrite to replace it")
        names = ", ".join(sorted(f.name for f in leftovers)[:5])
        raise ValueError(f"--out {out} holds files of a tapllm dataset but no run.json ({names}); "
                         "pass --overwrite to replace them")
    return "replace"


def check_foreign(out: Path) -> None:
    """Refuse a folder holding files tapllm did not write (even with ``--overwrite``)."""
    if not out.is_dir():
        return
    others = sorted(f.name for f in out.iterdir() if not _is_ours(f.name))
    if others:
        raise ValueError(f"--out {out} holds files that are not a tapllm dataset ({', '.join(others[:5])}); "
                         "not touching them: choose an empty folder")


def init_output(out: Path, run: dict[str, Any], state: str) -> None:
    """Make ``out`` hold ``run``'s identity (clearing another run's files for ``"replace"``)."""
    if state == "replace":
        for f in out.iterdir():
            if f.name != LOCK_NAME:
                f.unlink()
    if state in ("new", "replace"):
        _write_json(out / "run.json", run)


def _is_ours(name: str) -> bool:
    if name in _OURS or name.startswith(("part", "progress-part")):
        return True
    if name.startswith(".tmp") and len(name) == 10:  # safetensors' temporary
        return True
    if name.startswith(".") and name.endswith(".tmp"):  # ours: .NAME.XXXXXXXX.tmp
        inner = name[1:-4]
        return any(n in _OURS or n.startswith(("part", "progress-part")) for n in (inner, inner.rsplit(".", 1)[0]))
    return False


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4])


def _write_json(path: Path, obj: Any) -> None:
    write_file(path, json.dumps(obj, indent=2))


def split_parts(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of the input, one per worker."""
    bounds = [round(i * n / workers) for i in range(workers + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(workers)]


def finalize(out: Path, run: dict[str, Any], parts: list[tuple[int, int]], num_items: int, seconds: float
             ) -> dict[str, Any]:
    """Write ``metadata.json`` (and the ``datasets`` files for Arrow) from the parts' manifests."""
    shards: list[ShardEntry] = []
    for part in range(len(parts)):
        shards.extend(Manifest(out, part).load())
    covered = sum(e.requests[1] - e.requests[0] for e in shards)
    if covered != num_items:
        raise RuntimeError(f"the manifests cover {covered} of {num_items} records; rerun to complete the dataset")
    rows = sum(e.rows for e in shards)
    remove_temporaries(out)  # every writer has finished
    meta = {**run, "num_requests": num_items, "num_rows": rows, "num_shards": len(shards),
            "bytes": sum(e.bytes for e in shards), "shards": [asdict(e) for e in shards], "seconds": round(seconds, 3)}
    if run["storage"] == "arrow":
        _write_datasets_files(out, shards)
    _write_json(out / "metadata.json", meta)
    return meta


def _write_datasets_files(out: Path, shards: list[ShardEntry]) -> None:
    import pyarrow as pa
    from datasets import DatasetInfo, Features

    with pa.memory_map(str(out / shards[0].file)) as src:
        schema = pa.ipc.open_stream(src).schema
    info = asdict(DatasetInfo(features=Features.from_arrow_schema(schema)))
    _write_json(out / "dataset_info.json", {k: info[k] for k in sorted(info)})
    state = {"_data_files": [{"filename": e.file} for e in shards], "_fingerprint": shards[-1].sha256[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    _write_json(out / "state.json", state)


def collect(cfg: CollectConfig, ray_address: str | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Run (or resume) a collection; returns the final metadata.

    Refusals come before the model's weights are loaded: bad settings, a layer or point the
    model lacks, Arrow + bfloat16, another run in ``--out`` (its lock), another run's dataset
    or files that are not a tapllm dataset, a bad input record; a complete dataset is
    returned as is.
    """
    cfg.validate()
    if ray_address is None and cfg.workers != 1:
        raise ValueError("--workers needs --ray-address (use 'local' for a Ray instance on this machine)")
    run = describe(cfg, model_config(cfg), fingerprint(cfg.input))
    check_foreign(cfg.out)  # before our lock file goes into someone else's folder
    try:
        cfg.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create --out {cfg.out}: {exc.strerror}") from None
    with OutputLock(cfg.out):
        check_foreign(cfg.out)
        state = check_output(cfg.out, run, cfg.overwrite)
        if state == "complete":
            logger.info("%s already holds this complete dataset", cfg.out)
            return json.loads((cfg.out / "metadata.json").read_text())
        items = read_items(cfg.input)
        init_output(cfg.out, run, state)
        remove_temporaries(cfg.out)  # a killed run's; no writer runs yet
        parts = split_parts(len(items), cfg.workers)
        if ray_address is None:
            engine = build_engine(cfg)
            check_engine(engine, run)
            t0 = time.perf_counter()
            run_part(engine, cfg, items, 0, 0, len(items), show_progress)
            seconds = time.perf_counter() - t0
        else:
            seconds = run_with_ray(cfg, run, items, parts, ray_address, show_progress)
        return finalize(cfg.out, run, parts, len(items), seconds)
