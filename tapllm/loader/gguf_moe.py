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

_LEGACY_EXPERTS = 256  # expert indices mapped for per-expert files (Mixtral's have 8)
MOE_BLOCK = {
    **LLAMA_BLOCK,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_exps",
    "ffn_up_exps.weight": "mlp.experts.up_exps",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # [gate; up] per expert: the stacked layout
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    # files from before llama.cpp stacked the experts (early Mixtral GGUFs): one tensor per expert
    **{f"ffn_{part}.{e}.weight": f"mlp.experts.{e}.{part}_proj.weight"
       for e in range(_LEGACY_EXPERTS) for part in ("gate", "up", "down")},
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


# gpt-oss: llama.cpp de-interleaves the checkpoint's gate/up columns into ffn_gate_exps / ffn_up_exps and
# stores the experts' weights [out, in] (the checkpoint's are [in, out]); combine_gpt_oss rebuilds the
# checkpoint's layout, which the model's checkpoint_names reads.
GPT_OSS_BLOCK = {
    **{k: v for k, v in LLAMA_BLOCK.items() if k.startswith("attn_") and "norm" not in k},
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{part}_exps.{leaf}": f"mlp.experts.{part}_exps{'' if leaf == 'weight' else '_bias'}"
       for part in ("gate", "up", "gate_up", "down") for leaf in ("weight", "bias")},
}


def gpt_oss_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> None:
    """gpt-oss (its config built from the metadata): the expert count under its name, the sliding window,
    and YaRN from the ``rope.scaling.*`` keys. The SwiGLU limit and alpha are not in the files: llama.cpp
    uses gpt-oss's 7.0 and 1.702, the config's defaults, as is its alternation of sliding and global
    layers."""
    cfg["num_local_experts"] = cfg.pop("num_experts")
    if meta.get("attention.sliding_window"):
        cfg["sliding_window"] = int(meta["attention.sliding_window"])
    if (width := expert_width(cfg, meta, shapes)) is not None:
        cfg["intermediate_size"] = width
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.pop("rope_theta", 150000.0))}
    if meta.get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(meta["rope.scaling.factor"]), truncate=False,
                    original_max_position_embeddings=int(meta["rope.scaling.original_context_length"]),
                    beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)))
    cfg["rope_parameters"] = rope


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[..., I]`` gate and up -> ``[..., 2I]`` with gate at the even positions, up at the odd ones."""
    return np.stack((gate, up), axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def combine_gpt_oss(tensors: dict[str, np.ndarray], config: Any) -> None:
    """The experts in the checkpoint's layout: ``gate_up_proj`` ``[E, hidden, 2I]`` (interleaved columns) with
    ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj`` ``[E, I, hidden]``, ``down_proj_bias`` ``[E, hidden]``."""
    for name in [n for n in tensors if n.endswith(("gate_exps", "gate_up_exps"))]:
        prefix = name.rpartition(".")[0] + "."
        for leaf, out in (("", "gate_up_proj"), ("_bias", "gate_up_proj_bias")):
            if prefix + "gate_up_exps" + leaf in tensors:  # [gate; up] along the outputs
                both = tensors.pop(prefix + "gate_up_exps" + leaf)
                gate, up = np.split(both, 2, axis=1)
            elif prefix + "gate_exps" + leaf in tensors:
                gate, up = tensors.pop(prefix + "gate_exps" + leaf), tensors.pop(prefix + "up_exps" + leaf)
            else:
                continue
            if leaf:
                tensors[prefix + out] = _interleave(gate, up)
            else:  # [E, I, hidden] each -> [E, hidden, 2I]
                tensors[prefix + out] = _interleave(gate.transpose(0, 2, 1), up.transpose(0, 2, 1))
        if prefix + "down_exps" in tensors:
            tensors[prefix + "down_proj"] = tensors.pop(prefix + "down_exps").transpose(0, 2, 1)
        if prefix + "down_exps_bias" in tensors:
            tensors[prefix + "down_proj_bias"] = tensors.pop(prefix + "down_exps_bias")
