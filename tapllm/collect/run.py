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
becomes exactly one shard. The engine runs ``batch_invariant`` unless told otherwise
(``--no-batch-invariant``), so every row is the same bits whatever shared its steps: a run
resumed after ``kill -9``, or split over other workers, writes the same bytes as an
uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from tapllm.collect.contexts import ContextSettings
from tapllm.collect.distributed import run_with_ray
from tapllm.collect.hf_input import DatasetSpec, open_dataset
from tapllm.collect.hf_input import fingerprint as dataset_fingerprint
from tapllm.collect.lock import LOCK_NAME, OutputLock
from tapllm.collect.part import CollectConfig, build_engine, check_engine
from tapllm.collect.recipes import RECIPE_FOLDERS, part_runner
from tapllm.collect.provenance import model_id, tokenizer_info, weights_sha256
from tapllm.collect.sae_columns import sae_identity
from tapllm.collect.shards import arrow_dtype_ok, write_file
from tapllm.collect.sources import DatasetSource, ItemSource, fingerprint, read_items
from tapllm.collect.writer import Manifest, ShardEntry, remove_temporaries
from tapllm.hidden_states.resolved import resolve
from tapllm.models.shapes import config_point_shapes, experts_per_token, num_experts
from tapllm.utils.dtypes import dtype_from_name, dtype_name

__all__ = ["CollectConfig", "DatasetSpec", "collect"]

logger = logging.getLogger("tapllm")
FORMAT = "tapllm.activations"
_OURS = ("run.json", "metadata.json", "state.json", "dataset_info.json", LOCK_NAME)
VERSION = 3  # 2: one shard per group of records decided by the input; 3: provenance, --dataset


def model_folder(cfg: CollectConfig) -> Path:
    """The model's folder (a GGUF is converted once and cached; a Hub id is resolved)."""
    from tapllm.loader import resolve_model

    return resolve_model(cfg.engine.model, cfg.engine.revision, cfg.engine.download_dir)


def model_config(cfg: CollectConfig, folder: Path | None = None) -> Any:
    """The model's config (config.json only: no weights)."""
    from tapllm.config import ModelConfig

    mc = ModelConfig.from_folder(folder or model_folder(cfg), cfg.engine.dtype, cfg.engine.device)
    if cfg.engine.max_model_len is not None:
        mc.max_model_len = min(mc.max_model_len, cfg.engine.max_model_len)
    return mc


def store_dtype(cfg: CollectConfig, compute: torch.dtype) -> str:
    """The dtype the shards hold: ``--store-dtype``, or ``auto``: the compute dtype (float32
    for a bfloat16 run written as Arrow, which has no bfloat16)."""
    if cfg.store_dtype == "auto":
        dtype = compute if cfg.fmt != "arrow" or arrow_dtype_ok(compute) else torch.float32
    else:
        dtype = dtype_from_name(cfg.store_dtype)
        if cfg.fmt == "arrow" and not arrow_dtype_ok(dtype):
            raise ValueError(f"--format arrow cannot store {cfg.store_dtype} (Arrow has no bfloat16); "
                             "use --store-dtype float32 or float16, or --format safetensors")
    return dtype_name(dtype)


def describe(cfg: CollectConfig, mc: Any, source: dict[str, Any], folder: Path | None = None,
             tokenizer: Any | None = None) -> dict[str, Any]:
    """The run's identity (``run.json``) from the model's config: model (as named, with the
    sha256 of its weights), tokenizer, settings, resolved layers, input (``source``: the input
    file and its hash, or the dataset and its context settings). ``ValueError`` for a layer or
    point the model lacks or a dtype the format cannot store."""
    router = router_identity(mc) if cfg.router else None
    sel = resolve(cfg.spec(), num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
                  point_shapes=config_point_shapes(mc),
                  num_prompt=1, max_positions=1, encode=True)
    folder = folder or mc.path
    tok_folder = mc.tokenizer_path or folder
    return {
        "format": FORMAT, "version": VERSION, "model": model_id(cfg.engine), "revision": cfg.engine.revision,
        "weights_sha256": weights_sha256(cfg.engine, folder), "architecture": mc.architecture,
        "tokenizer": tokenizer_info(cfg.engine, tok_folder, tokenizer),
        "dtype": dtype_name(mc.dtype), "store_dtype": store_dtype(cfg, mc.dtype), "hidden_size": mc.hidden_size,
        "layers": list(sel.layers), "points": list(cfg.points), "positions": cfg.spec().positions,
        "max_tokens": cfg.max_tokens, "exclude_special_tokens": cfg.exclude_special_tokens,
        "storage": cfg.fmt, "shard_tokens": cfg.shard_tokens, "workers": cfg.workers,
        "batch_invariant": cfg.engine.batch_invariant, **source,
        **({"sae": sae_identity(cfg)} if cfg.sae is not None else {}),
        **({"router": router} if router is not None else {}),
    }


def router_identity(mc: Any) -> dict[str, int]:
    """The routing columns' part of a run's identity: the experts and top-k; ``ValueError`` for a dense model."""
    if not num_experts(mc):
        raise ValueError(f"--router: {mc.architecture} is not a mixture-of-experts model (it has no router)")
    return {"n_experts": num_experts(mc), "top_k": experts_per_token(mc)}


def input_source(cfg: CollectConfig) -> dict[str, Any]:
    """The ``--input`` part of the identity: the file and a hash of its bytes."""
    assert cfg.input is not None
    return {"input": str(cfg.input.resolve()), "input_sha256": fingerprint(cfg.input)}


