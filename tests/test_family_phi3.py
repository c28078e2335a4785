"""Phi-3 through the shared family harness, LongRoPE on both sides of its limit, and GGUF.

Two tiny checkpoints: Phi-3-mini-4k style (plain rotary, a sliding window shorter than the
prompts, untied head) and Phi-4-mini / Phi-3-128k style (LongRoPE with a tiny
``original_max_position_embeddings`` of 32, partial rotary, tied embeddings, sharded).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM, SamplingParams

LAYOUT = HFLayout(
    blocks=lambda m: m.model.layers,
    attn_out=lambda b: b.self_attn,
    mlp_out=lambda b: b.mlp,
    final_norm=lambda m: m.model.norm,
)
LIMIT = 32  # original_max_position_embeddings of the LongRoPE model
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


def _configs() -> dict:
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.2, 4.0, 11.0, 30.0]}
    return {
        "mini-4k": Phi3Config(vocab_size=49152, tie_word_embeddings=False, sliding_window=16, **TINY),
        "longrope": Phi3Config(vocab_size=49152, tie_word_embeddings=True, rope_parameters=rope,
                               original_max_position_embeddings=LIMIT, **TINY),
    }


def _random_norms(model) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, default_model_folder):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in _configs().items():
        folder = save_tiny_model(tmp_path_factory.mktemp(name), cfg, default_model_folder,
                                 shard="2MB" if name == "longrope" else "10GB", init=_random_norms)
        out[name] = folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert len(list(out["longrope"][0].glob("*.safetensors"))) > 1  # sharded
    return out


# Under the LongRoPE limit throughout (longest sequence: 23 + 8 tokens), so every harness
# situation (chunking, prefix hits, preemption) is in the short regime.
@pytest.mark.parametrize("name", ["mini-4k", "longrope"])
def test_phi3_situations(phi3, name):
    folder, model = phi3[name]
    check_situations(folder, model, random_prompts([3, 14, 23], seed=31), 8)


@pytest.mark.parametrize("name", ["mini-4k", "longrope"])
def test_phi3_every_point(phi3, name):
    folder, model = phi3[name]
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 22], seed=32), 5)


@pytest.mark.parametrize("name", ["mini-4k", "longrope"])
def test_phi3_steering(phi3, name):
    folder, model = phi3[name]
    check_steering(folder, model, LAYOUT)


def test_longrope_over_the_limit_in_one_step(phi3):
    """Prompts past the limit run in one step: every row takes the long factors, as in one transformers forward."""
    folder, model = phi3["longrope"]
    long_prompts = random_prompts([40, 75], seed=51)
    short_prompts = random_prompts([5, 20], seed=52)
    refs = [hf_greedy(model, p, 6) for p in long_prompts + short_prompts]
    llm = LLM(folder, dtype="float32", block_size=4)
    for p, ref in zip(long_prompts, refs):
        assert_matches_reference(llm.generate([p], GREEDY, use_tqdm=False), [ref])
    # Batched with sequences under the limit: each sequence keeps its own regime.
    assert_matches_reference(llm.generate(long_prompts + short_prompts, GREEDY, use_tqdm=False), refs)
    hits = llm.generate(long_prompts, GREEDY, use_tqdm=False)  # prefix-cache hits
    assert all(o.metrics["num_cached_tokens"] > 0 for o in hits)
    assert_matches_reference(hits, refs[:2])
    check_points(llm, model, LAYOUT, long_prompts[:1], 4)


def test_longrope_crossing_while_decoding_keeps_cached_keys(phi3):
    """A sequence crossing the limit while decoding: new rows take the long factors, cached keys keep theirs.

    That is a transformers forward over its KV cache, step by step (``hf_greedy``). Two
    sequences decode side by side, one row at position 31 (short) next to one at 32 (long).
    """
    folder, model = phi3["longrope"]
    prompts = random_prompts([28, 29], seed=53)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    assert_matches_reference(LLM(folder, dtype="float32").generate(prompts, params, use_tqdm=False), refs)


def test_longrope_does_not_depend_on_scheduling(phi3):
    """A prompt past the limit gives the same results prefilled in chunks, preempted or served from the cache.

    The factors depend on the request alone (its prompt is longer than the limit), so every
    schedule equals one transformers forward over the whole prompt; the prefix cache keeps the
    regimes apart.
    """
    folder, model = phi3["longrope"]
    long_prompt = random_prompts([40], seed=54)[0]
    short = long_prompt[:30]  # a prefix under the limit: the short factors, the same tokens
    refs = [hf_greedy(model, long_prompt, 6), hf_greedy(model, short, 6)]
    chunked = LLM(folder, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert_matches_reference(chunked.generate([long_prompt], GREEDY, use_tqdm=False), refs[:1])
    cached = LLM(folder, dtype="float32", block_size=4)
    assert_matches_reference(cached.generate([short], GREEDY, use_tqdm=False), refs[1:])
    again = cached.generate([long_prompt], GREEDY, use_tqdm=False)  # must not reuse the short-regime blocks
    assert again[0].metrics["num_cached_tokens"] == 0
    assert_matches_reference(again, refs[:1])
    tight = LLM(folder, dtype="float32", block_size=4, kv_cache_blocks=27, enable_prefix_caching=False)
    batch = [long_prompt, short, long_prompt[:35]]
    outs = tight.generate(batch, GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert_matches_reference(outs[:2], refs)


def _phi3_gguf(folder, model, path):
    """Write the checkpoint as llama.cpp's converter does: fused attn_qkv and ffn_up, factor tensors, metadata."""
    from safetensors.torch import load_file

    from gguf_writer import write_gguf

    cfg = model.config
    sd = {}
    for shard in folder.glob("*.safetensors"):
        sd.update(load_file(shard))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf_name, cpp in names.items():
            tensors[f"blk.{i}.{cpp}.weight"] = sd[f"model.layers.{i}.{hf_name}.weight"]
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
          "feed_forward_length": cfg.intermediate_size, "block_count": cfg.num_hidden_layers,
          "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "vocab_size": cfg.vocab_size,
          "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
          "rope.freq_base": float(rope["rope_theta"]), "attention.sliding_window": cfg.sliding_window or 0,
          "rope.scaling.original_context_length": cfg.original_max_position_embeddings}
    if rope["rope_type"] == "longrope":
        import math

        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        kv["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
        tensors["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
        tensors["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
    return write_gguf(path, "phi3", kv, tensors)


@pytest.mark.parametrize("name", ["mini-4k", "longrope"])
def test_phi3_gguf_in_llama_cpp_layout(phi3, name, tmp_path):
    """tapllm on the GGUF equals transformers on the folder, sliding window and LongRoPE included."""
    folder, model = phi3[name]
    path = _phi3_gguf(folder, model, tmp_path / f"tiny-phi3-{name}.gguf")
    prompts = random_prompts([5, 19] if name == "mini-4k" else [5, 40], seed=55)  # past the window / the limit
    refs = [hf_greedy(model, p, 6) for p in prompts]
    assert_matches_reference(LLM(path, dtype="float32").generate(prompts, GREEDY, use_tqdm=False), refs)
    if name == "mini-4k":
        # transformers reads the same file (its reader drops the window: compare within it).
        from transformers import AutoModelForCausalLM

        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        assert hf_greedy(theirs, prompts[0], 6)[0] == refs[0][0]
