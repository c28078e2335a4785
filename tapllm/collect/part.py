"""One part of a collection run on one engine: the run's settings, its engine, and the loop
that turns groups of consecutive records into shards.

Used by the driver for a run in one process (``run.collect``) and by each Ray actor for its
part (``distributed.CollectWorker``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapllm.collect.contexts import ContextSettings
from tapllm.collect.hf_input import DatasetSpec
from tapllm.collect.router_columns import ROUTER_SOURCES, router_columns
from tapllm.collect.sae_columns import feature_columns, sae_spec
from tapllm.collect.sources import DatasetSource, ItemSource
from tapllm.collect.writer import Manifest, ShardEntry, ShardWriter
from tapllm.config import EngineConfig
from tapllm.engine.core_request import EngineCoreRequest
from tapllm.engine.llm_engine import LLMEngine
from tapllm.hidden_states.spec import HEAD_POINTS, HIDDEN_POINTS, HiddenStatesSpec
from tapllm.models.shapes import experts_per_token
from tapllm.sampling_params import SamplingParams
from tapllm.utils.dtypes import dtype_from_name, dtype_name


@dataclass(slots=True)
class CollectConfig:
    """Everything that defines a collection run, and ``engine``: the engine to run it with
    (its model, dtype and limits; ``max_num_seqs`` is 64 and ``batch_invariant`` True unless given,
    so that a resumed or re-sharded run writes the bits an uninterrupted one would).

    The input is either ``input`` (a JSONL/Parquet file or ``save_to_disk`` folder of prompt
    records, one request each) or ``dataset`` (any ``datasets`` dataset, streamed and cut
    into contexts by ``context_size``, ``packing``, ``truncate``, ``prepend_bos``,
    ``max_rows`` and ``max_tokens_total``).

    With ``sae``, every row also holds that SAE's ``sae_top`` largest latents as a sparse row:
    ``sae_ids`` (int32) and ``sae_values`` (float32), each ``[1, sae_top]``, and ``sae_error_norm``
    (see ``tapllm.collect.sae_columns``); ``points=[]`` then stores the features alone.

    With ``router`` (a mixture-of-experts model), every row also holds the chosen experts of each captured
    block: ``expert_ids`` (int16) and ``expert_weights`` (float32), each ``[layers, top_k]``
    (``tapllm.collect.router_columns``); ``points=[]`` then stores them alone.
    """

    out: Path
    input: Path | None = None
    dataset: DatasetSpec | None = None
    layers: list[int] | str = "all"
    points: list[str] = field(default_factory=lambda: ["resid_post"])
    positions: str = "prompt"
    max_tokens: int = 0
    fmt: str = "safetensors"
    shard_tokens: int = 65536
    workers: int = 1
    overwrite: bool = False
    context_size: int | None = None  # None: the model's context
    packing: bool = False
    truncate: bool = False
    prepend_bos: bool | None = None  # None: when the tokenizer has a BOS token
    max_rows: int | None = None
    max_tokens_total: int | None = None
    exclude_special_tokens: bool = False
    store_dtype: str = "auto"  # auto: the compute dtype (float32 where the format lacks it)
    sae: str | None = None  # an SAE (path or hub id): its top-k latents stored as sparse columns
    sae_top: int = 64
    router: bool = False  # per-token chosen experts and their weights (an MoE model)
    recipe: Any = None  # e.g. tapllm.collect.eagle3.Eagle3Settings: a recipe runs the run its own way
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_num_seqs=64, batch_invariant=True))

    def validate_output(self) -> None:
        """``ValueError`` naming a bad setting of what is written and by how many workers (any run's,
        a recipe's too)."""
        if self.fmt not in ("safetensors", "arrow"):
            raise ValueError(f"--format must be 'safetensors' or 'arrow', got {self.fmt!r}")
        if self.store_dtype != "auto" and dtype_from_name(self.store_dtype) is None:
            raise ValueError(f"--store-dtype must be auto, float32, float16 or bfloat16, got {self.store_dtype!r}")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")

    def validate(self) -> None:
        """``ValueError`` naming the bad setting."""
        if self.recipe is not None:
            return self.recipe.validate(self)
        if (self.input is None) == (self.dataset is None):
            raise ValueError("give the input as either --input FILE or --dataset NAME_OR_PATH")
        if self.input is not None:
            used = [flag for flag, v in (("--context-size", self.context_size), ("--packing", self.packing or None),
                                         ("--truncate", self.truncate or None), ("--prepend-bos", self.prepend_bos),
                                         ("--max-rows", self.max_rows), ("--max-tokens-total", self.max_tokens_total))
                    if v is not None]
            if used:
                raise ValueError(f"{', '.join(used)} apply to --dataset (--input records are run as they are)")
        if self.dataset is not None and self.max_tokens > 0:
            raise ValueError("--max-tokens applies to --input: --dataset contexts are run as prompts only")
        if self.dataset is not None and self.workers != 1 and self.max_tokens_total is not None:
            raise ValueError("--max-tokens-total is a budget over one stream: with --workers, limit the input "
                             "with --max-rows")
        if self.positions not in ("prompt", "all"):
            raise ValueError(f"--positions must be 'prompt' or 'all', got {self.positions!r}")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens must be >= 0 (0 = prompts only), got {self.max_tokens}")
        self.validate_output()
        if not self.points and self.sae is None and not self.router:
            raise ValueError("--points is empty: name at least one point (or give --sae to store features alone, "
                             "--router the routing alone)")
        if self.router and self.sae is not None:
            raise ValueError("--router and --sae: collect them in separate runs")
        if self.sae is not None and not 1 <= self.sae_top <= 1024:
            raise ValueError(f"--sae-top must be in [1, 1024], got {self.sae_top}")
        inside = [p for p in self.points if p in HEAD_POINTS]
        if inside:
            hint = " (--router stores each token's chosen experts and weights)" if set(inside) & set(ROUTER_SOURCES) else ""
            raise ValueError(f"--points: datasets hold residual-width points ({', '.join(HIDDEN_POINTS)}); "
                             f"{inside} are per head, neuron or expert: capture them with LLM.encode / generate{hint}")

    def contexts(self, bos_token_id: int | None, max_model_len: int) -> ContextSettings:
        """How ``--dataset`` records become contexts, for a tokenizer and a model context."""
        if self.prepend_bos and bos_token_id is None:
            raise ValueError("--prepend-bos: the tokenizer has no BOS token")
        size = self.context_size if self.context_size is not None else max_model_len
        if size > max_model_len:
            raise ValueError(f"--context-size {size} is longer than the model's context ({max_model_len} positions)")
        s = ContextSettings(size=size, packing=self.packing, truncate=self.truncate,
                            bos_token_id=bos_token_id if self.prepend_bos is not False else None,
                            max_records=self.max_rows, max_tokens=self.max_tokens_total)
        s.validate()
        return s

    def spec(self) -> HiddenStatesSpec:
        """What every request captures."""
        positions = self.positions if self.max_tokens > 0 else "prompt"
        if self.sae is not None:
            return sae_spec(self, positions)
        points = [*self.points, *ROUTER_SOURCES] if self.router else self.points
        return HiddenStatesSpec(layers=self.layers, points=points, positions=positions)

    def params(self) -> SamplingParams:
        """Greedy, so a rerun produces the same tokens and so the same dataset."""
        return SamplingParams(max_tokens=max(1, self.max_tokens), temperature=0, hidden_states=self.spec())


def build_engine(cfg: CollectConfig, threads: int | None = None) -> LLMEngine:
    """The engine a run (or one Ray worker) uses: ``cfg.engine``, with prefix caching off and
    no limit on captured bytes.

    Prefix caching is off: every request captures from position 0, so the cache could never
    serve a block to it, and without it nothing carries from one group to the next.
    """
    if threads:
        torch.set_num_threads(threads)
    return LLMEngine.from_config(replace(cfg.engine, enable_prefix_caching=False,
                                         hidden_states_max_bytes_per_request=None))


def check_engine(engine: LLMEngine, run: dict[str, Any]) -> None:
    """The loaded engine is the one ``run`` was described with (a worker node could resolve
    ``--dtype auto`` differently from the driver), and it takes the run's contexts."""
    mc = engine.model_config
    dtype = dtype_name(mc.dtype)
    if dtype != run["dtype"] or mc.hidden_size != run["hidden_size"]:
        raise RuntimeError(f"the engine runs {mc.path} in {dtype}, but this run was described as {run['model']} "
                           f"in {run['dtype']}; pass --dtype explicitly")
    size = (run.get("context") or {}).get("size")
    if size is not None and size > mc.max_model_len:
        raise RuntimeError(f"--context-size {size} is longer than the {mc.max_model_len} positions the KV cache "
                           "holds; give a smaller --context-size or more --kv-cache-memory-gb")


Source = ItemSource | DatasetSource


def plan_groups(engine: LLMEngine, cfg: CollectConfig, source: Source, first: int, cursor: list[int] | None
                ) -> Iterator[tuple[int, int, list[EngineCoreRequest], list[int] | None]]:
    """The groups of the source's prompts from index ``first`` on (``cursor`` locates it in a
    stream) as ``(first, end, [prepared request, ...], cursor after the group)``, lazily.

    A group ends at the first prompt where its rows reach ``--shard-tokens``, counting each
    prompt's rows from the input alone: its tokens, plus ``max_tokens - 1`` when generated
    positions are captured (an upper bound; generation may stop early). So the cut after a
    group depends only on where the group starts, and a run resumed at a group boundary cuts
    every later group where the uninterrupted run did.
    """
    params, encode = cfg.params(), cfg.max_tokens == 0
    extra = cfg.max_tokens - 1 if cfg.max_tokens > 0 and cfg.spec().positions == "all" else 0
    where = "--input record" if isinstance(source, ItemSource) else "--dataset context"
    group: list[EngineCoreRequest] = []
    g0, rows, last = first, 0, first
    processor = engine.input_processor
    for i, prompt, after in source.prompts(first, cursor, processor.render_chat, engine.tokenizer):
        try:
            req = processor.prepare(prompt, params, encode=encode, request_id=f"collect-{i}")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where} {i}: {exc}") from None
        group.append(req)
        rows += req.num_prompt_tokens + extra
        cursor, last = after, i + 1
        if rows >= cfg.shard_tokens:
            yield g0, last, group, cursor
            group, g0, rows = [], last, 0
    if group:
        yield g0, last, group, cursor


