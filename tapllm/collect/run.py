"""``tapllm collect``: hidden states of a whole dataset, written to shards, resumable.

The output folder holds ``run.json`` (what this run is: a rerun must match it),
``progress-partNNN.jsonl`` manifests (complete shards per part), the shards, and at the end
``metadata.json`` (plus ``state.json`` / ``dataset_info.json`` for the Arrow format, which
make the folder a Hugging Face ``datasets`` dataset).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm.collect.inputs import Item, fingerprint, read_items
from tapllm.collect.shards import arrow_dtype_ok
from tapllm.collect.writer import Manifest, OrderedShardWriter, ShardEntry, remove_library_temporaries
from tapllm.hidden_states.capture import resolve
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.sampling_params import SamplingParams

logger = logging.getLogger("tapllm")
FORMAT = "tapllm.activations"
_OURS = ("run.json", "metadata.json", "state.json", "dataset_info.json")


@dataclass(slots=True)
class CollectConfig:
    """Everything that defines a collection run (and the engine settings to run it with)."""

    input: Path
    out: Path
    model: str | None = None
    layers: list[int] | str = "all"
    points: list[str] = field(default_factory=lambda: ["resid_post"])
    positions: str = "prompt"
    max_tokens: int = 0
    fmt: str = "safetensors"
    shard_tokens: int = 65536
    dtype: str = "auto"
    workers: int = 1
    overwrite: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_gb: float = 2.0

    def validate(self) -> None:
        """``ValueError`` naming the bad setting."""
        if self.positions not in ("prompt", "all"):
            raise ValueError(f"--positions must be 'prompt' or 'all', got {self.positions!r}")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens must be >= 0 (0 = prompts only), got {self.max_tokens}")
        if self.fmt not in ("safetensors", "arrow"):
            raise ValueError(f"--format must be 'safetensors' or 'arrow', got {self.fmt!r}")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")

    def spec(self) -> HiddenStatesSpec:
        """What every request captures."""
        positions = self.positions if self.max_tokens > 0 else "prompt"
        return HiddenStatesSpec(layers=self.layers, points=self.points, positions=positions)

    def params(self) -> SamplingParams:
        """Greedy, so a rerun produces the same tokens and so the same dataset."""
        return SamplingParams(max_tokens=max(1, self.max_tokens), temperature=0, hidden_states=self.spec())


def build_llm(cfg: CollectConfig, threads: int | None = None) -> Any:
    """The engine a run (or one Ray worker) uses."""
    from tapllm.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    return LLM(cfg.model, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
               max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_memory_gb=cfg.kv_cache_memory_gb,
               hidden_states_max_bytes_per_request=None)


def describe(cfg: CollectConfig, llm: Any, input_sha256: str) -> dict[str, Any]:
    """The run's identity (``run.json``): model, settings, resolved layers, input hash."""
    mc = llm.engine.model_config
    sel = resolve(cfg.spec(), num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
                  num_prompt=1, max_positions=1, encode=True)
    if cfg.fmt == "arrow" and not arrow_dtype_ok(mc.dtype):
        raise ValueError(f"--format arrow cannot store {mc.dtype} (Arrow has no bfloat16); "
                         "use --dtype float32 or float16, or --format safetensors")
    return {
        "format": FORMAT, "version": 1, "model": str(mc.path), "architecture": mc.architecture,
        "dtype": str(mc.dtype).removeprefix("torch."), "hidden_size": mc.hidden_size,
        "layers": list(sel.layers), "points": list(cfg.points), "positions": cfg.spec().positions,
        "max_tokens": cfg.max_tokens, "storage": cfg.fmt, "shard_tokens": cfg.shard_tokens,
        "workers": cfg.workers, "input": str(cfg.input.resolve()), "input_sha256": input_sha256,
    }


def prepare_output(out: Path, run: dict[str, Any], overwrite: bool) -> bool:
    """Create or check the folder; returns True when this exact run is already complete."""
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    existing = json.loads(run_file.read_text()) if run_file.exists() else None
    others = [f for f in out.iterdir() if not _is_ours(f.name)]
    if existing is not None and existing != run or existing is None and any(out.iterdir()):
        if not overwrite:
            what = "a different run's dataset" if existing is not None else "files that are not a tapllm dataset"
            diff = _diff(existing, run) if existing is not None else ", ".join(sorted(f.name for f in others)[:5])
            raise ValueError(f"--out {out} holds {what} ({diff}); pass --overwrite to replace it")
        if others:
            raise ValueError(f"--out {out} holds files tapllm did not write ({others[0].name}, ...); "
                             "not overwriting them: choose an empty folder")
        for f in out.iterdir():
            f.unlink()
        existing = None
    if existing is None:
        _atomic_json(run_file, run)
    return (out / "metadata.json").exists()


