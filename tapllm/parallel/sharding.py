"""A rank's part of a model: its config, its modules, and the slices of the checkpoint it reads.

The model of a rank is the family's own code built from a *local* config (its query heads, KV
heads, MLP neurons and vocabulary rows), so attention and MLP modules need no change; then the
layers that need the other ranks are swapped in (:mod:`tapllm.parallel.layers`): o_proj and
down_proj row-parallel, the embedding and LM head vocabulary-parallel. Each checkpoint tensor
is read as the slice this rank holds (safetensors ``get_slice``: no rank reads the whole
model), then goes through the family's own name mapping (fused q/k/v and gate/up offsets are
those of the local config).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tapllm.config import ModelConfig
from tapllm.loader.weights import iter_weights, weight_files
from tapllm.models import build_model
from tapllm.layers.norm import RMSNorm
from tapllm.models.base import MLP, Attention, CausalLM, GatedMLP
from tapllm.models.shapes import mlp_width
from tapllm.parallel.group import TPGroup
from tapllm.parallel.layers import GatheredHead, RowParallelLinear, ShardedRMSNorm, VocabParallelEmbedding
from tapllm.parallel.layout import ShardLayout, stage_layers
from tapllm.parallel.quant_shard import check_head_split, input_block
from tapllm.quant.schemes import Quantization
from tapllm.utils.hf_config import HFConfig

@dataclass(frozen=True, slots=True)
class Split:
    """How one checkpoint module is cut: what its split dim counts (``unit``), the dim of its weight,
    and whether its bias is cut with the outputs (column-parallel) or kept whole (row-parallel: added
    once after the all-reduce)."""

    unit: str  # heads, kv_heads, qkv ([q; k; v] stacked), qkv_by_head (q, k, v per head), neurons,
    #            gate_up ([gate; up] stacked), vocab
    dim: int
    column: bool = True


_ROW = dict(column=False)
_LLAMA = {
    "q_proj": Split("heads", 0), "k_proj": Split("kv_heads", 0), "v_proj": Split("kv_heads", 0),
    "o_proj": Split("heads", 1, **_ROW), "gate_proj": Split("neurons", 0), "up_proj": Split("neurons", 0),
    "down_proj": Split("neurons", 1, **_ROW), "embed_tokens": Split("vocab", 0), "lm_head": Split("vocab", 0),
}
# A checkpoint module's name (its last one or two components) -> its split, per architecture. Anything
# not named (norms, position embeddings, rotary buffers) is whole on every rank.
RULES: dict[str, dict[str, Split]] = {
    "LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA, "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA, "Gemma2ForCausalLM": _LLAMA, "Gemma3ForCausalLM": _LLAMA,
    "Gemma3ForConditionalGeneration": _LLAMA,
    # OLMo-2's q_norm and k_norm span every head: each rank holds its heads' scales (ShardedRMSNorm)
    "Olmo2ForCausalLM": {**_LLAMA, "q_norm": Split("heads", 0), "k_norm": Split("kv_heads", 0)},
    "Phi3ForCausalLM": {"qkv_proj": Split("qkv", 0), "o_proj": Split("heads", 1, **_ROW),
                        "gate_up_proj": Split("gate_up", 0), "down_proj": Split("neurons", 1, **_ROW),
                        "embed_tokens": Split("vocab", 0), "lm_head": Split("vocab", 0)},
    # GPT-2 stores Conv1D weights as [in, out]: outputs are dim 1
    "GPT2LMHeadModel": {"attn.c_attn": Split("qkv", 1), "attn.c_proj": Split("heads", 0, **_ROW),
                        "mlp.c_fc": Split("neurons", 1), "mlp.c_proj": Split("neurons", 0, **_ROW),
                        "wte": Split("vocab", 0), "lm_head": Split("vocab", 0)},
    "GPTNeoXForCausalLM": {"attention.query_key_value": Split("qkv_by_head", 0),
                           "attention.dense": Split("heads", 1, **_ROW), "mlp.dense_h_to_4h": Split("neurons", 0),
                           "mlp.dense_4h_to_h": Split("neurons", 1, **_ROW), "embed_in": Split("vocab", 0),
                           "embed_out": Split("vocab", 0), "lm_head": Split("vocab", 0)},
}
SHARDABLE = tuple(RULES)


_PLAIN_MLP = ("GPT2LMHeadModel", "GPTNeoXForCausalLM")  # two MLP matrices; the others' gated MLPs have three


def stages_of(cfg: ModelConfig, stages: int) -> list[tuple[int, int]]:
    """The blocks ``[start, stop)`` of each pipeline stage of ``cfg``'s model: stage 0, which runs the LM head
    too, takes fewer by the head's weights over a block's (:func:`~tapllm.parallel.layout.stage_layers`)."""
    attention = cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
    mlp = cfg.hidden_size * mlp_width(cfg) * (2 if cfg.architecture in _PLAIN_MLP else 3)
    return stage_layers(cfg.num_layers, stages, cfg.vocab_size * cfg.hidden_size / (attention + mlp))


def layout_for(cfg: ModelConfig, rank: int, size: int, quant: Quantization | None = None) -> ShardLayout:
    """The split of ``cfg``'s model over ``size`` ranks (``ValueError`` names a field it cannot split). With
    ``quant``, MLP neurons split on the quantized down_proj's blocks, and a head split that cuts o_proj's
    blocks is refused (:mod:`tapllm.parallel.quant_shard`)."""
    if cfg.architecture not in RULES:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {cfg.architecture} yet; "
                         f"supported: {', '.join(SHARDABLE)}")
    neurons = mlp_width(cfg)
    layout = ShardLayout(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, neurons, cfg.vocab_size,
                         neuron_unit=input_block(quant, neurons))
    if quant is not None:
        counts = layout.head_counts
        check_head_split(quant, cfg.num_heads, cfg.head_dim,
                         [(sum(counts[:r]), c) for r, c in enumerate(counts)], size)
    return layout


def local_config(cfg: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """``cfg`` with this rank's heads, KV heads, MLP neurons and vocabulary rows.

    The modules read their head counts and vocabulary from the :class:`ModelConfig`; the transformers config
    keeps the model's own (rotary embeddings derive the head size from it: Phi-3's as hidden size / heads;
    transformers checks the special token ids against its vocabulary size)."""
    hf = cfg.hf_config
    values = hf.to_dict()
    aliases = dict(hf._aliases) if isinstance(hf, HFConfig) else dict(getattr(type(hf), "attribute_map", {}))
    values[aliases.get("intermediate_size", "intermediate_size")] = layout.neurons
    if "n_inner" in values:  # GPT-2's MLP width (None: 4 x hidden)
        values["n_inner"] = layout.neurons
    return dataclasses.replace(cfg, hf_config=HFConfig(values, aliases), num_heads=layout.heads,
                               num_kv_heads=layout.kv_heads, vocab_size=layout.vocab)


def build_shard(cfg: ModelConfig, layout: ShardLayout, group: TPGroup | None) -> CausalLM:
    """This rank's model on the current default device (the CPU; ``torch.device("meta")`` for a plan), weights
    not yet loaded. ``group`` None: a shard that is only measured, never run (its collectives have no group)."""
    local = local_config(cfg, layout)
    model = build_model(local)
    for module in model.modules():
        if isinstance(module, Attention):
            old = module.o_proj
            module.o_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                              cfg.dtype, group)
            widths = {"q_norm": sum(layout.head_counts), "k_norm": sum(layout.kv_head_counts)}
            for name, heads in widths.items():
                norm = getattr(module, name, None)
                if isinstance(norm, RMSNorm) and getattr(module, "qk_norm_spans_heads", False):
                    setattr(module, name, ShardedRMSNorm(norm, group, heads * layout.head_dim))
        elif isinstance(module, GatedMLP | MLP):
            old = module.down_proj
            module.down_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                                 cfg.dtype, group)
    model.embed_tokens = VocabParallelEmbedding(layout.vocab, cfg.hidden_size, layout.vocab_start, cfg.dtype, group)
    head = GatheredHead(cfg.hidden_size, layout.vocab, False, cfg.dtype, group, layout.vocab_counts)
    if model.lm_head is None:  # tied: the head reads the embedding's rows of this rank
        head.weight = model.embed_tokens.weight
    model.lm_head = head
    return model


def _ranges(layout: ShardLayout, unit: str) -> list[tuple[int, int]]:
    """(first index, count) of each run this rank holds along the split dim of a tensor counting ``unit``."""
    d = layout.head_dim
    q = (layout.head_start * d, layout.heads * d)
    kv = (layout.kv_head_start * d, layout.kv_heads * d)
    n = (layout.neuron_start, layout.neurons)
    q_all, kv_all = layout.num_heads * d, layout.num_kv_heads * d
    return {
        "heads": [q],
        "kv_heads": [kv],
        "qkv": [q, (q_all + kv[0], kv[1]), (q_all + kv_all + kv[0], kv[1])],
        "qkv_by_head": [(layout.head_start * 3 * d, layout.heads * 3 * d)],
        "neurons": [n],
        "gate_up": [n, (layout.intermediate_size + n[0], n[1])],
        "vocab": [(layout.vocab_start, layout.vocab)],
    }[unit]


def split_of(name: str, layout: ShardLayout, ndim: int, architecture: str
             ) -> tuple[int, list[tuple[int, int]]] | None:
    """``(dim, [(start, count), ...])`` of checkpoint tensor ``name`` that this rank reads, the runs
    concatenated in order; None: all of it."""
    module, _, kind = name.rpartition(".")
    parts = module.split(".")
    rules = RULES[architecture]
    rule = rules.get(".".join(parts[-2:])) or rules.get(parts[-1])
    if rule is None:
        return None
    if kind == "bias" or ndim == 1:
        if kind == "bias" and not rule.column:  # a row-parallel layer's bias: whole
            return None
        return 0, _ranges(layout, rule.unit)
    return rule.dim, _ranges(layout, rule.unit)


def _cut(tensor: torch.Tensor, dim: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    pieces = [tensor.narrow(dim, start, count) for start, count in runs]
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim)


# The block a checkpoint tensor belongs to: ``model.layers.3.``, GPT-2's ``transformer.h.3.``, GPT-NeoX's
# ``gpt_neox.layers.3.``.
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """The blocks ``[start, stop)`` a pipeline stage holds; ``first``: it holds the embedding and the head."""

    start: int
    stop: int
    first: bool

    def holds(self, name: str, architecture: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this stage."""
        block = _BLOCK.search(name)
        if block is not None:
            return self.start <= int(block.group(1)) < self.stop
        module = name.rpartition(".")[0].split(".")
        rules = RULES[architecture]
        rule = rules.get(".".join(module[-2:])) or rules.get(module[-1])
        return self.first or rule is None or rule.unit != "vocab"