def run_part(engine: LLMEngine, cfg: CollectConfig, source: Source, part: int, show_progress: bool = True
             ) -> list[ShardEntry]:
    """Collect the source's prompts into this part's shards, resuming after its last complete shard.

    One group at a time: its requests are admitted (at most ``2 * max_num_seqs`` in flight)
    and run to the end before the next group starts, while the writer thread writes the
    previous group.
    """
    manifest = Manifest(cfg.out, part)
    done = manifest.load()
    manifest.reset_to(done)  # drop a shard written but not recorded, and our temporaries
    resume = done[-1].requests[1] if done else source.start
    cursor = done[-1].cursor if done else None
    store = dtype_from_name(cfg.store_dtype)
    top_k = experts_per_token(engine.model_config) if cfg.router else 0
    special = (torch.tensor(sorted(engine.tokenizer.all_special_ids), dtype=torch.long)
               if cfg.exclude_special_tokens else None)
    writer = ShardWriter(manifest, len(done), cfg.fmt)
    window = 2 * engine.config.max_num_seqs
    in_flight: dict[str, int] = {}
    where = "--input record" if isinstance(source, ItemSource) else "--dataset context"
    total = source.end - source.start if source.end is not None else None
    bar = tqdm(total=total, initial=resume - source.start, desc=f"collecting part {part}" if cfg.workers > 1
               else "collecting", unit="req", disable=not show_progress, dynamic_ncols=True)
    t0, rows0 = time.perf_counter(), 0
    try:
        for g0, g1, staged, after in plan_groups(engine, cfg, source, resume, cursor):
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
                        raise RuntimeError(f"{where} {g0 + j}: {reason}")
                    records[j] = _columns(out, g0 + j, store, special, top_k)
                    rows0 += len(out.hidden_states.positions)
                    bar.update(1)
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{rows0 / elapsed:.0f} tok/s, {writer.bytes_written / 1e6:.0f} MB written",
                                        refresh=False)
            writer.put(g0, g1, records, after)  # waits for the previous shard; this one is written meanwhile
        entries = writer.close()
    except BaseException:
        for rid in in_flight:
            engine.abort(rid)
        writer.abort()
        raise
    finally:
        bar.close()
    return done + entries


def _columns(out: Any, index: int, store: torch.dtype | None, special: torch.Tensor | None, top_k: int = 0
             ) -> dict[str, torch.Tensor]:
    """One request's rows: ids, positions and each point (in the store dtype), with ``top_k`` the routing
    columns (``--router``), without the rows of special tokens when ``special`` is given."""
    hs = out.hidden_states
    seq = torch.tensor(out.prompt_token_ids + (out.outputs[0].token_ids if out.outputs else []), dtype=torch.long)
    pos = hs.positions
    cols = {"token_id": seq[pos], "request_index": torch.full((len(pos),), index, dtype=torch.long),
            "position": pos.clone()}
    stored = [p for p in hs.points if not (top_k and p in ROUTER_SOURCES)]
    cols.update({p: hs[p] if store is None else hs[p].to(store) for p in stored})
    if top_k:
        cols.update(router_columns(hs, top_k))
    if hs.features is not None:
        cols.update(feature_columns(hs.features))
    if special is not None:
        keep = ~torch.isin(cols["token_id"], special)
        if not bool(keep.all()):
            cols = {k: v[keep] for k, v in cols.items()}
    return cols
