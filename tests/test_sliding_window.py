"""Sliding-window attention for real: contexts several windows long equal transformers, chunked or not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy, random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams

WINDOW = 8
NEW = 12


def _windowed(tiny_models, tmp_path, arch: str, **extra):
    folder = tmp_path / f"{arch}-window"
    shutil.copytree(tiny_models[arch], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(sliding_window=WINDOW, **extra)
    cfg.pop("layer_types", None)  # let the config class derive them from the window settings
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("arch, extra", [
    ("mistral", {}),  # every layer slides
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),  # layer 0 global, 1-2 sliding
])
def test_contexts_of_several_windows_match_transformers(arch, extra, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _windowed(tiny_models, tmp_path, arch, **extra)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    windows = LLM(folder, dtype="float32").engine.model_config.sliding_windows
    assert windows == tuple(model.config.sliding_window if t == "sliding_attention" else None
                            for t in getattr(model.config, "layer_types", ["sliding_attention"] * 3))
    prompts = random_prompts([3 * WINDOW + 5, 4 * WINDOW, 5], seed=8)
    refs = [hf_greedy(model, p, NEW) for p in prompts]
    spec = HiddenStatesSpec(layers="all", points=["resid_pre", "final"], positions="all")
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0, hidden_states=spec)
    for engine_kwargs in ({}, {"max_num_batched_tokens": 7, "block_size": 4}):  # whole prompts, then chunked
        llm = LLM(folder, dtype="float32", **engine_kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_matches_reference(outs, refs)
        for prompt, out in zip(prompts, outs):
            seq = prompt + out.outputs[0].token_ids
            with torch.no_grad():
                hf = model(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
            hs = out.hidden_states
            scale = max(1.0, float(hf[-1].abs().max()))
            for layer in range(model.config.num_hidden_layers):
                assert float((hs["resid_pre"][:, layer] - hf[layer][0]).abs().max()) <= 1e-4 * scale
            assert float((hs["final"][:, 0] - hf[-1][0]).abs().max()) <= 1e-4 * scale


def test_the_window_no_longer_caps_the_context(tiny_models, tmp_path):
    folder = _windowed(tiny_models, tmp_path, "mistral")
    llm = LLM(folder, dtype="float32")
    assert llm.engine.model_config.max_model_len == 512
    out = llm.generate([list(range(100, 170))], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10
