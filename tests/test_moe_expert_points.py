"""The experts as points: ``expert_out`` (each named expert's own output) and ``shared_expert_out`` (Qwen2-MoE's
gated shared expert), in every mixture-of-experts family, against transformers in float32.

``expert_out`` at every block and position of a batched, chunked generate equals transformers' experts module
run on the block's input with all the weight on one expert (read by a forward pre-hook on each experts module),
at the tokens routed to that expert, and is 0 elsewhere; NaN at a dense block. Asking for it changes nothing
else the step computes (bit for bit). ``shared_expert_out`` equals ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)`` read by hooks; a model without a shared expert does not expose it; a steer there adds to
the MLP output as a steer of ``mlp_out`` does. Sums over a prompt reduce on the device. Bad selections are
refused naming the field.
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import pytest
import torch

from conftest import random_prompts
from family_configs import moe_configs
from family_harness import assert_close_states
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.models.moe import SparseMoE
from test_family_moe import _router
from test_moe_router import _removed, _sparse, llms, moe  # noqa: F401 - fixtures

FAMILIES = sorted(moe_configs())
EXPERTS = [3, 0]  # out of order on purpose: rows come back in the order named


def _hf_expert_outs(model, seq: list[int], experts: list[int]) -> torch.Tensor:
    """``[T, sparse blocks, len(experts), hidden]``: each named expert's output at the tokens routed to it, 0
    elsewhere, from transformers' experts module run on the block's input with weight 1 on that expert alone."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    mods = [model.model.layers[i].mlp.experts for i in _sparse(model)]
    handles = [m.register_forward_pre_hook(lambda m, a: seen.append((a[0].detach(), a[1].detach()))) for m in mods]
    with torch.no_grad(), _removed(handles):
        model(input_ids=torch.tensor([seq]))
    blocks = []
    with torch.no_grad():
        for m, (h, ids) in zip(mods, seen, strict=True):
            one = torch.ones(h.shape[0], 1, dtype=h.dtype)
            rows = []
            for e in experts:
                own = m(h, torch.full((h.shape[0], 1), e, dtype=ids.dtype), one)
                rows.append(torch.where((ids == e).any(-1, keepdim=True), own, torch.zeros_like(own)))
            blocks.append(torch.stack(rows, 1))
    return torch.stack(blocks, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_out_equals_transformers_experts(family, moe, llms):
    """Each named expert's output at every block and position of a batched, chunked generate; 0 where the
    token is not routed to it; NaN at a dense block."""
    _, model = moe[family]
    prompts = random_prompts([1, 19, 6], seed=61)
    spec = HiddenStatesSpec(layers="all", points=["expert_out", "experts_chosen"], experts=EXPERTS)
    outs = llms(family).generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                         hidden_states=spec), use_tqdm=False)
    sparse = _sparse(model)
    dense = [i for i in range(len(model.model.layers)) if i not in sparse]
    for prompt, out in zip(prompts, outs, strict=True):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        got = out.hidden_states["expert_out"]
        assert got.shape == (len(seq), len(model.model.layers), len(EXPERTS), model.config.hidden_size)
        assert_close_states(got[:, sparse], _hf_expert_outs(model, seq, EXPERTS), f"expert_out ({family})", 1e-5)
        routed = out.hidden_states["experts_chosen"][:, sparse][:, :, EXPERTS] == 1  # [T, sparse, named]
        assert (got[:, sparse][~routed] == 0).all()
        assert (got[:, sparse][routed].abs().sum(-1) > 0).all()
        assert got[:, dense].isnan().all()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_asking_for_expert_out_changes_nothing_else(family, llms):
    """The tapped block runs its experts through the grouped loop that keeps each expert's rows (not the fused
    ``moe_experts`` call, where the backend has it): the same ops in the same order, so the tokens and the
    MLP output are bit for bit those of the same batch that does not ask."""
    llm = llms(family)
    prompts = random_prompts([11, 5], seed=62)
    plain = HiddenStatesSpec(layers="all", points=["mlp_out"])
    tapped = HiddenStatesSpec(layers="all", points=["mlp_out", "expert_out"], experts=[1])
    experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)).experts
    fused = getattr(experts.gemv, "moe_experts", None)  # the C++ loop over experts (CPU kernels built here)
    runs, calls = [], []
    for spec in (plain, tapped):
        with mock.patch.object(experts, "gemv", mock.Mock(wraps=experts.gemv)) if fused else ExitStack() as spy:
            runs.append(llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                             hidden_states=spec), use_tqdm=False))
            calls.append(spy.moe_experts.call_count if fused else None)
    if fused:
        assert calls[0] > 0 and calls[1] == 0, calls  # the tapped blocks ran the Python loop
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.equal(a.hidden_states["mlp_out"], b.hidden_states["mlp_out"])


def _hf_shared(model, seq: list[int]) -> torch.Tensor:
    """``[T, sparse blocks, hidden]``: ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` per sparse block."""
    gates, shared = [], []
    handles = []
    for i in _sparse(model):
        mlp = model.model.layers[i].mlp
        handles.append(mlp.shared_expert_gate.register_forward_hook(lambda m, a, o: gates.append(o)))
        handles.append(mlp.shared_expert.register_forward_hook(lambda m, a, o: shared.append(o)))
    with torch.no_grad(), _removed(handles):
        model(input_ids=torch.tensor([seq]))
    return torch.stack([(torch.sigmoid(g) * s).reshape(len(seq), -1) for g, s in zip(gates, shared, strict=True)], 1)


