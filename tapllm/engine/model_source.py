"""From an engine's settings to the model it runs: the checkpoint found, its config read and checked."""

from __future__ import annotations

import logging

import torch

from tapllm.config import EngineConfig, ModelConfig
from tapllm.loader import resolve_model, resolve_tokenizer

logger = logging.getLogger("tapllm")


def resolve_model_config(config: EngineConfig, device: torch.device) -> ModelConfig:
    """The checkpoint of ``config.model`` (a folder, a ``.gguf`` file or a Hub id) as a
    :class:`ModelConfig` for ``device``, with the tokenizer and context length ``config`` sets;
    ``ValueError`` naming the setting that does not fit the model."""
    folder = resolve_model(config.model, config.revision, config.download_dir,
                           weights=config.load_format != "dummy")
    model_config = ModelConfig.from_folder(folder, config.dtype, device)
    if config.tokenizer is not None:
        model_config.tokenizer_path = resolve_tokenizer(config.tokenizer, config.tokenizer_revision,
                                                        config.download_dir)
    if config.max_model_len is not None:
        if config.max_model_len > model_config.max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's context "
                             f"({model_config.max_model_len} positions)")
        model_config.max_model_len = config.max_model_len
    if config.gpu_memory_utilization is not None and device.type == "cpu":
        logger.info("gpu_memory_utilization is ignored on CPU; kv_cache_memory_gb sizes the KV cache")
    return model_config