def shard_weights(folder: Path, layout: ShardLayout, architecture: str, stage: Stage | None = None,
                  skip: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of ``folder`` as this rank's slice of it (safetensors: only the slice is read);
    with ``stage``, only the tensors of that pipeline stage; none named in ``skip``."""
    skip = skip or set()
    for file in weight_files(folder):
        if file.suffix != ".safetensors":  # PyTorch .bin files have no partial reads: read, then cut
            for name, tensor in iter_weights(folder):
                if name in skip or (stage is not None and not stage.holds(name, architecture)):
                    continue
                split = split_of(name, layout, tensor.dim(), architecture)
                yield name, tensor if split is None else _cut(tensor, *split)
            return
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in skip or (stage is not None and not stage.holds(name, architecture)):
                    continue
                piece = f.get_slice(name)
                split = split_of(name, layout, len(piece.get_shape()), architecture)
                if split is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, runs = split
                pieces = [piece[start:start + count] if dim == 0 else piece[:, start:start + count]
                          for start, count in runs]
                yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def weight_bytes_by_dtype(model: torch.nn.Module) -> dict[torch.dtype, int]:
    """Bytes of ``model``'s parameters and quantized layers' packed blocks by dtype (a tied head counted once),
    from the tensors themselves: a shard on the meta device counts as its loaded twin does. What ``describe()``
    and a plan both report."""
    out: dict[torch.dtype, int] = {}
    blocks = [b for name, b in model.named_buffers() if name.rpartition(".")[2] == "blocks"]
    for p in [*model.parameters(), *blocks]:  # both yield a shared (tied) tensor once
        out[p.dtype] = out.get(p.dtype, 0) + p.numel() * p.element_size()
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (a tied head counted once)."""
    return sum(weight_bytes_by_dtype(model).values())


def kv_bytes_per_token(cfg: ModelConfig, layout: ShardLayout) -> int:
    """Bytes of K and V cache one token takes on this rank, every block (its KV heads only)."""
    return local_config(cfg, layout).kv_bytes_per_token
