"""Steering equals transformers with hooks doing the same; mixed batches, prefix cache, files, bad input."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from helpers import SteeringHooks, assert_close
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

ARCHS = ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3"]
NEW = 8


def _vec(seed: int, hidden: int = 64, norm: float = 6.0) -> torch.Tensor:
    v = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return v * (norm / v.norm())


def _steers(hidden: int = 64) -> list[Steer]:
    return [
        Steer(layers=[0, 2], point="resid_post", op="add", vector=_vec(1, hidden), scale=2.0),
        Steer(layers=[1], point="attn_out", op="ablate", vector=_vec(2, hidden)),
        Steer(point="mlp_out", op="add", vector={1: _vec(3, hidden)}, positions="generated"),
        Steer(layers=[-1], point="resid_pre", op="add", vector=_vec(4, hidden), scale=-1.5, positions="prompt"),
        Steer(layers=[2], point="resid_post", op="ablate", vector=_vec(5, hidden)),
    ]


class HFSteering(SteeringHooks):
    """Forward hooks on a transformers model applying the same steers at the same places."""

    def __init__(self, model, steers: list[Steer], num_prompt: int) -> None:
        super().__init__(num_prompt)
        n = model.config.num_hidden_layers
        for s in steers:
            for layer in s.layers:
                block = model.model.layers[layer % n]
                fn = self._op(s, s.vector_for(layer))
                if s.point == "resid_pre":
                    self.handles.append(block.register_forward_pre_hook(
                        lambda m, args, fn=fn: (fn(args[0]),) + tuple(args[1:])))
                elif s.point == "resid_post":
                    self.handles.append(block.register_forward_hook(lambda m, i, o, fn=fn: fn(o)))
                elif s.point == "resid_mid":
                    # The post-attention norm's input is the residual stream after attention, and the
                    # same tensor is the residual the MLP's output is added to: steer it in place.
                    self.handles.append(block.post_attention_layernorm.register_forward_pre_hook(
                        lambda m, args, fn=fn: (args[0].copy_(fn(args[0])), None)[1]))
                elif s.point == "attn_out":
                    self.handles.append(block.self_attn.register_forward_hook(
                        lambda m, i, o, fn=fn: (fn(o[0]),) + tuple(o[1:])))
                else:
                    self.handles.append(block.mlp.register_forward_hook(lambda m, i, o, fn=fn: fn(o)))


def hf_steered(model, prompt: list[int], steers: list[Steer], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens with steering hooks, then each block's input (resid_pre) and the final norm over the sequence.

    The states are taken by hooks registered after the steering hooks, so they see the
    steered values whatever order transformers' own recording would use.
    """
    hooks = HFSteering(model, steers, len(prompt))
    seen: list[torch.Tensor] = []
    for block in model.model.layers:
        hooks.handles.append(block.register_forward_pre_hook(lambda m, args: seen.append(args[0][0])))
    hooks.handles.append(model.model.norm.register_forward_hook(lambda m, i, o: seen.append(o[0])))
    try:
        ids, cache, tokens = torch.tensor([prompt]), None, []
        with torch.no_grad():
            for _ in range(new):
                out = model(input_ids=ids, cache=cache, use_cache=True)
                cache = out.cache
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                hooks.start += ids.shape[1]
                ids = torch.tensor([[nxt]])
            hooks.start = 0
            seq = prompt + tokens
            seen.clear()
            model(input_ids=torch.tensor([seq[:-1]]))
    finally:
        hooks.remove()
    return tokens, list(seen)


@pytest.mark.parametrize("arch", ARCHS)
def test_steering_matches_transformers_hooks(arch, tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    llm = LLM(tiny_models[arch], dtype="float32")
    spec = HiddenStatesSpec(layers="all", points=["resid_pre", "final"], positions="all")
    prompts = random_prompts([3, 21], seed=6)
    plain = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                steering=_steers(), hidden_states=spec), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(prompts, outs, plain):
        tokens, hs = hf_steered(model, prompt, _steers(), NEW)
        assert out.outputs[0].token_ids == tokens
        changed += tokens != base.outputs[0].token_ids
        n = model.config.num_hidden_layers
        assert_close(out.hidden_states["resid_pre"], torch.stack(hs[:n], 1), 1e-4)
        assert_close(out.hidden_states["final"], hs[n][:, None], 1e-4)
    assert changed, "the steering should change what the model generates"


