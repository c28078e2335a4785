"""Tiny mixture-of-experts models written as GGUF files the way llama.cpp's ``convert_hf_to_gguf.py`` lays
them out: Mixtral as ``llama`` (q/k rows permuted for its rotary, experts stacked), Qwen2-MoE as ``qwen2moe``
(with the shared expert's ``*_shexp`` tensors), Qwen3-MoE, OLMoE, and gpt-oss as ``gpt-oss`` (its gate/up
columns de-interleaved into ``ffn_gate_exps``/``ffn_up_exps``, the experts' ``[in, out]`` weights
transposed, biases beside them, ``attn_sinks``). The routers stay F32, as llama.cpp's quantizer keeps them.

:func:`write_moe_gguf` also returns the state dict a transformers model must hold to compute what the
file holds: the tensors stored quantized are rounded through the ``gguf`` package's quantize and
dequantize, along the axis llama.cpp stores as rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gguf_writer import permute_for_llama_cpp, write_gguf

ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.router": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def llama_cpp_tensors(family: str, sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The model's tensors (transformers' in-memory names and layouts) under llama.cpp's names and layouts."""
    out = {}
    for name, t in sd.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        i, rest = re.match(r"model\.layers\.(\d+)\.(.+)$", name).groups()
        blk = f"blk.{i}."
        if family == "gpt_oss" and rest.startswith("mlp.experts."):
            leaf = rest.removeprefix("mlp.experts.")
            if leaf == "gate_up_proj":  # [E, hidden, 2I], gate and up interleaved column by column
                w = t.transpose(1, 2)
                out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = w[:, 0::2], w[:, 1::2]
            elif leaf == "gate_up_proj_bias":
                out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = t[:, 0::2], t[:, 1::2]
            elif leaf == "down_proj":  # [E, I, hidden]
                out[blk + "ffn_down_exps.weight"] = t.transpose(1, 2)
            else:
                out[blk + "ffn_down_exps.bias"] = t
            continue
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, hidden]: [gate; up] per expert
            half = t.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = t[:, :half], t[:, half:]
            continue
        if rest == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = t
            continue
        if rest == "self_attn.sinks":
            out[blk + "attn_sinks.weight"] = t
            continue
        module, leaf = rest.rsplit(".", 1)
        cpp = _BLOCK[module]
        if family == "gpt_oss" and cpp == "ffn_norm":
            cpp = "post_attention_norm"
        if family == "mixtral" and cpp in ("attn_q", "attn_k"):
            t = permute_for_llama_cpp(t, cfg.num_attention_heads if cpp == "attn_q" else cfg.num_key_value_heads)
        out[f"{blk}{cpp}.{leaf}"] = t
    return {k: v.contiguous() for k, v in out.items()}


def llama_cpp_metadata(family: str, cfg: Any) -> dict[str, Any]:
    """The ``{arch}.*`` metadata llama.cpp's converter writes for the model (keys without the prefix)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
          "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
          "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
          "attention.key_length": head_dim, "attention.value_length": head_dim,
          "rope.freq_base": float(cfg.rope_parameters["rope_theta"]), "rope.dimension_count": head_dim,
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "vocab_size": cfg.vocab_size,
          "expert_count": getattr(cfg, "num_local_experts", None) or cfg.num_experts,
          "expert_used_count": cfg.num_experts_per_tok}
    if family in ("qwen2_moe", "qwen3_moe"):
        kv["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if family == "qwen2_moe":
        kv["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if family == "olmoe" and cfg.clip_qkv:
        kv["attention.clamp_kqv"] = float(cfg.clip_qkv)
    if family == "gpt_oss":
        rope = cfg.rope_parameters
        kv.update({"expert_feed_forward_length": cfg.intermediate_size, "attention.sliding_window": cfg.sliding_window,
                   "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                   "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
    return kv


def _stored_as(name: str, t: torch.Tensor, qtype: str | None, experts_only: bool) -> str | None:
    """The quantized type a tensor is stored in (None: F32): weights (not biases) of two or more dimensions
    whose rows fill whole blocks, never a router."""
    if qtype is None or t.dim() < 2 or not name.endswith(".weight") or name.endswith(_ROUTERS) or t.shape[-1] % 32:
        return None
    if experts_only and "_exps." not in name:
        return None
    return qtype


def _round_trip(t: torch.Tensor, qtype: str, axis: int) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType[qtype]
    x = t.movedim(axis, -1).contiguous()
    arr = x.reshape(-1, x.shape[-1]).numpy()
    back = torch.from_numpy(np.asarray(dequantize(quantize(arr, kind), kind), dtype=np.float32))
    return back.reshape(x.shape).movedim(-1, axis).contiguous()


def _row_axis(family: str, name: str) -> int:
    """The axis of a transformers tensor that llama.cpp stores as a row (quantized in blocks along it)."""
    if family == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return 1  # stored [in, out]: transposed in the file
    return -1


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacked experts as llama.cpp wrote them before it stacked them: ``blk.N.ffn_gate.E.weight``, ..."""
    out = {}
    for name, t in tensors.items():
        if m := re.match(r"(blk\.\d+\.ffn_(?:gate|up|down))_exps\.weight$", name):
            out.update({f"{m.group(1)}.{e}.weight": t[e].contiguous() for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def write_moe_gguf(path: Path, family: str, model: Any, qtype: str | None = None, experts_only: bool = False,
                   legacy: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``model`` (a transformers MoE model) as llama.cpp would to ``path``, its weights of two or more
    dimensions stored as ``qtype`` (the experts' only with ``experts_only``; None: all F32; ``legacy``: one
    tensor per expert, as early Mixtral files); returns the path and the state dict of what the file holds,
    dequantized."""
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    tensors = llama_cpp_tensors(family, sd, cfg)
    if legacy:
        tensors = per_expert(tensors)
    types = {n: k for n, t in tensors.items() if (k := _stored_as(n, t, qtype, experts_only)) is not None}
    write_gguf(path, ARCHS[family], llama_cpp_metadata(family, cfg), tensors, types)
    held = dict(sd)
    if types:  # the same tensors under the model's names: each is stored quantized iff its llama.cpp parts are
        for name, t in sd.items():
            parts = llama_cpp_tensors(family, {name: t}, cfg)
            parts = per_expert(parts) if legacy else parts
            if any(p in types for p in parts):
                held[name] = _round_trip(t, qtype, _row_axis(family, name))
    return path, held
