"""gpt-oss checkpoints as OpenAI publishes them, the experts in MXFP4, dequantized once into a cached folder.

Such a folder's ``config.json`` has ``quantization_config: {quant_method: "mxfp4", ...}`` and every
block's experts are ``mlp.experts.gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` /
``_scales``: 32 FP4 (e2m1) values per block, two to a byte, with one power-of-two scale (e8m0) per
block. transformers' own dequantization (:func:`transformers.integrations.mxfp4.convert_moe_packed_tensors`,
what ``Mxfp4Config(dequantize=True)`` runs) turns each pair into the float tensor of a float checkpoint
(``gate_up_proj`` ``[E, hidden, 2I]``, ``down_proj`` ``[E, I, hidden]``), in the checkpoint's dtype
(bfloat16 for the published models), which holds every MXFP4 value exactly. The result, with the
other tensors and files as they are and the config without its ``quantization_config``, is kept
under tapllm's cache like a GGUF file's dequantization, so later starts are a plain load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tapllm.loader.weights import weight_files
from tapllm.utils.cache import cache_root, files_key
from tapllm.utils.files import atomic_path

logger = logging.getLogger("tapllm")

ARCHITECTURES = ("GptOssForCausalLM",)
_SHARD_BYTES = 2 << 30  # dequantized tensors written per output file
_WEIGHTS = ("model.safetensors.index.json",)


def quant_method(folder: Path) -> str | None:
    """The ``quant_method`` of ``folder``'s ``quantization_config`` (None: a float checkpoint)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    quant = config.get("quantization_config")
    return str(quant.get("quant_method")) if isinstance(quant, dict) else None


def mxfp4_to_folder(folder: Path) -> Path:
    """The cached dequantized folder of the MXFP4 checkpoint ``folder``, converted on first use."""
    config = json.loads((folder / "config.json").read_text())
    archs = config.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
        raise ValueError(f"model: {folder} is an MXFP4 checkpoint of {archs}; MXFP4 checkpoints load for "
                         f"{list(ARCHITECTURES)} only")
    files = weight_files(folder)
    target = cache_root() / "mxfp4" / f"{folder.name}-{files_key([*files, folder / 'config.json'], 'v1')}"
    if (target / "config.json").is_file():
        logger.info("loading cached dequantized MXFP4 weights from %s", target)
        return target
    logger.info("dequantizing the MXFP4 experts of %s once; caching the weights in %s", folder, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(target, folder=True) as tmp:
            _convert(folder, files, config, tmp)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent conversion winning
            raise
    return target


def _dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"MXFP4 checkpoint: unknown dtype {name!r} in its config.json")
    return dtype


def _convert(folder: Path, files: list[Path], config: dict[str, Any], out: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    where: dict[str, Path] = {}
    for f in files:
        if f.suffix != ".safetensors":
            raise ValueError(f"MXFP4 checkpoint {folder}: expected safetensors weights, got {f.name}")
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    dtype = _dtype(config)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, f in where.items():
        if name.endswith("_scales"):
            continue  # read with its blocks
        with safe_open(str(f), framework="pt") as st:
            tensor = st.get_tensor(name)
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            if base + "_scales" not in where:
                raise ValueError(f"MXFP4 checkpoint {folder}: {name} has no {base}_scales")
            with safe_open(str(where[base + "_scales"]), framework="pt") as st:
                scales = st.get_tensor(base + "_scales")
            name, tensor = base, convert_moe_packed_tensors(tensor, scales, dtype=dtype)
        shard[name] = tensor.contiguous()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= _SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in folder.iterdir():  # tokenizer, generation config, chat template: as they are
        if f.is_file() and f.suffix not in (".safetensors", ".bin") and f.name not in ("config.json", *_WEIGHTS):
            shutil.copy2(f, out / f.name)
