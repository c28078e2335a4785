"""GPT-2 through the shared family harness, plus a GGUF written in llama.cpp's layout."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM, SamplingParams

LAYOUT = HFLayout(
    blocks=lambda m: m.transformer.h,
    attn_out=lambda b: b.attn,
    mlp_out=lambda b: b.mlp,
    final_norm=lambda m: m.transformer.ln_f,
)

TINY = dict(vocab_size=49152, n_embd=64, n_layer=3, n_head=4, initializer_range=0.2, bos_token_id=0,
            eos_token_id=0)


def _configs() -> dict:
    from transformers import GPT2Config

    return {
        # GPT-2 as published: tied head, gelu_new, attention scaled by 1/sqrt(head_dim).
        "gpt2": GPT2Config(n_positions=512, **TINY),
        # The other options: untied head, scores also divided by layer index + 1, the
        # reordered/upcast attention (read with eager attention, where transformers uses it),
        # an explicit inner size and exact GELU; sharded.
        "gpt2-options": GPT2Config(n_positions=256, n_inner=96, activation_function="gelu",
                                   scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True,
                                   tie_word_embeddings=False, **TINY),
    }


def _randomise(model) -> None:
    """Non-trivial LayerNorm weights and every bias, so those paths are exercised."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif ".ln_" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def gpt2_models(tmp_path_factory, default_model_folder) -> dict:
    root = tmp_path_factory.mktemp("gpt2")
    return {name: save_tiny_model(root / name, cfg, default_model_folder, init=_randomise,
                                  shard="2MB" if name == "gpt2-options" else "10GB")
            for name, cfg in _configs().items()}


def _hf(folder, eager: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": "eager"} if eager else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("name", ["gpt2", "gpt2-options"])
def test_situations_points_and_steering(name, gpt2_models):
    folder = gpt2_models[name]
    model = _hf(folder, eager=name == "gpt2-options")
    check_situations(folder, model, random_prompts([3, 14, 27], seed=31), 8)
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 22], seed=32), 5)
    check_steering(folder, model, LAYOUT)


def test_sharded_checkpoint_is_sharded(gpt2_models):
    assert (gpt2_models["gpt2-options"] / "model.safetensors.index.json").is_file()


def test_original_hub_names_load(gpt2_models, tmp_path):
    """The hub's GPT-2 files name tensors without ``transformer.`` and carry causal-mask buffers."""
    from safetensors.torch import load_file, save_file

    src = gpt2_models["gpt2"]
    sd = load_file(src / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for i in range(3):
        renamed[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        renamed[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    folder = tmp_path / "hub-names"
    folder.mkdir()
    save_file(renamed, str(folder / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    prompts = random_prompts([6, 13], seed=51)
    refs = [hf_greedy(_hf(src), p, 5) for p in prompts]
    outs = LLM(folder, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert_matches_reference(outs, refs)


def test_gguf_written_in_llama_cpp_layout_loads_and_matches(default_model_folder, tmp_path):
    """A GPT-2 GGUF as llama.cpp's converter writes it (projections transposed to [out, in]) equals transformers."""
    from safetensors.torch import load_file
    from transformers import GPT2Config

    from gguf_writer import write_gguf

    # Not GPT-2's default 1024 positions and 4 x hidden MLP width, which transformers' reader
    # would keep: the conversion reads both from the tensors.
    folder = save_tiny_model(tmp_path / "gpt2-gguf-src", GPT2Config(n_positions=320, n_inner=96, **TINY),
                             default_model_folder, init=_randomise)
    model = _hf(folder)
    cfg = model.config
    sd = load_file(folder / "model.safetensors")
    tensors = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
               "output_norm.weight": sd["transformer.ln_f.weight"], "output_norm.bias": sd["transformer.ln_f.bias"]}
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(cfg.n_layer):
        for hf_name, cpp in names.items():
            w = sd[f"transformer.h.{i}.{hf_name}.weight"]
            tensors[f"blk.{i}.{cpp}.weight"] = w if hf_name.startswith("ln_") else w.t()  # Conv1D -> [out, in]
            tensors[f"blk.{i}.{cpp}.bias"] = sd[f"transformer.h.{i}.{hf_name}.bias"]
    kv = {"block_count": cfg.n_layer, "context_length": cfg.n_positions, "embedding_length": cfg.n_embd,
          "feed_forward_length": cfg.n_inner, "attention.head_count": cfg.n_head,
          "attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon)}
    path = write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", kv, tensors)
    prompts = random_prompts([5, 19], seed=41)
    refs = [hf_greedy(model, p, 6) for p in prompts]
    llm = LLM(path, dtype="float32")
    assert llm.engine.model_config.architecture == "GPT2LMHeadModel"
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
