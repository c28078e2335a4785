"""GPT-NeoX / Pythia through the shared family harness: parallel and sequential residual, partial rotary.

No GGUF test: transformers' GGUF reader does not support the gpt_neox architecture.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM, SamplingParams

LAYOUT = HFLayout(
    blocks=lambda m: m.gpt_neox.layers,
    attn_out=lambda b: b.attention,
    mlp_out=lambda b: b.mlp,
    final_norm=lambda m: m.gpt_neox.final_layer_norm,
)

TINY = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=512, initializer_range=0.2, bos_token_id=0, eos_token_id=0)


def _configs() -> dict:
    from transformers import GPTNeoXConfig

    return {
        # Pythia: parallel residual, a quarter of each head's dims rotated, untied head.
        "pythia": GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.25, **TINY),
        # Sequential residual, half the dims rotated with another base; sharded.
        "neox-sequential": GPTNeoXConfig(use_parallel_residual=False, rotary_pct=0.5, rotary_emb_base=1000,
                                         **TINY),
    }


def _randomise(model) -> None:
    """Non-trivial LayerNorm weights and every bias, so those paths are exercised."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "layernorm" in name or "layer_norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def neox_models(tmp_path_factory, default_model_folder) -> dict:
    root = tmp_path_factory.mktemp("neox")
    return {name: save_tiny_model(root / name, cfg, default_model_folder, init=_randomise,
                                  shard="2MB" if name == "neox-sequential" else "10GB")
            for name, cfg in _configs().items()}


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["pythia", "neox-sequential"])
def test_situations_points_and_steering(name, neox_models):
    folder = neox_models[name]
    model = _hf(folder)
    assert model.config.use_parallel_residual == (name == "pythia")
    check_situations(folder, model, random_prompts([3, 14, 27], seed=31), 8)
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 22], seed=32), 5)
    check_steering(folder, model, LAYOUT)


def test_checkpoint_layout(neox_models):
    """The files keep the hub's layout: untied ``embed_out``, q/k/v interleaved per head; sharded where asked."""
    from safetensors import safe_open

    folder = neox_models["pythia"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys()
    assert (neox_models["neox-sequential"] / "model.safetensors.index.json").is_file()


def test_old_checkpoint_buffers_are_skipped(neox_models, tmp_path):
    """Older Pythia files carry causal-mask and rotary buffers; they load and are ignored."""
    from safetensors.torch import load_file, save_file

    src = neox_models["pythia"]
    sd = load_file(src / "model.safetensors")
    for i in range(3):
        sd[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(1, 1, 512, 512, dtype=torch.bool)).float()
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        sd[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    folder = tmp_path / "old-buffers"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    prompts = random_prompts([7], seed=52)
    refs = [hf_greedy(_hf(src), p, 5) for p in prompts]
    outs = LLM(folder, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert_matches_reference(outs, refs)
