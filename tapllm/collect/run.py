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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm._files import atomic_write
from tapllm.engine.request import Request
from tapllm.collect.inputs import Item, fingerprint, read_items
from tapllm.collect.lock import LOCK_NAME, OutputLock
from tapllm.collect.shards import arrow_dtype_ok, write_error
from tapllm.collect.writer import Manifest, ShardEntry, ShardWriter, remove_temporaries
from tapllm.hidden_states.capture import resolve
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.sampling_params import SamplingParams

logger = logging.getLogger("tapllm")
FORMAT = "tapllm.activations"
_OURS = ("run.json", "metadata.json", "state.json", "dataset_info.json", LOCK_NAME)
VERSION = 2  # 2: one shard per group of records decided by the input


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
    """The engine a run (or one Ray worker) uses.

    Prefix caching is off: every request captures from position 0, so the cache could never
    serve a block to it, and without it nothing carries from one group to the next.
    """
    from tapllm.llm import LLM

    if threads:
        torch.set_num_threads(threads)
    return LLM(cfg.model, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
               max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_memory_gb=cfg.kv_cache_memory_gb,
               enable_prefix_caching=False, hidden_states_max_bytes_per_request=None)


def model_config(cfg: CollectConfig) -> Any:
    """The model's config (config.json only: no weights; a GGUF is converted once and cached)."""
    from tapllm.config import ModelConfig
    from tapllm.loader import resolve_model

    return ModelConfig.from_folder(resolve_model(cfg.model), cfg.dtype)


def describe(cfg: CollectConfig, mc: Any, input_sha256: str) -> dict[str, Any]:
    """The run's identity (``run.json``) from the model's config: model, settings, resolved
    layers, input hash. ``ValueError`` for a layer or point the model lacks, or Arrow + bf16."""
    sel = resolve(cfg.spec(), num_layers=mc.num_layers, hidden_size=mc.hidden_size, model_dtype=mc.dtype,
                  num_prompt=1, max_positions=1, encode=True)
    if cfg.fmt == "arrow" and not arrow_dtype_ok(mc.dtype):
        raise ValueError(f"--format arrow cannot store {mc.dtype} (Arrow has no bfloat16); "
                         "use --dtype float32 or float16, or --format safetensors")
    return {
        "format": FORMAT, "version": VERSION, "model": str(mc.path), "architecture": mc.architecture,
        "dtype": str(mc.dtype).removeprefix("torch."), "hidden_size": mc.hidden_size,
        "layers": list(sel.layers), "points": list(cfg.points), "positions": cfg.spec().positions,
        "max_tokens": cfg.max_tokens, "storage": cfg.fmt, "shard_tokens": cfg.shard_tokens,
        "workers": cfg.workers, "input": str(cfg.input.resolve()), "input_sha256": input_sha256,
    }


def check_engine(llm: Any, run: dict[str, Any]) -> None:
    """The loaded engine is the one ``run`` was described with (a worker node could resolve
    ``--dtype auto`` differently from the driver)."""
    mc = llm.engine.model_config
    dtype = str(mc.dtype).removeprefix("torch.")
    if dtype != run["dtype"] or mc.hidden_size != run["hidden_size"]:
        raise RuntimeError(f"the engine runs {mc.path} in {dtype}, but this run was described as {run['model']} "
                           f"in {run['dtype']}; pass --dtype explicitly")


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
    try:
        atomic_write(path, json.dumps(obj, indent=2))
    except OSError as exc:
        raise write_error(path, exc) from None


