"""Gemma-2 through the shared family harness: (1 + weight) norms, pre/post norms, soft-capping, local/global layers.

The tiny checkpoint has random norm weights (so ``1 + weight`` matters), a query scalar that
is not the head size, soft-caps small enough to bite, and a window of 8 tokens on every
other layer, with prompts of 3-4 windows so local and global layers really differ.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM, SamplingParams

WINDOW = 8
LAYOUT = HFLayout(
    blocks=lambda m: m.model.layers,
    attn_out=lambda b: b.post_attention_layernorm,  # what attention adds: after the post-attention norm
    mlp_out=lambda b: b.post_feedforward_layernorm,
    final_norm=lambda m: m.model.norm,
)


def tiny_config():
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
        query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=10.0, final_logit_softcapping=4.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def randomise_norms(model) -> None:
    """Norm weights away from 0, so the (1 + weight) scale is really exercised."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=0.3)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, default_model_folder):
    """A sharded tiny Gemma-2 checkpoint and transformers' eager model on it (soft-capping needs eager)."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("gemma2") / "gemma2", tiny_config(), default_model_folder,
                             shard="2MB", init=randomise_norms)
    assert len(list(folder.glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, model


def test_config_windows_and_caps(gemma2):
    folder, model = gemma2
    llm = LLM(folder, dtype="float32")
    cfg = llm.engine.model_config
    assert cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    m = llm.engine.runner.model
    assert m.final_logit_softcap == 4.0
    assert [layer.self_attn.opts.window for layer in m.layers] == [WINDOW, None, WINDOW, None]
    assert all(layer.self_attn.opts.softcap == 10.0 and abs(layer.self_attn.opts.scale - 24**-0.5) < 1e-12
               for layer in m.layers)
    # The window bites: transformers without it answers differently on a prompt of 4 windows.
    prompt = torch.tensor(random_prompts([4 * WINDOW], seed=3))
    with torch.no_grad():
        windowed = model(prompt).logits
        model.config.sliding_window = 10_000
        try:
            unwindowed = model(prompt).logits
        finally:
            model.config.sliding_window = WINDOW
    assert not torch.allclose(windowed[0, -1], unwindowed[0, -1], atol=1e-3)


def test_situations_points_and_steering(gemma2):
    folder, model = gemma2
    long = random_prompts([3, 3 * WINDOW + 3, 4 * WINDOW], seed=31)
    check_situations(folder, model, long, 8)
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 3 * WINDOW + 1], seed=32), 5)
    check_steering(folder, model, LAYOUT)


# Hugging Face module names -> llama.cpp's tensor names (gguf's MODEL_TENSORS for gemma2/gemma3).
GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_tensors(folder) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as llama.cpp's converter writes them: its names, every norm weight + 1."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, w in load_file(f).items():
            if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                cpp = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                       "lm_head.weight": "output"}[name]
            else:
                _, _, i, module = name.removesuffix(".weight").split(".", 3)
                cpp = f"blk.{i}.{GGUF_BLOCK[module]}"
            out[f"{cpp}.weight"] = w + 1 if cpp.endswith("norm") else w
    return out


def gguf_metadata(cfg) -> dict:
    """The ``{arch}.*`` keys llama.cpp's converter writes for Gemma-2 and Gemma-3."""
    kv = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
          "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
          "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
          "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "attention.sliding_window": cfg.sliding_window}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None) is not None:
            kv[key] = float(getattr(cfg, key))
    return kv


def gguf_reference(model, prompts: list[list[int]], new: int) -> list:
    """Greedy references with llama.cpp's query scale, head_dim ** -0.5 (the files keep no query_pre_attn_scalar)."""
    layers = model.model.layers
    saved = [layer.self_attn.scaling for layer in layers]
    for layer in layers:
        layer.self_attn.scaling = model.config.head_dim**-0.5
    try:
        return [hf_greedy(model, p, new) for p in prompts]
    finally:
        for layer, scale in zip(layers, saved):
            layer.self_attn.scaling = scale


def test_gguf_written_in_llama_cpp_layout_loads_and_matches(gemma2, tmp_path):
    """A GGUF in llama.cpp's gemma2 layout (norm weights + 1, soft-caps and window in metadata) equals the folder."""
    from gguf_writer import write_gguf

    folder, model = gemma2
    tensors = gguf_tensors(folder)
    assert "output.weight" not in tensors  # tied
    path = write_gguf(tmp_path / "tiny-gemma2.gguf", "gemma2", gguf_metadata(model.config), tensors)
    llm = LLM(path, dtype="float32")
    got = llm.engine.model_config
    assert got.architecture == "Gemma2ForCausalLM" and got.sliding_windows == (WINDOW, None, WINDOW, None)
    assert got.hf_config.final_logit_softcapping == 4.0 and got.hf_config.attn_logit_softcapping == 10.0
    prompts = random_prompts([5, 3 * WINDOW], seed=41)
    refs = gguf_reference(model, prompts, 6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
