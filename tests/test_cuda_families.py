"""Every family on a CUDA GPU: tokens and every point's states against transformers on the same device.

Marked ``cuda``: skipped where no GPU is available. The harness is the CPU one
(``family_harness``), run with the transformers model and its inputs on the GPU; tapllm runs
there too (its default device), with CUDA graphs and Triton attention where they are
available, and again with ``enforce_eager=True``: both must give transformers' greedy tokens
and states, alone, batched, chunked, after prefix-cache hits and through preemption.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts, save_tiny_model
from family_configs import family_configs
from family_harness import check_points, check_situations, check_steering

pytestmark = pytest.mark.cuda

LAYOUT_OF = {"llama": "test_family_llama", "llama3-rope": "test_family_llama", "mistral": "test_family_llama",
             "qwen2": "test_family_llama", "qwen3": "test_family_llama", "gemma2": "test_family_gemma2",
             "gemma3": "test_family_gemma2", "phi3": "test_family_phi3", "phi3-longrope": "test_family_phi3",
             "olmo2": "test_family_olmo2", "gpt2": "test_family_gpt2", "pythia": "test_family_gpt_neox"}


def _layout(name: str):
    import importlib

    return importlib.import_module(LAYOUT_OF[name]).LAYOUT


@pytest.mark.parametrize("name", sorted(family_configs()))
def test_family_on_cuda_matches_transformers(tmp_path, default_model_folder, name):
    from transformers import AutoModelForCausalLM

    from tapllm import LLM

    folder = save_tiny_model(tmp_path / name, family_configs()[name], default_model_folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    prompts = random_prompts([1, 9, 37], seed=32)
    with torch.device("cuda"):  # the references' inputs on the GPU, where the model is
        check_situations(folder, model, prompts, 6)
        for eager in (False, True):
            llm = LLM(folder, dtype="float32", device="cuda", enforce_eager=eager)
            assert llm.engine.runner.backend.device.type == "cuda"
            check_points(llm, model, _layout(name), prompts, 5)
        check_steering(folder, model, _layout(name))


def test_graph_and_eager_steps_agree_in_bf16(tiny_models):
    """bf16 on the GPU: greedy tokens of the graph path equal the eager reference's."""
    from tapllm import LLM, SamplingParams

    prompts = random_prompts([3, 17, 40, 64], seed=9)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [LLM(tiny_models["llama"], dtype="bfloat16", device="cuda", enforce_eager=eager)
           .generate(prompts, params, use_tqdm=False) for eager in (False, True)]
    assert [o.outputs[0].token_ids for o in got[0]] == [o.outputs[0].token_ids for o in got[1]]


def test_states_stay_on_the_gpu_when_asked(tiny_models):
    from tapllm import LLM, HiddenStatesSpec, SamplingParams

    llm = LLM(tiny_models["llama"], dtype="float32", device="cuda")
    prompt = random_prompts([12], seed=4)
    outs = [llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                hidden_states=HiddenStatesSpec(layers=[0, -1], device=where)),
                         use_tqdm=False)[0].hidden_states["resid_post"] for where in ("cuda", None)]
    assert outs[0].device.type == "cuda" and outs[1].device.type == "cpu"
    torch.testing.assert_close(outs[0].cpu(), outs[1])
