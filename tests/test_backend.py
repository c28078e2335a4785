"""One place chooses the forward path, and a step says which path each run of blocks took."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.backends import select_backend
from tapllm.kernels import fused_kernels

fused = pytest.mark.skipif(fused_kernels() is None, reason="no fused CPU kernels here (no compiler)")


def _runs_of_each_step(llm: LLM, prompts, params) -> list[tuple[int, tuple]]:
    """(rows of the step, the runs it took) for every step of a generate call."""
    model = llm.engine.runner.model
    seen: list[tuple[int, tuple]] = []
    forward = model.forward

    def watched(input_ids, *args, **kwargs):
        out = forward(input_ids, *args, **kwargs)
        seen.append((input_ids.shape[0], model.last_runs))
        return out

    model.forward = watched
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del model.forward
    return seen


@fused
def test_cpu_backend_decode_steps_run_untapped_blocks_in_one_call(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    backend = llm.engine.runner.backend
    assert backend.name == "cpu" and backend.attention is not None and backend.stack is not None
    n = llm.engine.model_config.num_layers
    steps = _runs_of_each_step(llm, random_prompts([7, 11], seed=1),
                               SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    prefill, decodes = steps[0], steps[1:]
    assert prefill[1] == ((0, n, "fused"),)  # prefill chunks: Python blocks on the fused ops
    assert decodes and all(runs == ((0, n, "stack"),) for _, runs in decodes)


@fused
def test_a_tapped_block_runs_in_python_between_runs_of_the_stack(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    n = llm.engine.model_config.num_layers
    spec = HiddenStatesSpec(layers=[1], points="resid_post", positions="all")
    steps = _runs_of_each_step(llm, random_prompts([6], seed=2),
                               SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, hidden_states=spec))
    assert all(runs == ((0, 1, "stack"), (1, 2, "fused"), (2, n, "stack")) for _, runs in steps[1:])
    steer = [Steer(layers=[0], point="resid_pre", vector=torch.ones(llm.engine.model_config.hidden_size))]
    steps = _runs_of_each_step(llm, random_prompts([6], seed=3),
                               SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, steering=steer))
    assert all(runs == ((0, 1, "fused"), (1, n, "stack")) for _, runs in steps[1:])


def test_enforce_eager_runs_every_block_on_pytorch(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", enforce_eager=True)
    runner = llm.engine.runner
    assert runner.backend.name == "eager" and not runner.backend.fused
    assert runner.model.stack is None
    n = llm.engine.model_config.num_layers
    steps = _runs_of_each_step(llm, random_prompts([5], seed=4),
                               SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert all(runs == ((0, n, "eager"),) for _, runs in steps)
    assert "forward backend: eager" in llm.describe() and "enforce_eager=True" in llm.describe()


def test_the_choice_is_made_once_and_says_why(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend(cpu, torch.float32, enforce_eager=True).name == "eager"
    monkeypatch.setenv("TAPLLM_KERNELS", "0")
    off = select_backend(cpu, torch.float32)
    assert off.name == "eager" and any("TAPLLM_KERNELS=0" in note for note in off.notes)
    assert "CUDA graphs: off" in off.describe()


@fused
def test_describe_names_the_paths(tiny_models):
    text = LLM(tiny_models["llama"], dtype="float32").describe()
    assert "forward backend: cpu" in text
    assert "attention: paged kernels" in text
    assert "KV cache:" in text and "linear layers:" in text
