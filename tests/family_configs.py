"""One tiny transformers config per supported family (and its variants), for tests that need them all."""

from __future__ import annotations

from typing import Any

VOCAB = 49152
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6)


def family_configs() -> dict[str, Any]:
    """name -> a transformers config of a tiny model of that family (random weights, real options)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig,
                              Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config)

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.2, 4.0, 11.0, 30.0]}
    gemma3_rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}
    neox = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=512, initializer_range=0.2)
    configs = {
        "llama": LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **SMALL),
        "llama3-rope": LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, rope_parameters=llama3, **SMALL),
        "mistral": MistralConfig(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=16, **SMALL),
        "qwen2": Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **SMALL),
        "qwen3": Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, head_dim=32, **SMALL),
        "gemma2": Gemma2Config(vocab_size=VOCAB, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                               attn_logit_softcapping=10.0, final_logit_softcapping=4.0, bos_token_id=1,
                               eos_token_id=2, pad_token_id=2, **{**SMALL, "num_hidden_layers": 4}),
        "gemma3": Gemma3TextConfig(vocab_size=VOCAB, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                                   tie_word_embeddings=False, rope_parameters=gemma3_rope, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=2, **{**SMALL, "num_hidden_layers": 6}),
        "phi3": Phi3Config(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=16, **SMALL),
        "phi3-longrope": Phi3Config(vocab_size=VOCAB, tie_word_embeddings=True, rope_parameters=longrope,
                                    original_max_position_embeddings=32, **SMALL),
        "olmo2": Olmo2Config(vocab_size=VOCAB, tie_word_embeddings=False, **SMALL),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512, initializer_range=0.2,
                           bos_token_id=0, eos_token_id=0),
        "pythia": GPTNeoXConfig(vocab_size=VOCAB, use_parallel_residual=True, rotary_pct=0.25, **neox),
    }
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for config in configs.values():  # what save_pretrained of the model would write
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return configs


def moe_configs() -> dict[str, Any]:
    """name -> a transformers config of a tiny mixture-of-experts model (4 experts, top-2, 32-wide experts).

    Kept apart from :func:`family_configs` (whose families every engine path runs) until the MoE families
    run on those paths too. Between them they cover: renormalised and raw top-k weights, a shared expert,
    a dense block among sparse ones (Qwen2-MoE's ``mlp_only_layers``), per-head and whole-projection q/k
    norms, OLMoE's ``clip_qkv``, and gpt-oss (attention sinks, alternating sliding windows, YaRN, a biased
    router, biased experts with a clamped SwiGLU).
    """
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(vocab_size=VOCAB, tie_word_embeddings=False, num_experts_per_tok=2, **{**SMALL, "intermediate_size": 32})
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # 4 x 128 = max_position_embeddings
    configs = {
        "mixtral": MixtralConfig(num_local_experts=4, **moe),
        "qwen2_moe": Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    norm_topk_prob=False, mlp_only_layers=[1], **{**moe, "intermediate_size": 96}),
        "qwen3_moe": Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32, **moe),
        "olmoe": OlmoeConfig(num_experts=4, norm_topk_prob=False, clip_qkv=2.0, eos_token_id=0, **moe),
        # a small window and SwiGLU limit, so the sliding layers and the clamps really act in tiny runs
        "gpt_oss": GptOssConfig(num_local_experts=4, head_dim=16, sliding_window=8, swiglu_limit=1.0,
                                rope_parameters=yarn, eos_token_id=0, pad_token_id=1, **moe),
    }
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for config in configs.values():
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return configs