@pytest.mark.slow
def test_default_model_steering_matches_transformers(default_model_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()
    llm = LLM(dtype="float32")
    steers = [Steer(layers=[10, 20], point="resid_post", vector=_vec(7, 576, 30.0), scale=1.0),
              Steer(layers=[15], point="attn_out", op="ablate", vector=_vec(8, 576))]
    prompt = llm.tokenizer.encode("The three primary colors are")
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0, steering=steers,
                                                hidden_states={"points": "final"}), use_tqdm=False)[0]
    tokens, hs = hf_steered(model, prompt, steers, NEW)
    assert out.outputs[0].token_ids == tokens
    assert_close(out.hidden_states["final"], hs[-1][:, None], 1e-4)


def test_mixed_batch_and_prefix_cache(tiny_models):
    path = tiny_models["llama"]
    shared = random_prompts([48], seed=2)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    spec = HiddenStatesSpec(layers=[0, 2], points=["resid_post"], positions="all")
    steered = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=_steers()[:3], hidden_states=spec)
    other = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                           steering=[Steer(layers=[1], vector=_vec(9))], hidden_states=spec)
    plain = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, hidden_states=spec)
    solo = {name: LLM(path, dtype="float32", enable_prefix_caching=False).generate([a], p, use_tqdm=False)[0]
            for name, p in (("steered", steered), ("plain", plain))}
    llm = LLM(path, dtype="float32", block_size=8)
    mixed = llm.generate([a, a, b], [steered, plain, plain], use_tqdm=False)
    for out, name in ((mixed[0], "steered"), (mixed[1], "plain")):
        assert out.outputs[0].token_ids == solo[name].outputs[0].token_ids
        assert_close(out.hidden_states["resid_post"], solo[name].hidden_states["resid_post"], 1e-5)
    assert mixed[0].outputs[0].token_ids != mixed[1].outputs[0].token_ids

    # The same long prefix (these requests capture nothing, so the cache is theirs to use):
    # a different steer never reuses steered KV blocks, and unsteered ones never reuse steered ones...
    def no_capture(p: SamplingParams) -> SamplingParams:
        return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=p.steering)

    cache = LLM(path, dtype="float32", block_size=8)
    first = cache.generate([a], no_capture(steered), use_tqdm=False)[0]
    assert first.metrics["num_cached_tokens"] == 0
    assert cache.generate([b], no_capture(other), use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    assert cache.generate([b], no_capture(plain), use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    # ...while identical steers share, and unsteered requests keep sharing among themselves
    same = cache.generate([b], no_capture(steered), use_tqdm=False)[0]
    assert same.metrics["num_cached_tokens"] == 48
    # a steer of generated positions only leaves the prompt's blocks shared with unsteered requests
    late = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                          steering=[Steer(layers=[0, 1], vector=_vec(13), scale=2.0, positions="generated")])
    late_out = cache.generate([b], late, use_tqdm=False)[0]
    assert late_out.metrics["num_cached_tokens"] == 48
    late_ref = LLM(path, dtype="float32", enable_prefix_caching=False).generate([b], late, use_tqdm=False)[0]
    assert late_out.outputs[0].token_ids == late_ref.outputs[0].token_ids
    assert cache.generate([b + late_out.outputs[0].token_ids], no_capture(plain),
                          use_tqdm=False)[0].metrics["num_cached_tokens"] == 48  # not its steered blocks
    assert cache.generate([a], no_capture(plain), use_tqdm=False)[0].metrics["num_cached_tokens"] == 48
    ref = LLM(path, dtype="float32", enable_prefix_caching=False).generate([b], no_capture(steered),
                                                                           use_tqdm=False)[0]
    assert same.outputs[0].token_ids == ref.outputs[0].token_ids


def test_control_vector_files(tiny_models, tmp_path):
    import numpy as np
    from gguf import GGUFWriter
    from safetensors.torch import save_file

    path = tiny_models["llama"]
    v1, v2 = _vec(11), _vec(12)
    writer = GGUFWriter(str(tmp_path / "cv.gguf"), "controlvector")
    writer.add_uint32("controlvector.layer_count", 2)
    writer.add_tensor("direction.1", v1.numpy().astype(np.float32))
    writer.add_tensor("direction.2", v2.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    steer = Steer.from_file(tmp_path / "cv.gguf", scale=3.0)
    assert steer.layers == [1, 2] and steer.point == "resid_post" and steer.scale == 3.0
    torch.testing.assert_close(steer.vector_for(2), v2)
    save_file({"1": v1, "direction.2": v2}, str(tmp_path / "cv.safetensors"))
    from_st = Steer.from_file(tmp_path / "cv.safetensors", scale=3.0)

    llm = LLM(path, dtype="float32")
    prompt = random_prompts([9], seed=4)
    manual = Steer(point="resid_post", vector={1: v1, 2: v2}, scale=3.0)
    outs = [llm.generate(prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=[s]),
                         use_tqdm=False)[0].outputs[0].token_ids for s in (steer, from_st, manual)]
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] != llm.generate(prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("steer", "match"),
    [
        (dict(layers=[0], vector=torch.zeros(32) + 1), r"steering\[0\]\.vector has width 32, but the model's hidden size is 64"),
        (dict(layers=[5], vector=_vec(1)), r"steering\[0\]\.layers: layer 5 is out of range for a 3-block model"),
        (dict(layers=[0], vector=torch.full((64,), float("nan"))), r"steering\.vector holds NaN or infinite values"),
        (dict(layers=[0], vector=_vec(1), point="embed"), r"steering\.point: unknown point 'embed'"),
        (dict(layers=[0], vector=torch.zeros(64), op="ablate"), r"is zero: there is no direction to ablate"),
        (dict(layers=[0], vector=_vec(1), op="multiply"), r"steering\.op must be one of"),
        (dict(layers=[0], vector=_vec(1), colour=1), r"steering: unknown key\(s\) \['colour'\]"),
        (dict(vector=_vec(1)), r"steering\.layers is required"),
    ],
)
def test_bad_steering_is_refused_and_others_unaffected(steer, match, tiny_models):
    llm = _shared_llm(tiny_models)
    good = random_prompts([5], seed=1)[0]
    with pytest.raises(ValueError, match=match):
        llm.generate([good, good], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, steering=[steer])],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([good], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_steering_limits(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", max_steers_per_request=2)
    good = random_prompts([5], seed=1)[0]
    three = [Steer(layers=[0], vector=_vec(i)) for i in range(3)]
    with pytest.raises(ValueError, match="3 steers, more than max_steers_per_request=2"):
        llm.generate([good], SamplingParams(max_tokens=2, steering=three), use_tqdm=False)
    off = LLM(tiny_models["llama"], dtype="float32", enable_steering=False)
    with pytest.raises(ValueError, match="enable_steering=False"):
        off.generate([good], SamplingParams(max_tokens=2, steering=three[:1]), use_tqdm=False)


_LLM: dict = {}


def _shared_llm(tiny_models) -> LLM:
    if "llm" not in _LLM:
        _LLM["llm"] = LLM(tiny_models["llama"], dtype="float32")
    return _LLM["llm"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_resid_mid_steering_matches_transformers_hooks(arch, tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    llm = LLM(tiny_models[arch], dtype="float32")
    steers = [Steer(layers=[0, 2], point="resid_mid", op="add", vector=_vec(7), scale=2.0),
              Steer(layers=[1], point="resid_mid", op="ablate", vector=_vec(8), positions="prompt")]
    spec = HiddenStatesSpec(layers="all", points=["resid_pre", "final"], positions="all")
    prompts = random_prompts([4, 17], seed=9)
    plain = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, hidden_states=spec),
                         use_tqdm=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=steers,
                                                hidden_states=spec), use_tqdm=False)
    for prompt, out, base in zip(prompts, outs, plain):
        tokens, hs = hf_steered(model, prompt, steers, NEW)
        assert out.outputs[0].token_ids == tokens
        states = out.hidden_states
        for layer in range(model.config.num_hidden_layers):
            assert_close(states["resid_pre"][:, layer], hs[layer], 1e-4)
        assert_close(states["final"][:, 0], hs[-1], 1e-4)
        n = min(len(states.positions), len(base.hidden_states.positions))
        assert not torch.allclose(states["final"][:n], base.hidden_states["final"][:n])  # the steer did something


def test_several_adds_at_a_head_point_take_a_head_dim_vector(tiny_models):
    """Adds at one head point merge into one index_add_ in the eager step: a ``[head_dim]`` vector
    (applied to every head) must merge with others as its ``[heads, head_dim]`` expansion does."""
    llm = LLM(tiny_models["llama"], dtype="float32", enable_prefix_caching=False)
    g = torch.Generator().manual_seed(8)
    u, w = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def params(short: bool) -> SamplingParams:
        a, b = (u, w) if short else (u.expand(4, 16), w.expand(4, 16))
        return SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                              steering=[Steer(layers=[1], point="z", vector=a, scale=2.0),
                                        Steer(layers=[1], point="z", vector=b, positions="generated")],
                              hidden_states=HiddenStatesSpec(layers=[1], points="z", positions="all"))

    prompts = random_prompts([7, 11], seed=4)
    want = llm.generate(prompts, params(short=False), use_tqdm=False)
    for got in (llm.generate(prompts, params(short=True), use_tqdm=False),  # two requests, two adds each
                llm.generate(prompts, [params(short=True), params(short=False)], use_tqdm=False)):
        for a, b in zip(got, want):
            assert a.error is None, a.error
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert_close(a.hidden_states["z"], b.hidden_states["z"])
