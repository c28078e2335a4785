"""Activation patching and the other interventions (set, scale, clamp), at every kind of point.

The classic patching sweep (clean -> corrupted, one (layer, position) at a time, all in one
batched call) gives the same logit differences as transformers with forward hooks doing the
same patch; per-head (z) and per-neuron (mlp_post) patches and set/scale/clamp on the
residual stream match hooks too; a patched prompt never shares KV blocks with an unpatched
one past the first block it changes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

A, B = 1234, 5678  # the two answer tokens whose logit difference the sweep measures
LOGITS = HiddenStatesSpec(points="final", positions="last_prompt", lens=1, lens_targets=[A, B])


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    return LLM(tiny_models["llama"], dtype="float32", block_size=4), model


def _logit_diff(out) -> float:
    lp = out.hidden_states.lens.target_logprobs[0, 0]
    return float(lp[0] - lp[1])


def _hf_logit_diff(model, ids: list[int], hooks: list) -> float:
    handles = [module.register_forward_pre_hook(fn, with_kwargs=True) if pre else module.register_forward_hook(fn)
               for module, fn, pre in hooks]
    try:
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    finally:
        for h in handles:
            h.remove()
    return float(lp[A] - lp[B])


def _replace_input(pos: int, value: torch.Tensor):
    def hook(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[0, pos] = value
        return ((x,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
    return hook


def test_patching_sweep_matches_transformers_hooks(setup):
    llm, model = setup
    clean, corrupted = random_prompts([10, 10], seed=31)
    corrupted[3:6] = clean[3:6]  # share a few tokens, as a real patching pair does
    layers = llm.engine.model_config.num_layers
    clean_hs = llm.encode([clean], dict(layers="all", points="resid_pre", positions="all"))[0].hidden_states
    patches = [(layer, pos) for layer in range(layers) for pos in range(len(clean))]
    params = [SamplingParams(max_tokens=1, temperature=0, hidden_states=LOGITS, steering=[
        Steer(op="set", point="resid_pre", layers=[layer], positions=[pos], values=clean_hs)]) for layer, pos in patches]
    outs = llm.generate([corrupted] * len(patches), params, use_tqdm=False)  # the whole sweep in one call
    for (layer, pos), out in zip(patches, outs):
        value = clean_hs["resid_pre"][pos, layer]
        want = _hf_logit_diff(model, corrupted, [(model.model.layers[layer], _replace_input(pos, value), True)])
        assert abs(_logit_diff(out) - want) < 1e-4, (layer, pos)
    base = llm.generate([corrupted], SamplingParams(max_tokens=1, temperature=0, hidden_states=LOGITS),
                        use_tqdm=False)[0]
    assert abs(_logit_diff(base) - _hf_logit_diff(model, corrupted, [])) < 1e-4
    assert any(abs(_logit_diff(o) - _logit_diff(base)) > 1e-3 for o in outs)  # the patches do something


def test_per_head_and_per_neuron_patches_match_hooks(setup):
    llm, model = setup
    clean, corrupted = random_prompts([9, 9], seed=32)
    layer, head, heads, dim = 1, 2, 4, 16
    spec = dict(layers=[layer], points=["z", "mlp_post"], positions="all")
    clean_hs = llm.encode([clean], spec)[0].hidden_states
    z_patch = Steer(op="set", point="z", layers=[layer], positions=[4, 7], heads=[head],
                    values=clean_hs["z"][[4, 7], 0, head][:, None])
    neurons = [3, 50, 99]
    n_patch = Steer(op="set", point="mlp_post", layers=[layer], positions=[6], neurons=neurons,
                    values=clean_hs["mlp_post"][[6], 0][:, neurons])

    def z_hook(m, args, kwargs):  # o_proj's input is z, heads side by side
        x = args[0].clone().view(1, -1, heads, dim)
        for p in (4, 7):
            x[0, p, head] = clean_hs["z"][p, 0, head]
        return (x.view(1, -1, heads * dim),), kwargs

    def n_hook(m, args, kwargs):  # down_proj's input is mlp_post
        x = args[0].clone()
        x[0, 6, neurons] = clean_hs["mlp_post"][6, 0, neurons]
        return (x,), kwargs

    blocks = model.model.layers
    for steer, hook in ((z_patch, (blocks[layer].self_attn.o_proj, z_hook, True)),
                        (n_patch, (blocks[layer].mlp.down_proj, n_hook, True))):
        out = llm.generate([corrupted], SamplingParams(max_tokens=1, temperature=0, hidden_states=LOGITS,
                                                       steering=[steer]), use_tqdm=False)[0]
        assert abs(_logit_diff(out) - _hf_logit_diff(model, corrupted, [hook])) < 1e-4, steer.point
    # the captured state shows the patch (capture comes after the intervention)
    got = llm.generate([corrupted], SamplingParams(max_tokens=1, temperature=0, hidden_states=spec,
                                                   steering=[z_patch, n_patch]), use_tqdm=False)[0].hidden_states
    assert torch.allclose(got["z"][[4, 7], 0, head], clean_hs["z"][[4, 7], 0, head])
    assert torch.allclose(got["mlp_post"][6, 0, neurons], clean_hs["mlp_post"][6, 0, neurons])


@pytest.mark.parametrize("op", ["scale", "clamp", "set"])
def test_residual_ops_on_resid_mid_match_hooks(setup, op):
    llm, model = setup
    prompt = random_prompts([8], seed=33)[0]
    layer = 1
    d = torch.randn(64, generator=torch.Generator().manual_seed(3))
    unit = d / d.norm()
    values = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    steer = {"scale": Steer(op="scale", point="resid_mid", layers=[layer], scale=0.5, positions=[2, 5]),
             "clamp": Steer(op="clamp", point="resid_mid", layers=[layer], vector=d, value=3.0, positions=[2, 5]),
             "set": Steer(op="set", point="resid_mid", layers=[layer], values=values, positions=[2, 5])}[op]

    def change(x: torch.Tensor, k: int) -> torch.Tensor:
        if op == "scale":
            return x * 0.5
        if op == "clamp":
            return x + (3.0 - x @ unit) * unit
        return values[k]

    def hook(m, args, kwargs):  # resid_mid is the post-attention norm's input, also the MLP's residual
        x = args[0]
        for k, p in enumerate((2, 5)):
            x[0, p] = change(x[0, p].clone(), k)
        return None

    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, hidden_states=LOGITS, steering=[steer]),
                       use_tqdm=False)[0]
    want = _hf_logit_diff(model, prompt, [(model.model.layers[layer].post_attention_layernorm, hook, True)])
    assert abs(_logit_diff(out) - want) < 1e-4


def test_patched_prompts_share_blocks_only_before_the_first_patch(setup):
    llm, _ = setup
    prompt = random_prompts([21], seed=34)[0]
    plain = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([prompt], plain, use_tqdm=False)
    values = torch.zeros(1, 64)
    patched = SamplingParams(max_tokens=2, temperature=0, steering=[
        Steer(op="set", point="resid_post", layers=[0], positions=[10], values=values)])
    out = llm.generate([prompt], patched, use_tqdm=False)[0]
    assert out.metrics["num_cached_tokens"] == 8  # blocks 0-1 (positions 0-7) are untouched; block 2 holds 10
    again = llm.generate([prompt], patched, use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 20  # the same patch shares everything
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="set", point="resid_post", layers=[0], values=torch.zeros(2, 64)), "positions must list"),
    (dict(op="set", point="resid_post", layers=[0], positions=[1, 2], values=torch.zeros(3, 64)),
     r"values must be \[len\(positions\)=2"),
    (dict(op="scale", point="resid_post", layers=[0], vector=torch.ones(64)), "not used by op='scale'"),
    (dict(op="add", point="resid_post", layers=[0], vector=torch.ones(64), heads=[0]), "heads applies to"),
    (dict(op="add", point="z", layers=[0], vector=torch.ones(16), neurons=[0]), "neurons applies to"),
    (dict(op="clamp", point="resid_post", layers=[0], vector=torch.zeros(64)), "zero: there is no direction"),
    (dict(op="add", point="resid_post", layers=[0], vector=torch.ones(64), positions=[-1]), "positions >= 0"),
])
def test_bad_interventions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Steer(**kwargs)


def test_interventions_checked_against_the_model(setup):
    llm, _ = setup
    bad = [
        (Steer(op="set", point="z", layers=[0], positions=[1], values=torch.zeros(1, 3, 16)), r"values has shape"),
        (Steer(op="add", point="z", layers=[0], heads=[9], vector=torch.ones(16)), "heads: 9 is out of range"),
        (Steer(op="add", point="mlp_post", layers=[0], vector=torch.ones(7)), "vector has shape"),
    ]
    for steer, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, steering=[steer]), use_tqdm=False)
