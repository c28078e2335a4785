"""llama.cpp's mixture-of-experts architectures: Mixtral (a ``llama`` file with experts), Qwen2-MoE
(``qwen2moe``), Qwen3-MoE (``qwen3moe``) and OLMoE (``olmoe``).

llama.cpp stacks every expert's projection of a block into one tensor (``ffn_gate_exps``, ``ffn_up_exps``
``[E, I, hidden]``, ``ffn_down_exps`` ``[E, hidden, I]``; newer converters may write gate and up fused as
``ffn_gate_up_exps`` ``[E, 2I, hidden]``); the model's ``checkpoint_names`` places the halves into its
``[gate; up]`` rows. Qwen2-MoE's shared expert is ``ffn_{gate,up,down}_shexp`` and its gate
``ffn_gate_inp_shexp``. What the files do not store follows llama.cpp, which runs them: the chosen
experts' weights are renormalised for Mixtral and Qwen3-MoE, not for Qwen2-MoE and OLMoE (unless the
file says otherwise in ``expert_weights_norm``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tapllm.loader.gguf_arch import LLAMA_BLOCK

MOE_BLOCK = {
    **LLAMA_BLOCK,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_exps",
    "ffn_up_exps.weight": "mlp.experts.up_exps",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # [gate; up] per expert: the stacked layout
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}

QWEN2MOE_BLOCK = {
    **MOE_BLOCK,
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}

Shapes = dict[str, tuple[int, ...]]


def _first(shapes: Shapes, layers: int, suffix: str) -> tuple[int, ...] | None:
    """The shape of the first block's tensor ``blk.N.{suffix}`` (dense blocks may come first)."""
    return next((shapes[f"blk.{i}.{suffix}"] for i in range(layers) if f"blk.{i}.{suffix}" in shapes), None)


def expert_width(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> int | None:
    """One expert's hidden width: ``expert_feed_forward_length``, else the stacked tensors' shape."""
    if meta.get("expert_feed_forward_length"):
        return int(meta["expert_feed_forward_length"])
    layers = int(cfg["num_hidden_layers"])
    if (shape := _first(shapes, layers, "ffn_gate_exps.weight")) is not None:
        return shape[1]
    if (shape := _first(shapes, layers, "ffn_gate_up_exps.weight")) is not None:
        return shape[1] // 2
    return None


def _renormalize(cfg: dict[str, Any], meta: dict[str, Any]) -> None:
    if "expert_weights_norm" in meta:
        cfg["norm_topk_prob"] = bool(meta["expert_weights_norm"])


def llama_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> None:
    """A ``llama`` file with experts is a Mixtral (llama.cpp writes both as ``llama``)."""
    if int(meta.get("expert_count") or 0) > 0:
        cfg["model_type"] = "mixtral"
        cfg["num_local_experts"] = int(meta["expert_count"])
        cfg["num_experts_per_tok"] = int(meta["expert_used_count"])
        cfg.pop("num_experts", None)


def moe_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> None:
    """Qwen3-MoE: the experts' width, which transformers' GGUF reader leaves at its config's default."""
    if (width := expert_width(cfg, meta, shapes)) is not None:
        cfg["moe_intermediate_size"] = width
    _renormalize(cfg, meta)


def qwen2moe_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> None:
    """Qwen2-MoE: the experts' and the shared expert's widths, and the blocks with a dense MLP (no router)."""
    moe_configure(cfg, meta, shapes)
    layers = int(cfg["num_hidden_layers"])
    shared = meta.get("expert_shared_feed_forward_length")
    if shared is None:
        shape = _first(shapes, layers, "ffn_up_shexp.weight")
        shared = shape[0] if shape is not None else 0
    cfg["shared_expert_intermediate_size"] = int(shared)
    cfg["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    cfg["decoder_sparse_step"] = 1


def qwen2moe_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    """The shared expert's gate, ``[1, hidden]``, may be stored as a vector."""
    if name.endswith("shared_expert_gate.weight") and data.ndim == 1:
        return data[None]
    return data


def olmoe_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> None:
    """OLMoE (its config built from the metadata): the experts' width is its ``intermediate_size``; q/k/v
    clipping where the file states ``attention.clamp_kqv``; no renormalisation unless the file says so."""
    if (width := expert_width(cfg, meta, shapes)) is not None:
        cfg["intermediate_size"] = width
    if meta.get("attention.clamp_kqv"):
        cfg["clip_qkv"] = float(meta["attention.clamp_kqv"])
    cfg["norm_topk_prob"] = False
    _renormalize(cfg, meta)