def dataset_source(cfg: CollectConfig, ds: Any, settings: ContextSettings) -> dict[str, Any]:
    """The ``--dataset`` part of the identity: name, split, column, fingerprint, context settings."""
    spec = cfg.dataset
    assert spec is not None
    path = Path(spec.name).expanduser()
    name = str(path.resolve()) if path.exists() else spec.name
    return {"dataset": {"name": name, "split": spec.split, "column": spec.column,
                        "fingerprint": dataset_fingerprint(ds, spec)},
            "context": {"size": settings.size, "packing": settings.packing, "truncate": settings.truncate,
                        "prepend_bos": settings.bos_token_id is not None, "bos_token_id": settings.bos_token_id,
                        "max_rows": settings.max_records, "max_tokens_total": settings.max_tokens}}


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
            if f.name in RECIPE_FOLDERS and f.is_dir():
                shutil.rmtree(f)
            elif f.name != LOCK_NAME:
                f.unlink()
    if state in ("new", "replace"):
        _write_json(out / "run.json", run)


def _is_ours(name: str) -> bool:
    if name in _OURS or name in RECIPE_FOLDERS or name.startswith(("part", "progress-part")):
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


def finalize(out: Path, run: dict[str, Any], parts: list[tuple[int, int]], num_items: int | None, seconds: float
             ) -> dict[str, Any]:
    """Write ``metadata.json`` (and the ``datasets`` files for Arrow) from the parts' manifests.

    ``num_items``: the records the manifests must cover (``None`` for a stream, whose length
    is what its manifest reached)."""
    from tapllm.utils.version import __version__

    shards: list[ShardEntry] = []
    for part in range(len(parts)):
        shards.extend(Manifest(out, part).load())
    covered = sum(e.requests[1] - e.requests[0] for e in shards)
    if num_items is None:
        num_items = covered
    if covered != num_items:
        raise RuntimeError(f"the manifests cover {covered} of {num_items} records; rerun to complete the dataset")
    if not shards:
        raise ValueError("the input gave no records to collect")
    rows = sum(e.rows for e in shards)
    remove_temporaries(out)  # every writer has finished
    meta = {**run, "tapllm_version": __version__, "num_requests": num_items, "num_rows": rows,
            "num_shards": len(shards), "bytes": sum(e.bytes for e in shards), "shards": [asdict(e) for e in shards],
            "seconds": round(seconds, 3)}
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
    model lacks, a store dtype the format lacks, a dataset, split or column that is not there,
    another run in ``--out`` (its lock), another run's dataset or files that are not a tapllm
    dataset, a bad input record; a complete dataset is returned as is.
    """
    cfg.validate()
    if ray_address is None and cfg.workers != 1:
        raise ValueError("--workers needs --ray-address (use 'local' for a Ray instance on this machine)")
    folder = model_folder(cfg)
    mc = model_config(cfg, folder)
    if cfg.engine.tokenizer is not None:
        from tapllm.loader import resolve_tokenizer

        mc.tokenizer_path = resolve_tokenizer(cfg.engine.tokenizer, cfg.engine.tokenizer_revision,
                                              cfg.engine.download_dir)
    ds = settings = tokenizer = None
    items: list[Any] = []
    if cfg.recipe is not None:  # it reads its input itself (the driver ships it to Ray workers)
        from tapllm.collect.eagle3 import read_conversations

        cfg = cfg.recipe.configure(cfg, mc.num_layers)
        items, source_id = read_conversations(cfg)
    elif cfg.dataset is not None:
        from tapllm.engine.tokenizer import load_tokenizer

        ds = open_dataset(cfg.dataset)
        tokenizer = load_tokenizer(mc.tokenizer_path or folder)
        settings = cfg.contexts(tokenizer.bos_token_id, mc.max_model_len)
        source_id = dataset_source(cfg, ds, settings)
    else:
        source_id = input_source(cfg)
    run = describe(cfg, mc, source_id, folder, tokenizer)
    cfg = replace(cfg, store_dtype=run["store_dtype"])
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
        by_items = cfg.input is not None or cfg.recipe is not None
        if cfg.input is not None and cfg.recipe is None:
            items = read_items(cfg.input)
        init_output(cfg.out, run, state)
        remove_temporaries(cfg.out)  # a killed run's; no writer runs yet
        if cfg.recipe is not None:
            from tapllm.collect.eagle3 import clean

            clean(cfg.out)
        # --dataset: each Ray worker reads its own part (tapllm.collect.dataset_parts)
        parts = split_parts(len(items), cfg.workers) if by_items else [(0, 0)] * cfg.workers
        if ray_address is None:
            engine = build_engine(cfg)
            try:
                check_engine(engine, run)
                source = (DatasetSource(ds, cfg.dataset, settings) if not by_items and settings is not None
                          else ItemSource(items, 0, len(items)))
                t0 = time.perf_counter()
                part_runner(cfg)(engine, cfg, source, 0, show_progress)
                seconds = time.perf_counter() - t0
            finally:
                engine.close()  # the tensor-parallel ranks, if any, stop with the run
        else:  # a recipe's input travels as items, like --input records
            seconds = run_with_ray(replace(cfg, dataset=None) if cfg.recipe is not None else cfg, run, items, parts,
                                   ray_address, show_progress, settings)
        if cfg.recipe is not None:
            from tapllm.collect.eagle3 import finish

            t1 = time.perf_counter()
            finish(cfg.out, run, len(parts), mc.vocab_size)
            seconds += time.perf_counter() - t1  # the recipe's closing pass counts as its work
        return finalize(cfg.out, run, parts, len(items) if by_items else None, seconds)
