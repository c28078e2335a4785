"""Turn a GGUF checkpoint into a cached Hugging Face style folder (config, safetensors, tokenizer).

Dequantizing a GGUF file takes seconds; doing it once and keeping the result as safetensors
makes every later start a plain memory-mapped load. The config and tokenizer come from
transformers' GGUF readers (the same ones a transformers user gets), except for architectures
those do not read (OLMoE, gpt-oss), whose config is built from the file's metadata
(:func:`~tapllm.loader.gguf_arch.metadata_config`); the tensors are dequantized here with the
``gguf`` package so that we control the layout fix-ups. The mixture-of-experts architectures'
mappings are in :mod:`tapllm.loader.gguf_moe`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tapllm.loader.gguf_arch import LLAMA_BLOCK, LLAMA_TOP, GGUFArch, llama_fix, metadata_config
from tapllm.loader.gguf_moe import (GPT_OSS_BLOCK, MOE_BLOCK, QWEN2MOE_BLOCK, combine_gpt_oss, gpt_oss_configure,
                                    llama_configure, moe_configure, olmoe_configure, qwen2moe_configure,
                                    qwen2moe_fix)
from tapllm.utils.cache import cache_root
from tapllm.utils.files import atomic_path

logger = logging.getLogger("tapllm")

_GPT2_BLOCK = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight",
    "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight",
    "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight",
    "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight",
    "ffn_down.bias": "mlp.c_proj.bias",
}
_GPT2_TOP = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}


def _gpt2_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    """llama.cpp stores GPT-2's Conv1D projections transposed to ``[out, in]``; Conv1D keeps ``[in, out]``."""
    if data.ndim == 2 and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return data.T
    return data


def _gpt2_configure(values: dict[str, Any], meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Positions and MLP width from the tensors (the reader keeps GPT-2's defaults, 1024 and 4 x hidden)."""
    values["n_positions"] = shapes["position_embd.weight"][0]
    values["n_inner"] = shapes["blk.0.ffn_up.weight"][0]
    values.pop("feed_forward_length", None)


def _gemma_fix(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    # llama.cpp stores Gemma's RMSNorm scales as 1 + weight (q/k norms too); the checkpoint has weight.
    return data - 1 if name.endswith("norm.weight") else data


# The 27B models (by block count, as llama.cpp tells model sizes apart) scale queries by
# (hidden / heads) ** -0.5, every other size by head_dim ** -0.5 (llama.cpp's rule; the
# files do not store query_pre_attn_scalar). Like llama.cpp, the local/global layer pattern
# is the config's default (every 2nd layer global in Gemma-2, every 6th in Gemma-3), and
# Gemma-3's local rope base is its default 10k.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_configure(arch: str) -> Callable[[dict[str, Any], dict[str, Any], dict[str, tuple[int, ...]]], None]:
    def configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        big = int(cfg["num_hidden_layers"]) == _GEMMA_27B_LAYERS[arch]
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # absent: the config's defaults
            if key in meta:
                cfg[key] = float(meta[key])
        if meta.get("rope.scaling.type") == "linear":  # Gemma-3 4B+: on the global layers
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["rope.scaling.factor"])}

    return configure


# Gemma: Llama's names (no biases), with the four norms around attention and the MLP.
_GEMMA_BLOCK = {
    **{k: v for k, v in LLAMA_BLOCK.items() if not k.endswith(".bias")},
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# Phi-3: llama.cpp keeps the checkpoint's fused [q; k; v] as attn_qkv and [gate; up] as
# ffn_up, unpermuted (its Phi-3 rotary is the rotate-half kind), so they load as they are.
_PHI3_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _phi3_configure(cfg: dict[str, Any], meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """What llama.cpp stores and transformers' reader drops: sliding window, partial rotary, LongRoPE."""
    if meta.get("attention.sliding_window"):  # 0 means none (Phi-4-mini)
        cfg["sliding_window"] = int(meta["attention.sliding_window"])
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.pop("rope_theta", 10000.0))}
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    dims = int(meta.get("rope.dimension_count") or head_dim)
    if dims != head_dim:
        rope["partial_rotary_factor"] = dims / head_dim
    if "rope_factors_long.weight" in meta:
        original = int(meta["rope.scaling.original_context_length"])
        cfg["original_max_position_embeddings"] = original
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    long_factor=meta["rope_factors_long.weight"], short_factor=meta["rope_factors_short.weight"])
        if "rope.scaling.attn_factor" in meta:
            rope["attention_factor"] = float(meta["rope.scaling.attn_factor"])
    cfg["rope_parameters"] = rope


