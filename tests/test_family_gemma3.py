"""Gemma-3 (text) through the shared family harness: q/k norms, two rope bases, linear rope scaling on global layers.

The tiny checkpoint has Gemma-3's layer pattern (five local layers with a window of 8, then a
global one), a local rope base of 10k and a global one of 1M with linear scaling (factor 4),
random norm weights (q/k norms included), a query scalar that is not the head size, and an
untied head (the Gemma-2 test covers the tied one).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, random_prompts, save_tiny_model
from family_harness import check_points, check_situations, check_steering
from tapllm import LLM, SamplingParams
from test_family_gemma2 import LAYOUT, gguf_metadata, gguf_reference, gguf_tensors, randomise_norms

WINDOW = 8
LOCAL = ("sliding_attention",) * 5 + ("full_attention",)


def tiny_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
        query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}},
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, default_model_folder):
    """A tiny Gemma-3 text checkpoint (model_type gemma3_text) and transformers' model on it."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("gemma3") / "gemma3", tiny_config(), default_model_folder,
                             init=randomise_norms)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    return folder, model


def test_config_layers_and_ropes(gemma3):
    folder, model = gemma3
    llm = LLM(folder, dtype="float32")
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.head_dim == 32
    assert cfg.sliding_windows == tuple(WINDOW if t == "sliding_attention" else None for t in LOCAL)
    m = llm.engine.runner.model
    assert m.final_logit_softcap is None and m.lm_head is not None
    assert all(layer.self_attn.opts.softcap is None for layer in m.layers)
    # Local and global layers rotate differently: the global table is 1M-based and scaled by 1/4.
    local, glob = m.rotary["sliding_attention"], m.rotary["full_attention"]
    ref = model.model.rotary_emb
    pos = torch.arange(40)[None]
    for table, kind in ((local, "sliding_attention"), (glob, "full_attention")):
        cos, sin = ref(torch.zeros(1, dtype=torch.float32), pos, kind)
        got_cos, got_sin = table.cos_sin(pos[0], torch.float32)
        assert torch.allclose(got_cos[:, 0], cos[0], atol=1e-6) and torch.allclose(got_sin[:, 0], sin[0], atol=1e-6)
    assert not torch.allclose(local.cos[:40], glob.cos[:40])


def test_situations_points_and_steering(gemma3):
    folder, model = gemma3
    check_situations(folder, model, random_prompts([3, 3 * WINDOW + 3, 4 * WINDOW], seed=31), 8)
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 3 * WINDOW + 1], seed=32), 5)
    check_steering(folder, model, LAYOUT)


def test_gguf_written_in_llama_cpp_layout_loads_and_matches(gemma3, tmp_path):
    """A GGUF in llama.cpp's gemma3 layout (q/k norms + 1, global rope base and linear scaling in metadata)."""
    from gguf_writer import write_gguf

    folder, model = gemma3
    cfg = model.config
    tensors = gguf_tensors(folder)
    assert "output.weight" in tensors and "blk.0.attn_q_norm.weight" in tensors
    kv = gguf_metadata(cfg) | {"rope.freq_base": 1_000_000.0, "rope.scaling.type": "linear",
                               "rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3", kv, tensors)
    llm = LLM(path, dtype="float32")
    got = llm.engine.model_config
    assert got.architecture == "Gemma3ForCausalLM" and got.hf_config.model_type == "gemma3_text"
    assert got.sliding_windows == tuple(WINDOW if t == "sliding_attention" else None for t in LOCAL)
    assert got.hf_config.rope_parameters == cfg.rope_parameters
    prompts = random_prompts([5, 3 * WINDOW], seed=41)
    refs = gguf_reference(model, prompts, 6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
