"""Random-weight models of each family at real small shapes, for throughput benchmarks.

Built once from transformers' config classes (random weights, the default model's tokenizer
and so vocabulary 49152) and cached under ``$TAPLLM_CACHE/bench-models/<name>``. Their speed,
not their text, is what the benchmarks measure.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152


def _configs() -> dict[str, Any]:
    from transformers import (Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, Olmo2Config,
                              Phi3Config)

    return {
        # GPT-2 small (124M with its own vocabulary).
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
        # Pythia-160M.
        "pythia": GPTNeoXConfig(vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048,
                                use_parallel_residual=True, tie_word_embeddings=False),
        # Gemma-2-2B's block shape, 2 layers (one local, one global).
        "gemma2": Gemma2Config(vocab_size=VOCAB, hidden_size=2304, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=256, intermediate_size=9216,
                               max_position_embeddings=8192, sliding_window=4096),
        # Gemma-3-270M's shape.
        "gemma3": Gemma3TextConfig(vocab_size=VOCAB, hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                                   max_position_embeddings=32768, sliding_window=512),
        # Phi-3-mini's block shape, 2 layers.
        "phi3": Phi3Config(vocab_size=VOCAB, hidden_size=3072, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=32, intermediate_size=8192, max_position_embeddings=4096),
        # Llama-3.2-1B's shape (16 blocks of hidden 2048, GQA 32/8, MLP 8192, tied embeddings); the
        # vocabulary is the default tokenizer's 49,152 instead of 128,256.
        "llama1b": LlamaConfig(vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
                               max_position_embeddings=4096, rms_norm_eps=1e-5,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192}),
        # OLMo-2-1B's block shape, 2 layers.
        "olmo2": Olmo2Config(vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                             num_key_value_heads=16, intermediate_size=8192, max_position_embeddings=4096),
    }


FAMILIES = ("gpt2", "pythia", "gemma2", "gemma3", "phi3", "olmo2", "llama1b")


def family_model(name: str) -> Path:
    """The cached folder of family ``name``'s benchmark model, built on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tapllm.loader import resolve_model
    from tapllm.loader.gguf_convert import cache_root

    folder = cache_root() / "bench-models" / name
    if (folder / "config.json").is_file():
        return folder
    config = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_name(f".{name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(resolve_model(None))).save_pretrained(tmp)
    os.replace(tmp, folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"built the {name} benchmark model ({params / 1e6:.0f}M parameters) in {folder}", flush=True)
    return folder