# llama.cpp architecture name -> its mapping. A family adds its entry here.
GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(MOE_BLOCK, LLAMA_TOP, fix=llama_fix, fix_on_rows=True, configure=llama_configure),
    "qwen2": GGUFArch(LLAMA_BLOCK, LLAMA_TOP),
    "qwen3": GGUFArch(LLAMA_BLOCK, LLAMA_TOP),
    "qwen2moe": GGUFArch(QWEN2MOE_BLOCK, LLAMA_TOP, fix=qwen2moe_fix, fix_on_rows=True, configure=qwen2moe_configure),
    "qwen3moe": GGUFArch(MOE_BLOCK, LLAMA_TOP, configure=moe_configure),
    # transformers' GGUF reader has no olmoe: its config is built from the metadata
    "olmoe": GGUFArch(MOE_BLOCK, LLAMA_TOP, configure=olmoe_configure, model_type="olmoe"),
    # transformers' reader of gpt-oss files fails on their rope.scaling.* keys: built from the metadata too
    "gpt-oss": GGUFArch(GPT_OSS_BLOCK, LLAMA_TOP, configure=gpt_oss_configure, combine=combine_gpt_oss,
                        model_type="gpt_oss"),
    "gpt2": GGUFArch(_GPT2_BLOCK, _GPT2_TOP, block_prefix="transformer.h.", fix=_gpt2_fix,
                     architecture="GPT2LMHeadModel", configure=_gpt2_configure),
    # gpt_neox (Pythia): transformers' GGUF reader does not support the architecture.
    "gemma2": GGUFArch(_GEMMA_BLOCK, LLAMA_TOP, fix=_gemma_fix, configure=_gemma_configure("gemma2")),
    "gemma3": GGUFArch(_GEMMA_BLOCK, LLAMA_TOP, fix=_gemma_fix, configure=_gemma_configure("gemma3"),
                       architecture="Gemma3ForCausalLM"),  # config class Gemma3TextConfig
    "phi3": GGUFArch(_PHI3_BLOCK, LLAMA_TOP, configure=_phi3_configure,
                     config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
}


def _cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def gguf_to_folder(path: Path) -> Path:
    """Return the cached folder for ``path``, converting the GGUF file on first use."""
    target = cache_root() / "gguf" / f"{path.stem}-{_cache_key(path)}"
    if (target / "config.json").is_file():
        logger.info("loading cached dequantized weights from %s", target)
        return target
    logger.info("dequantizing %s once; caching the weights as safetensors in %s", path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(target, folder=True) as tmp:
            _convert(path, tmp)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent conversion winning
            raise
    return target


def _convert(path: Path, out: Path) -> None:
    import gguf
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors on a damaged file
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {exc}") from exc
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    mapping = GGUF_ARCHS.get(arch)
    if mapping is None:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; supported: {sorted(GGUF_ARCHS)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: GGUF rope frequency factors (llama3 rope scaling) are not supported")

    prefix = f"{arch}."
    values = {k[len(prefix):]: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}
    if mapping.model_type is not None:
        general = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
        cfg_dict = metadata_config(mapping.model_type, values, general)
    else:
        cfg_dict = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    cfg_dict.pop("_model_name_or_path", None)
    names = {t.name for t in reader.tensors}
    cfg_dict["tie_word_embeddings"] = "output.weight" not in names
    if mapping.configure is not None:
        for t in reader.tensors:
            if t.name in mapping.config_tensors:
                values[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).tolist()
        mapping.configure(cfg_dict, values, {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors})
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    config.architectures = [mapping.architecture or type(config).__name__.replace("Config", "ForCausalLM")]

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", leave=False):
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)]) if data.ndim != len(t.shape) else data
        name = mapping.hf_name(t.name)
        if name is None:
            continue
        if mapping.fix is not None:
            data = mapping.fix(name, data, config)
        tensors[name] = data
    if mapping.combine is not None:
        mapping.combine(tensors, config)
    weights = {k: torch.from_numpy(np.array(tensors.pop(k), dtype=np.float32, order="C", copy=True))
               for k in list(tensors)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    config.save_pretrained(out)

    # AutoTokenizer reads the file's config first, which fails where transformers' reader has no such
    # architecture; the fast tokenizer class builds the tokenizer the file describes (what AutoTokenizer
    # returns for the architectures it reads)
    cls = AutoTokenizer if mapping.model_type is None else PreTrainedTokenizerFast
    tok = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(out)
