"""A plan of a tensor- (and pipeline-) parallel split, made without reading or allocating any weight.

Each rank's shard is built exactly as a running rank builds it (the family's own model code from
the rank's local config, :func:`~tapllm.parallel.sharding.build_shard`), but on PyTorch's meta
device: its parameters have shapes and dtypes and no storage. Their bytes are counted by the
function that counts a loaded rank's for ``LLM.describe()``
(:func:`~tapllm.parallel.sharding.weight_bytes_by_dtype`), and the KV cache's bytes per token by
the one that sizes a running rank's cache, so a plan says what the engine would hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapllm.config import ModelConfig, resolve_dtype
from tapllm.layers.linear import Linear
from tapllm.models import build_model
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.pipeline import keep_stage
from tapllm.parallel.quant_shard import finish_tied_head, quantize_shard
from tapllm.parallel.sharding import (build_shard, kv_bytes_per_token, layout_for, stages_of, weight_bytes,
                                      weight_bytes_by_dtype)
from tapllm.quant.embedding import quantize_embedding
from tapllm.quant.linear import quantize_linears
from tapllm.quant.schemes import Quantization, parse_quantization
from tapllm.utils.dtypes import dtype_name

DEFAULT_MEMORY_UTILIZATION = 0.9  # the engine's (and vLLM's) default share of a GPU's memory


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank holds: its part of each split dimension and its bytes."""

    layout: ShardLayout  # its part of its stage's tensor-parallel split
    weight_bytes_by_dtype: dict[torch.dtype, int]
    buffer_bytes: int  # non-parameter tensors of the modules (rotary tables): on the device too
    kv_bytes_per_token: int  # K and V of one token, every block its stage holds, this rank's KV heads
    stage: int = 0  # its pipeline stage
    blocks: tuple[int, int] | None = None  # the blocks [start, stop) its stage holds (None: every block)

    @property
    def rank(self) -> int:
        """Its rank among all (stage by stage, as the engine numbers them)."""
        return self.stage * self.layout.size + self.layout.rank

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_dtype.values())


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """How a model splits over ``tensor_parallel_size`` ranks, and what each rank's memory must hold:
    its weights, its module buffers and the KV cache of ``kv_tokens`` tokens (activations are not
    counted: ``gpu_memory_utilization`` leaves room for them, as the engine does)."""

    model: str
    architecture: str
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    ranks: tuple[RankPlan, ...]
    model_weight_bytes: int  # the whole model's, in one process
    kv_tokens: int
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    pipeline_parallel_size: int = 1
    quantization: str | None = None  # e.g. "int4-g128"; None: weights in ``dtype``

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ranks) // self.pipeline_parallel_size

    def kv_bytes(self, rank: int = 0) -> int:
        """Bytes of rank ``rank``'s KV cache for ``kv_tokens`` tokens."""
        return self.kv_tokens * self.ranks[rank].kv_bytes_per_token

    def rank_bytes(self, rank: int = 0) -> int:
        """Everything rank ``rank`` holds: weights, buffers and its KV cache."""
        r = self.ranks[rank]
        return r.weight_bytes + r.buffer_bytes + self.kv_bytes(rank)

    @property
    def budget_bytes(self) -> int | None:
        """The memory a rank may fill (``gpu_memory_utilization`` of ``gpu_memory_bytes``); None: not given."""
        if self.gpu_memory_bytes is None:
            return None
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's bytes fit its budget (None: no device memory was given)."""
        budget = self.budget_bytes
        return None if budget is None else all(self.rank_bytes(r) <= budget for r in range(len(self.ranks)))

    def kv_tokens_that_fit(self, rank: int = 0) -> int | None:
        """How many tokens of KV cache the budget leaves room for next to the weights (None: no budget)."""
        budget = self.budget_bytes
        if budget is None:
            return None
        r = self.ranks[rank]
        return max(0, budget - r.weight_bytes - r.buffer_bytes) // r.kv_bytes_per_token

    def __str__(self) -> str:
        lay, n, pp = self.ranks[0].layout, len(self.ranks), self.pipeline_parallel_size
        lines = [
            f"plan: {self.model} ({self.architecture}), {dtype_name(self.dtype)}"
            f"{f' with {self.quantization} weights' if self.quantization else ''}, tensor_parallel_size="
            f"{self.tensor_parallel_size}" + (f", pipeline_parallel_size={pp}" if pp > 1 else ""),
            f"model: {self.num_layers} blocks, hidden {self.hidden_size}; weights {_gb(self.model_weight_bytes)} "
            f"in one process",
            f"per rank: {lay.parts_text()}",
        ]
        if pp > 1:
            stages = sorted({(r.stage, r.blocks) for r in self.ranks if r.blocks is not None})
            lines.append("stages: " + ", ".join(f"{s}: blocks {a}-{b - 1}" for s, (a, b) in stages)
                         + " (stage 0 also holds the embedding, final norm and LM head)")
        budget = self.budget_bytes
        fit_head = "" if budget is None else (
            f"  fits {self.gpu_memory_bytes / 2**30:g} GiB x {self.gpu_memory_utilization:g} = {_gb(budget)}")
        staged = pp > 1
        lines.append(f"{'rank':>4}  {'stage  ' if staged else ''}{'weights':>10}  {'buffers':>9}  {'KV/token':>10}  "
                     f"{f'KV x {self.kv_tokens} tokens':>22}  {'total':>10}{fit_head}")
        for i, r in enumerate(self.ranks):
            fit = "" if budget is None else ("  yes" if self.rank_bytes(i) <= budget else "  NO")
            lines.append(f"{i:>4}  {f'{r.stage:>5}  ' if staged else ''}{_gb(r.weight_bytes):>10}  {_gb(r.buffer_bytes):>9}  "
                         f"{r.kv_bytes_per_token:>8} B  {_gb(self.kv_bytes(i)):>22}  "
                         f"{_gb(self.rank_bytes(i)):>10}{fit}")
        weights = max(self.ranks, key=lambda r: r.weight_bytes)
        by_dtype = ", ".join(f"{dtype_name(d)} {_gb(b)}" for d, b in weights.weight_bytes_by_dtype.items())
        share = max(r.weight_bytes for r in self.ranks) / self.model_weight_bytes
        lines.append(f"weights per rank (the largest): {by_dtype}; {share:.4f} of the model's (1/{n} = {1 / n:.4f})")
        room = self.kv_tokens_that_fit()
        if room is not None:
            lines.append(f"KV room per rank next to the weights: {room} tokens; "
                         f"{'fits' if self.fits else 'does NOT fit'} (activations not counted)")
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def plan_split(config: Any, tensor_parallel_size: int, dtype: str | torch.dtype = "auto", *,
               max_model_len: int | None = None, max_num_seqs: int = 1, kv_tokens: int | None = None,
               gpu_memory_gib: float | None = None,
               gpu_memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
               pipeline_parallel_size: int = 1, quantization: str | None = None,
               quantization_group_size: int | None = None, quantize_embedding: bool = True) -> SplitPlan:
    """Plan ``config``'s model over ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks, each rank's
    shard built on the meta device.

    Args:
        config: a model folder or its ``config.json`` (any ``.json`` file holding a config), a dict
            of such a file's fields, a transformers config object, or a :class:`ModelConfig`.
        tensor_parallel_size: the ranks; ``ValueError`` names each config field it cannot split
            (sizes that do not divide split unevenly: balanced contiguous parts, each rank planned with its own).
        dtype: the weights' and KV cache's dtype; ``"auto"``: the checkpoint's declared one (float32 if none).
        max_model_len, max_num_seqs: the KV cache is sized for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens (default: one sequence of the model's context) ...
        kv_tokens: ... unless this many tokens are given.
        gpu_memory_gib, gpu_memory_utilization: a rank's device memory and the share of it weights,
            buffers and the KV cache may fill; ``fits`` says whether every rank's do.
        pipeline_parallel_size: stages of blocks (``ValueError`` when more than the blocks), each
            stage's blocks split over ``tensor_parallel_size`` ranks; stage 0 also holds the embedding,
            the final norm and the LM head (as the engine splits them).
        quantization, quantization_group_size, quantize_embedding: weights quantized as the engine quantizes
            them (``"int8"``, ``"int4"``, ``"q4_k"``; ``"gguf"`` takes its layouts from a file and is refused),
            each rank's packed blocks counted with its weights.
    """
    size = tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    quant = parse_quantization(quantization, quantization_group_size)
    if quant is not None and quant.method == "gguf":
        raise ValueError("quantization='gguf' cannot be planned: its blocks' layouts come from the GGUF file; "
                         "plan 'int8', 'int4' or 'q4_k'")
    cfg = _model_config(config, dtype)
    layouts = [layout_for(cfg, r, size, quant) for r in range(size)]  # checks the model can be split first
    stages = stages_of(cfg, pipeline_parallel_size)  # and that its blocks can
    ranks: list[RankPlan] = []
    built: dict[tuple[int, ...], tuple[dict[torch.dtype, int], int]] = {}
    with torch.device("meta"):
        whole = weight_bytes(_whole(cfg, quant, quantize_embedding))
        for s, (start, stop) in enumerate(stages):
            for layout in layouts:
                # A shard's modules depend only on its local sizes (and blocks), equal on every rank of an
                # even split: ranks with the same sizes share one build's counts (an uneven split builds
                # each size once).
                key = (layout.heads, layout.kv_heads, layout.neurons, layout.vocab, start, stop)
                if key not in built:
                    shard = build_shard(cfg, layout, None)
                    if len(stages) > 1:
                        keep_stage(shard, start, stop, s == 0)
                    if quant is not None:
                        quantize_shard(shard, quant, None, quantize_embedding, cfg)
                        finish_tied_head(shard)
                    blocks = {id(b) for n, b in shard.named_buffers() if n.rpartition(".")[2] == "blocks"}
                    built[key] = (weight_bytes_by_dtype(shard), sum(b.numel() * b.element_size()
                                                                    for b in shard.buffers() if id(b) not in blocks))
                by_dtype, buffers = built[key]
                kv = kv_bytes_per_token(cfg, layout) * (stop - start) // cfg.num_layers
                ranks.append(RankPlan(layout, by_dtype, buffers, kv, s, (start, stop) if len(stages) > 1 else None))
    if kv_tokens is None:
        kv_tokens = max_num_seqs * (max_model_len or cfg.max_model_len)
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0, got {kv_tokens}")
    return SplitPlan(
        model=cfg.path.name or str(cfg.path), architecture=cfg.architecture, dtype=cfg.dtype,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ranks=tuple(ranks), model_weight_bytes=whole,
        kv_tokens=kv_tokens, gpu_memory_bytes=None if gpu_memory_gib is None else int(gpu_memory_gib * 2**30),
        gpu_memory_utilization=gpu_memory_utilization, pipeline_parallel_size=pipeline_parallel_size,
        quantization=quant.describe() if quant is not None else None)


