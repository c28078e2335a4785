"""Building and loading one rank's part of a model: its shard of every block its pipeline stage holds,
in float, quantized at load, or with a GGUF file's blocks as stored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tapllm.config import ModelConfig
from tapllm.models.base import CausalLM
from tapllm.parallel.gguf_shard import gguf_shard_weights
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layout import ShardLayout
from tapllm.parallel.pipeline import keep_stage
from tapllm.parallel.quant_shard import finish_tied_head, quantize_shard
from tapllm.parallel.sharding import Stage, build_shard, shard_weights
from tapllm.quant.schemes import Quantization


@dataclass(frozen=True, slots=True)
class ShardWeights:
    """How a rank's weights are held: the engine's ``quantization`` choice (None: in the model's dtype),
    ``quantize_embedding``, and the GGUF file behind a ``"gguf"`` one."""

    quant: Quantization | None = None
    embedding: bool = True
    gguf: Path | None = None


def load_shard(cfg: ModelConfig, layout: ShardLayout, group: TPGroup, dummy_seed: int | None = None,
               stage: Stage | None = None, rank: int | None = None, weights: ShardWeights = ShardWeights()
               ) -> CausalLM:
    """Build this rank's model and read its weights (``dummy_seed``: random weights, nothing read); with
    ``stage``, only what that pipeline stage holds. ``rank``: the rank among every stage's (seeds dummy weights).
    ``weights``: quantized as one process quantizes them (the same blocks, cut at block boundaries)."""
    model = build_shard(cfg, layout, group)
    if stage is not None:
        keep_stage(model, stage.start, stage.stop, stage.first)
    quant = weights.quant
    if dummy_seed is not None:
        from tapllm.loader.dummy import fill_dummy_weights

        fill_dummy_weights(model, dummy_seed + (layout.rank if rank is None else rank))
    elif quant is not None and quant.method == "gguf":
        if weights.gguf is None:
            raise ValueError("quantization='gguf' needs the GGUF file")
        model.load_weights(gguf_shard_weights(model, weights.gguf, cfg, layout, stage, quant, weights.embedding,
                                              group))
    else:
        if quant is not None:
            quantize_shard(model, quant, group, weights.embedding, cfg)
        model.load_weights(shard_weights(cfg.path, layout, cfg.architecture, stage))
    finish_tied_head(model)
    model.eval()
    return model
