"""The row shapes of a model's points, read off its modules (not guessed from its config)."""

from __future__ import annotations

from torch import nn

from tapllm.config import ModelConfig
from tapllm.models.base import MLP, Attention, GatedMLP
from tapllm.models.moe import SparseMoE
from tapllm.tap.points import HIDDEN_POINTS, row_shapes


def point_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """One position's row shape at one block, per point inside attention and the MLP that ``model`` has.

    The dimensions come from its first attention and MLP modules (every block of the
    families here has the same); a point whose module the model lacks is left out. A
    mixture-of-experts model has ``router_logits`` and ``expert_out`` and no ``mlp_post`` (its experts'
    neurons are not one row), and ``shared_expert_out`` where its sparse blocks have a shared expert.
    """
    dims: dict[str, int] = {}
    parts: set[str] = set()
    moe = next((m for m in model.modules() if isinstance(m, SparseMoE)), None)
    if moe is not None:
        dims.update(n_experts=moe.routing.num_experts, hidden=moe.experts.hidden)
        if moe.shared_expert is not None:
            parts.add("shared_expert")
    for m in model.modules():
        if isinstance(m, Attention) and "heads" not in dims:
            dims.update(heads=m.num_heads, kv_heads=m.num_kv, head_dim=m.head_dim)
        elif isinstance(m, GatedMLP | MLP) and "d_mlp" not in dims and moe is None:
            dims["d_mlp"] = m.inter
    return _inside(row_shapes(dims, frozenset(parts)))



def config_point_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """What :func:`point_shapes` will find in the model ``config`` describes, from the config alone.

    For checks made before the weights load (``tapllm collect`` refuses a bad point first); a
    loaded engine reads its modules instead.
    """
    dims = {"heads": config.num_heads, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    parts: frozenset[str] = frozenset()
    if num_experts(config):
        dims.update(n_experts=num_experts(config), hidden=config.hidden_size)
        if has_shared_expert(config):
            parts = frozenset({"shared_expert"})
    else:
        dims["d_mlp"] = mlp_width(config)
    return _inside(row_shapes(dims, parts))


def _inside(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The points of ``shapes`` a model may or may not have: every point but the hidden-size ones that all
    models have (``shared_expert_out``, which needs a shared expert, stays)."""
    return {name: shape for name, shape in shapes.items() if name not in HIDDEN_POINTS}


def has_shared_expert(config: ModelConfig) -> bool:
    """Whether the sparse blocks of the MoE model ``config`` describes have a shared expert (Qwen2-MoE's)."""
    hf = config.hf_config
    return config.architecture.startswith("Qwen2Moe") and bool(getattr(hf, "shared_expert_intermediate_size", 0))


def mlp_width(config: ModelConfig) -> int:
    """The MLP's hidden width (neurons) of the model ``config`` describes (GPT-2: ``n_inner``, or 4 x hidden)."""
    hf = config.hf_config
    return int(getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * config.hidden_size)


def num_experts(config: ModelConfig) -> int:
    """The experts of each sparse block of the model ``config`` describes; 0 for a dense model."""
    hf = config.hf_config
    return int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0)


def experts_per_token(config: ModelConfig) -> int:
    """How many experts each token is routed to (top-k) in the MoE model ``config`` describes; 0 when dense."""
    return int(getattr(config.hf_config, "num_experts_per_tok", 0) or 0) if num_experts(config) else 0


def sparse_layers(config: ModelConfig) -> tuple[int, ...]:
    """The blocks whose MLP is a mixture of experts (with a router) in the model ``config`` describes
    (:func:`is_sparse_layer`); none when dense."""
    return tuple(i for i in range(config.num_layers) if is_sparse_layer(config, i))


def is_sparse_layer(config: ModelConfig, layer: int) -> bool:
    """Whether block ``layer``'s MLP is a mixture of experts: in an MoE model, every block but those in
    ``mlp_only_layers`` and those ``decoder_sparse_step`` skips (Qwen-MoE's)."""
    hf = config.hf_config
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return (num_experts(config) > 0 and layer not in (getattr(hf, "mlp_only_layers", None) or [])
            and (layer + 1) % step == 0)