def _whole(cfg: ModelConfig, quant: Quantization | None, embedding: bool) -> torch.nn.Module:
    """The whole model on the current (meta) device, quantized as one process quantizes it."""
    model = build_model(cfg)
    if quant is not None:
        model.quant = quant
        quantize_linears(model, quant, Linear)
        if embedding:
            quantize_embedding(model, quant)
        model.prepare_for_inference(False)  # a tied head: over the table's blocks, or quantized from it
    return model


def _model_config(config: Any, dtype: str | torch.dtype) -> ModelConfig:
    """The :class:`ModelConfig` of what ``plan_split`` was given (``dtype="auto"`` as on a GPU: the declared one)."""
    if isinstance(config, ModelConfig):
        return config if dtype == "auto" else dataclasses.replace(config, dtype=resolve_dtype(dtype, {}, "meta"))
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if path.is_dir():
            return ModelConfig.from_folder(path, dtype, "meta")
        if path.is_file() and path.name == "config.json":
            return ModelConfig.from_folder(path.parent, dtype, "meta")
        if path.is_file() and path.suffix == ".json":
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"corrupt config file {path}: {exc}") from exc
            return _from_fields(raw, path.stem, dtype)
        raise FileNotFoundError(f"{path}: no model folder or config .json file there")
    if isinstance(config, Mapping):
        return _from_fields(dict(config), None, dtype)
    if hasattr(config, "to_json_string"):
        return ModelConfig.from_transformers(config, dtype, "meta")
    raise TypeError(f"cannot plan from a {type(config).__name__}: give a model folder, a config .json file, "
                    "a dict of its fields or a transformers config")


def _from_fields(raw: dict[str, Any], name: str | None, dtype: str | torch.dtype) -> ModelConfig:
    """A config.json's fields as transformers' config object for their ``model_type``."""
    from transformers import AutoConfig

    values = dict(raw)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("the config has no model_type field (e.g. 'llama'): transformers cannot read it")
    hf = AutoConfig.for_model(model_type, **values)
    if name is not None and not values.get("_name_or_path"):
        hf.name_or_path = name
    return ModelConfig.from_transformers(hf, dtype, "meta")
