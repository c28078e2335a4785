"""The fused-kernel step against the eager step it replaces, in every family.

Both paths run the same mixed workload (requests capturing every point at every position,
requests steered at points the fused residual add reads, plain requests, a tiny token budget
that chunks prefills and mixes them with decodes, a KV cache small enough to preempt): in
float32 they must give the same greedy tokens, logprobs within 1e-4 and every captured state
within 1e-4 of its scale. The eager step is itself checked against transformers by the family
tests (run with ``TAPLLM_KERNELS=0`` below); the fused one is what every other test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_prompts, save_tiny_model
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.hidden_states import HIDDEN_POINTS
from tapllm.kernels import fused_kernels

pytestmark = pytest.mark.skipif(fused_kernels() is None, reason="no C++ compiler: only the eager step exists here")


def _family_configs() -> dict:
    from test_family_gemma2 import tiny_config as gemma2
    from test_family_gemma3 import tiny_config as gemma3
    from test_family_gpt2 import _configs as gpt2
    from test_family_gpt_neox import _configs as neox
    from test_family_phi3 import _configs as phi3
    from transformers import Olmo2Config

    from conftest import TINY

    configs = {"gemma2": gemma2(), "gemma3": gemma3(), "olmo2": Olmo2Config(vocab_size=49152, **TINY)}
    configs.update({f"gpt2-{k}": v for k, v in gpt2().items()})
    configs.update({f"neox-{k}": v for k, v in neox().items()})
    configs.update({f"phi3-{k}": v for k, v in phi3().items()})
    return configs


FAMILIES = ["llama", "llama3-rope-tied", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "gpt2-", "neox-", "phi3-"]


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory, tiny_models, default_model_folder) -> dict[str, Path]:
    folders = {k: tiny_models[k] for k in ("llama", "llama3-rope-tied", "qwen2", "qwen3")}
    root = tmp_path_factory.mktemp("families")
    for name, cfg in _family_configs().items():
        folders[name] = save_tiny_model(root / name, cfg, default_model_folder)
    return folders


def _workload(hidden: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts([3, 30, 9, 41, 17, 5], seed=11)
    g = torch.Generator().manual_seed(5)
    every = HiddenStatesSpec(layers="all", points=list(HIDDEN_POINTS), positions="all")
    steer = [Steer(point="resid_mid", layers=[1], vector=torch.randn(hidden, generator=g), scale=2.0),
             Steer(point="attn_out", layers=[0], vector=torch.randn(hidden, generator=g))]
    base = dict(temperature=0, ignore_eos=True, logprobs=2)
    # Lengths differ so that late steps hold only requests that tap a few blocks (or none): the
    # untapped blocks of those decode steps run as one fused call, the tapped ones in Python.
    params = [SamplingParams(**base, max_tokens=3, hidden_states=every), SamplingParams(**base, max_tokens=9),
              SamplingParams(**base, max_tokens=6, steering=steer, hidden_states=HiddenStatesSpec(
                  layers=[1], points=["resid_post", "mlp_post", "k"], positions="all")),
              SamplingParams(**base, max_tokens=9),
              SamplingParams(**base, max_tokens=7, hidden_states=HiddenStatesSpec(
                  layers=[-1], points=["resid_mid"], positions="last", reduce="mean")),
              SamplingParams(**base, max_tokens=8, steering=[Steer(point="resid_mid", layers=[0], op="ablate",
                                                                   vector=torch.randn(hidden, generator=g))])]
    return prompts, params


def _run(folder: Path, eager: bool, **options) -> list:
    llm = LLM(folder, dtype="float32", enforce_eager=eager, **options)
    assert (llm.engine.runner.backend.name == "eager") == eager
    stackable = folder.name in ("llama", "llama3-rope-tied", "qwen2") or folder.name.startswith("phi3")
    assert (llm.engine.runner.model.stack is not None) == (stackable and not eager), folder.name
    prompts, params = _workload(llm.engine.model_config.hidden_size)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_equals_eager_step(family, family_folders):
    names = [n for n in family_folders if n == family or (family.endswith("-") and n.startswith(family))]
    assert names
    for name in names:
        for options in ({}, dict(max_num_batched_tokens=12, block_size=4, kv_cache_blocks=24,
                                 enable_prefix_caching=False)):
            eager = _run(family_folders[name], True, **options)
            fused = _run(family_folders[name], False, **options)
            for e, f in zip(eager, fused):
                assert e.outputs[0].token_ids == f.outputs[0].token_ids, name
                for le, lf in zip(e.outputs[0].logprobs, f.outputs[0].logprobs):
                    for tok, lp in le.items():
                        assert abs(lp.logprob - lf[tok].logprob) < 1e-4, name
                if e.hidden_states is None:
                    assert f.hidden_states is None
                    continue
                for point in e.hidden_states.points:
                    a, b = e.hidden_states[point], f.hidden_states[point]
                    scale = max(a.abs().max().item(), 1e-6)
                    torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * scale, msg=f"{name} {point}")


def test_bfloat16_fused_step_tracks_eager_step(tiny_models):
    """In bfloat16 the two paths round alike; only summation order differs."""
    prompts = random_prompts([20, 33], seed=3)
    spec = HiddenStatesSpec(layers="all", points=["resid_post"], positions="prompt")
    params = SamplingParams(max_tokens=1, temperature=0, hidden_states=spec)
    states = [LLM(tiny_models["llama"], dtype="bfloat16", enforce_eager=eager).generate(prompts, params,
                                                                                      use_tqdm=False)
              for eager in (True, False)]
    for e, f in zip(*states):
        a, b = e.hidden_states["resid_post"].float(), f.hidden_states["resid_post"].float()
        assert ((a - b).norm() / a.norm()).item() < 2e-2


def test_eager_step_still_matches_transformers():
    """The reference path against transformers: the parity and Llama-family tests with the kernels off."""
    env = {**os.environ, "TAPLLM_KERNELS": "0"}
    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(tests / "test_parity.py"), str(tests / "test_family_gemma2.py")],
                          capture_output=True, text=True, env=env, timeout=1500, cwd=tests.parent)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout.splitlines()[-1]