def split_parts(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of the input, one per worker."""
    bounds = [round(i * n / workers) for i in range(workers + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(workers)]


def render(llm: Any, item: Item) -> str | list[int]:
    """An input record as a prompt."""
    if item.kind == "messages":
        return llm.apply_chat_template(item.value)
    return item.value




def plan_groups(llm: Any, cfg: CollectConfig, items: list[Item], start: int, first: int, end: int
                ) -> Iterator[tuple[int, int, list[Request]]]:
    """The groups of records [first, end) as ``(first, end, [prepared request, ...])``, lazily.

    A group ends at the first record where its rows reach ``--shard-tokens``, counting each
    record's rows from the input alone: its prompt tokens, plus ``max_tokens - 1`` when
    generated positions are captured (an upper bound; generation may stop early). So the cut
    after a group depends only on where the group starts, and a run resumed at a group
    boundary cuts every later group where the uninterrupted run did.
    """
    engine = llm.engine
    params, encode = cfg.params(), cfg.max_tokens == 0
    extra = cfg.max_tokens - 1 if cfg.max_tokens > 0 and cfg.spec().positions == "all" else 0
    group: list[Request] = []
    g0, rows = first, 0
    for i in range(first, end):
        try:
            req = engine.prepare(render(llm, items[i - start]), params, encode=encode, request_id=f"collect-{i}")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--input record {i}: {exc}") from None
        group.append(req)
        rows += req.num_prompt_tokens + extra
        if rows >= cfg.shard_tokens:
            yield g0, i + 1, group
            group, g0, rows = [], i + 1, 0
    if group:
        yield g0, end, group


def run_part(llm: Any, cfg: CollectConfig, items: list[Item], part: int, start: int, end: int,
             show_progress: bool = True) -> list[ShardEntry]:
    """Collect input indices [start, end) into this part's shards, resuming after its last complete shard.

    ``items`` holds the records of [start, end) (a Ray worker gets only its slice). One group
    at a time: its requests are admitted (at most ``2 * max_num_seqs`` in flight) and run to
    the end before the next group starts, while the writer thread writes the previous group.
    """
    engine = llm.engine
    manifest = Manifest(cfg.out, part)
    done = manifest.load()
    manifest.reset_to(done)  # drop a shard written but not recorded, and our temporaries
    resume = done[-1].requests[1] if done else start
    writer = ShardWriter(manifest, len(done), cfg.fmt)
    params, encode = cfg.params(), cfg.max_tokens == 0
    window = 2 * engine.config.max_num_seqs
    in_flight: dict[str, int] = {}
    bar = tqdm(total=end - start, initial=resume - start, desc=f"collecting part {part}" if cfg.workers > 1
               else "collecting", unit="req", disable=not show_progress, dynamic_ncols=True)
    t0, rows0 = time.perf_counter(), 0
    try:
        for g0, g1, staged in plan_groups(llm, cfg, items, start, resume, end):
            if engine.has_unfinished_requests():
                raise RuntimeError("the engine still holds requests at a group boundary")
            records: list[dict[str, torch.Tensor] | None] = [None] * len(staged)
            k = 0
            while k < len(staged) or in_flight:
                while k < len(staged) and len(in_flight) < window:
                    engine.add(staged[k])
                    in_flight[staged[k].request_id] = k
                    k += 1
                for req in engine.step():
                    j = in_flight.pop(req.request_id)
                    out = engine.make_output(req)
                    if getattr(out, "error", None) or out.hidden_states is None:
                        reason = getattr(out, "error", None) or "no hidden states were captured"
                        raise RuntimeError(f"--input record {g0 + j}: {reason}")
                    records[j] = _columns(out, g0 + j)
                    rows0 += len(out.hidden_states.positions)
                    bar.update(1)
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{rows0 / elapsed:.0f} tok/s, {writer.bytes_written / 1e6:.0f} MB written",
                                        refresh=False)
            writer.put(g0, g1, records)  # waits for the previous shard; this one is written meanwhile
        entries = writer.close()
    except BaseException:
        for rid in in_flight:
            engine.abort(rid)
        writer.abort()
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
            llm = build_llm(cfg)
            check_engine(llm, run)
            t0 = time.perf_counter()
            run_part(llm, cfg, items, 0, 0, len(items), show_progress)
            seconds = time.perf_counter() - t0
        else:
            from tapllm.collect.distributed import run_with_ray

            seconds = run_with_ray(cfg, run, items, parts, ray_address, show_progress)
        return finalize(cfg.out, run, parts, len(items), seconds)
