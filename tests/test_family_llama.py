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
