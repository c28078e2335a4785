"""OLMo-2 through the shared family harness: post-sublayer norms and whole-projection q/k norms.

No GGUF test: transformers' GGUF reader does not know the olmo2 architecture.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, random_prompts, save_tiny_model
from family_harness import HFLayout, check_points, check_situations, check_steering
from tapllm import LLM

# attn_out/mlp_out are what the post-sublayer norms return: what joins the residual stream.
LAYOUT = HFLayout(
    blocks=lambda m: m.model.layers,
    attn_out=lambda b: b.post_attention_layernorm,
    mlp_out=lambda b: b.post_feedforward_layernorm,
    final_norm=lambda m: m.model.norm,
)


def _random_norms(model) -> None:
    """Norm weights away from 1, so every norm (q/k over the whole projection too) really scales."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory, default_model_folder):
    from transformers import AutoModelForCausalLM, Olmo2Config

    cfg = Olmo2Config(vocab_size=49152, tie_word_embeddings=False, **TINY)
    folder = save_tiny_model(tmp_path_factory.mktemp("olmo2"), cfg, default_model_folder, shard="2MB",
                             init=_random_norms)
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_olmo2_situations(olmo2):
    folder, model = olmo2
    check_situations(folder, model, random_prompts([3, 14, 27], seed=31), 8)


def test_olmo2_every_point(olmo2):
    folder, model = olmo2
    check_points(LLM(folder, dtype="float32"), model, LAYOUT, random_prompts([1, 9, 22], seed=32), 5)


def test_olmo2_steering(olmo2):
    folder, model = olmo2
    check_steering(folder, model, LAYOUT)