def test_shared_expert_out_equals_transformers(moe, llms):
    """Qwen2-MoE's gated shared expert at every block and position of a batched, chunked generate; NaN at the
    dense block."""
    _, model = moe["qwen2_moe"]
    prompts = random_prompts([1, 19, 6], seed=63)
    spec = HiddenStatesSpec(layers="all", points=["shared_expert_out"])
    outs = llms("qwen2_moe").generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                              hidden_states=spec), use_tqdm=False)
    sparse = _sparse(model)
    assert sparse == [0, 2]
    for prompt, out in zip(prompts, outs, strict=True):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        got = out.hidden_states["shared_expert_out"]
        assert got.shape == (len(seq), 3, model.config.hidden_size)
        assert_close_states(got[:, sparse], _hf_shared(model, seq), "shared_expert_out", 1e-5)
        assert got[:, 1].isnan().all()


def test_a_steer_of_the_shared_expert_adds_to_the_mlp_output(llms):
    """Adding v to what the shared expert adds is adding v to the MLP output: the same logits as an ``add`` at
    ``mlp_out``, and the captured ``shared_expert_out`` carries v."""
    llm = llms("qwen2_moe")
    prompt = random_prompts([9], seed=64)[0]
    v = torch.randn(64, generator=torch.Generator().manual_seed(5))
    spec = HiddenStatesSpec(layers=[0], points=["shared_expert_out"], positions="prompt")

    def run(point: str | None):
        steering = [Steer(point=point, layers=[0], vector=v, op="add")] if point else None
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=5, steering=steering,
                                hidden_states=spec)
        return llm.generate([prompt], params, use_tqdm=False)[0]

    plain, shared, mlp = run(None), run("shared_expert_out"), run("mlp_out")
    assert shared.outputs[0].token_ids == mlp.outputs[0].token_ids
    for a, b in zip(shared.outputs[0].logprobs, mlp.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-5
    got = shared.hidden_states["shared_expert_out"] - plain.hidden_states["shared_expert_out"]
    assert torch.allclose(got, v.expand_as(got), atol=1e-5)


def test_expert_points_reduce_over_a_prompt(moe):
    """``sum`` of ``expert_out`` and ``mean`` of ``shared_expert_out`` over a prompt, through encode in chunks,
    equal the per-token rows reduced on the host (NaN at the dense block)."""
    llm = LLM(moe["qwen2_moe"][0], dtype="float32", block_size=4, max_num_batched_tokens=5)
    prompt = random_prompts([13], seed=65)[0]
    points = ["expert_out", "shared_expert_out"]
    rows = HiddenStatesSpec(layers="all", points=points, positions="prompt", experts=[2, 1])
    sums = HiddenStatesSpec(layers="all", points=["expert_out"], positions="prompt", reduce="sum", experts=[2, 1])
    means = HiddenStatesSpec(layers="all", points=["shared_expert_out"], positions="prompt", reduce="mean")
    per_token, summed, averaged = (o.hidden_states for o in llm.encode([prompt] * 3, [rows, sums, means],
                                                                       use_tqdm=False))
    assert summed["expert_out"].shape == (3, 2, 64)
    # within 1e-5: the device sums its rows in blocks, the host in one pass (another order of the same sums)
    torch.testing.assert_close(summed["expert_out"], per_token["expert_out"].sum(0), rtol=1e-5, atol=1e-5,
                               equal_nan=True)
    torch.testing.assert_close(averaged["shared_expert_out"], per_token["shared_expert_out"].mean(0), rtol=1e-5,
                               atol=1e-5, equal_nan=True)
    assert summed["expert_out"][1].isnan().all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(points=["expert_out"]), "hidden_states.experts is required with point 'expert_out'"),
    (dict(points=["resid_post"], experts=[1]), "hidden_states.experts selects rows of point 'expert_out'"),
    (dict(points=["expert_out"], experts=[]), "hidden_states.experts is empty"),
    (dict(points=["expert_out"], experts=[-1]), "hidden_states.experts: expert ids must be >= 0"),
    (dict(points=["expert_out"], experts=[1, 1]), "hidden_states.experts names an expert twice"),
    (dict(points=["expert_out"], experts=["a"]), "hidden_states.experts must hold expert ids"),
])
def test_an_expert_selection_is_checked_where_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiddenStatesSpec(**kwargs)


def test_the_command_line_form_takes_experts():
    spec = HiddenStatesSpec.parse("layers=0 points=expert_out experts=3,1")
    assert spec.experts == [3, 1] and spec.to_dict()["experts"] == [3, 1]


@pytest.mark.parametrize("family, request_kwargs, message", [
    ("qwen2_moe", dict(hidden_states=HiddenStatesSpec(points=["expert_out"], experts=[4])),
     r"hidden_states.experts: expert 4 is out of range for 4 experts \(valid: 0..3\)"),
    ("mixtral", dict(hidden_states=HiddenStatesSpec(points=["shared_expert_out"])),
     "hidden_states.points: this model does not expose 'shared_expert_out'"),
    ("mixtral", dict(steering=[Steer(point="shared_expert_out", layers=[0], vector=torch.ones(64))]),
     r"steering\[0\].point: this model does not expose 'shared_expert_out'"),
])
def test_expert_points_are_checked_against_the_model(family, request_kwargs, message, llms):
    with pytest.raises(ValueError, match=message):
        llms(family).generate([[1, 2, 3]], SamplingParams(max_tokens=2, **request_kwargs), use_tqdm=False)


def test_a_dense_model_exposes_no_expert_point(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    for point, extra in (("expert_out", {"experts": [0]}), ("shared_expert_out", {})):
        with pytest.raises(ValueError, match=f"this model does not expose '{point}'"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, hidden_states=HiddenStatesSpec(points=[point], **extra)),
                         use_tqdm=False)