def _is_ours(name: str) -> bool:
    return name in _OURS or name.startswith(("part", "progress-part", ".part", ".metadata", ".run", ".tmp"))


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4])


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def split_parts(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of the input, one per worker."""
    bounds = [round(i * n / workers) for i in range(workers + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(workers)]


def render(llm: Any, item: Item) -> str | list[int]:
    """An input record as a prompt."""
    if item.kind == "messages":
        return llm.apply_chat_template(item.value)
    return item.value


def run_part(llm: Any, cfg: CollectConfig, items: list[Item], part: int, start: int, end: int,
             show_progress: bool = True) -> list[ShardEntry]:
    """Collect input indices [start, end) into this part's shards, resuming after its last complete shard.

    ``items`` holds the records of [start, end) (a Ray worker gets only its slice).
    """
    engine = llm.engine
    manifest = Manifest(cfg.out, part)
    done = manifest.load()
    manifest.reset_to(done)  # drop a shard written but not recorded, and our temporaries
    if cfg.workers == 1:  # alone in the folder: a killed run's library temporaries can go too
        remove_library_temporaries(cfg.out)
    resume = done[-1].requests[1] if done else start
    writer = OrderedShardWriter(manifest, resume, len(done), cfg.shard_tokens, cfg.fmt)
    params = cfg.params()
    encode = cfg.max_tokens == 0
    window = 2 * engine.config.max_num_seqs
    in_flight: dict[str, int] = {}
    bar = tqdm(total=end - start, initial=resume - start, desc=f"collecting part {part}" if cfg.workers > 1
               else "collecting", unit="req", disable=not show_progress, dynamic_ncols=True)
    t0, rows0 = time.perf_counter(), 0
    i = resume
    try:
        while i < end or in_flight:
            while i < end and len(in_flight) < window:
                try:
                    text, ids = engine.tokenize(render(llm, items[i - start]))
                    engine.validate_prompt(ids, params, encode)
                except ValueError as exc:
                    raise ValueError(f"--input record {i}: {exc}") from None
                engine.add_request(text, ids, params, request_id=f"collect-{i}", encode=encode)
                in_flight[f"collect-{i}"] = i
                i += 1
            for req in engine.step():
                index = in_flight.pop(req.request_id)
                out = engine.make_output(req)
                writer.put(index, _columns(out, index))
                rows0 += len(out.hidden_states.positions)
                bar.update(1)
                elapsed = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{rows0 / elapsed:.0f} tok/s, {writer.bytes_written / 1e6:.0f} MB written",
                                    refresh=False)
        entries = writer.close()
    except BaseException:
        writer.abort()
        for rid in in_flight:
            engine.abort_request(rid)
        raise
    finally:
        bar.close()
    return done + entries


def _columns(out: Any, index: int) -> dict[str, torch.Tensor]:
    hs = out.hidden_states
    seq = torch.tensor(out.prompt_token_ids + (out.outputs[0].token_ids if out.outputs else []), dtype=torch.long)
    pos = hs.positions
    cols = {"token_id": seq[pos], "request_index": torch.full((len(pos),), index, dtype=torch.long),
            "position": pos.clone()}
    cols.update({p: hs[p] for p in hs.points})
    return cols


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
    remove_library_temporaries(out)  # every writer has finished
    meta = {**run, "num_requests": num_items, "num_rows": rows, "num_shards": len(shards),
            "bytes": sum(e.bytes for e in shards), "shards": [asdict(e) for e in shards], "seconds": round(seconds, 3)}
    if run["storage"] == "arrow":
        _write_datasets_files(out, shards)
    _atomic_json(out / "metadata.json", meta)
    return meta


def _write_datasets_files(out: Path, shards: list[ShardEntry]) -> None:
    import pyarrow as pa
    from datasets import DatasetInfo, Features

    with pa.memory_map(str(out / shards[0].file)) as src:
        schema = pa.ipc.open_stream(src).schema
    info = asdict(DatasetInfo(features=Features.from_arrow_schema(schema)))
    _atomic_json(out / "dataset_info.json", {k: info[k] for k in sorted(info)})
    state = {"_data_files": [{"filename": e.file} for e in shards], "_fingerprint": shards[-1].sha256[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    _atomic_json(out / "state.json", state)


def collect(cfg: CollectConfig, ray_address: str | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Run (or resume) a collection; returns the final metadata."""
    cfg.validate()
    items = read_items(cfg.input)
    if ray_address is None:
        if cfg.workers != 1:
            raise ValueError("--workers needs --ray-address (use 'local' for a Ray instance on this machine)")
        llm = build_llm(cfg)
        run = describe(cfg, llm, fingerprint(cfg.input))
        if prepare_output(cfg.out, run, cfg.overwrite):
            logger.info("%s already holds this complete dataset", cfg.out)
            return json.loads((cfg.out / "metadata.json").read_text())
        parts = split_parts(len(items), 1)
        t0 = time.perf_counter()
        run_part(llm, cfg, items, 0, 0, len(items), show_progress)
        seconds = time.perf_counter() - t0
    else:
        from tapllm.collect.distributed import run_with_ray

        run, parts, seconds = run_with_ray(cfg, items, ray_address, show_progress)
        if run is None:
            return json.loads((cfg.out / "metadata.json").read_text())
    return finalize(cfg.out, run, parts, len(items), seconds)
