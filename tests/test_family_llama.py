"""The Llama family (Llama, Mistral, Qwen2, Qwen3) through the shared family harness."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM

LAYOUT = HFLayout(
    blocks=lambda m: m.model.layers,
    attn_out=lambda b: b.self_attn,
    mlp_out=lambda b: b.mlp,
    final_norm=lambda m: m.model.norm,
)


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_situations_points_and_steering(arch, tiny_models):
    model = _hf(tiny_models[arch])
    check_situations(tiny_models[arch], model, random_prompts([3, 14, 27], seed=31), 8)
    check_points(LLM(tiny_models[arch], dtype="float32"), model, LAYOUT, random_prompts([1, 9, 22], seed=32), 5)
    check_steering(tiny_models[arch], model, LAYOUT)


def test_gguf_written_in_llama_cpp_layout_loads_and_matches(tiny_models, tmp_path):
    """The test GGUF writer round-trips a Llama checkpoint: tapllm on the GGUF equals transformers on the folder."""
    from safetensors.torch import load_file

    from conftest import assert_matches_reference, hf_greedy
    from gguf_writer import permute_for_llama_cpp, write_gguf
    from tapllm import SamplingParams

    folder = tiny_models["llama"]
    model = _hf(folder)
    cfg = model.config
    sd = load_file(folder / "model.safetensors")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        for hf_name, cpp in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if cpp == "attn_q":
                w = permute_for_llama_cpp(w, cfg.num_attention_heads)
            elif cpp == "attn_k":
                w = permute_for_llama_cpp(w, cfg.num_key_value_heads)
            tensors[f"blk.{i}.{cpp}.weight"] = w
    kv = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
          "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
          "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
          "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "vocab_size": cfg.vocab_size,
          "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads}
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", kv, tensors)
    prompts = random_prompts([5, 19], seed=41)
    refs = [hf_greedy(model, p, 6) for p in prompts]
    llm = LLM(path, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
