"""Decode steps through the CUDA-graph runner equal the eager step, taps and steering included.

No GPU here: the runner is used with ``capture=False``, so it calls the very function a graph
would hold, on the same static buffers, with the same padding rows (writing to the trash
block) and the same :class:`GraphTap` (captured rows copied whole, steering operands in
buffers with a no-op everywhere but the steered rows). The ``cuda`` tests replay real graphs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

SIZES = (1, 2, 4, 8)


def _llm(folder, graphs: bool, eager: bool = False, max_num_seqs: int = 8) -> LLM:
    llm = LLM(folder, dtype="float32", enforce_eager=eager, max_num_seqs=max_num_seqs)
    if graphs:
        llm.engine.runner.use_graphs(SIZES, capture=False)
    return llm


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _params(hidden: int, layers: int) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(3)
    v = torch.randn(hidden, generator=g) * 4
    three = [0, layers // 2, layers - 1]
    spec_all = HiddenStatesSpec(layers="all", points=["resid_pre", "attn_out", "mlp_out", "mlp_post", "z"],
                                positions="all")
    return [
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, hidden_states=spec_all),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True,
                       hidden_states=HiddenStatesSpec(layers=three, points="resid_post", positions="generated",
                                                      reduce="mean")),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       steering=[Steer(layers=[1], point="resid_post", vector=v, scale=1.5)],
                       hidden_states=HiddenStatesSpec(points="final", positions="all")),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2,
                       steering=[Steer(layers=[0, 2], point="attn_out", op="ablate", vector=v, positions="generated")]),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                       steering=[Steer(layers=[2], point="mlp_out", op="scale", scale=0.5)],
                       hidden_states=HiddenStatesSpec(layers=[2], points="resid_post", positions="last")),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                       steering=[Steer(layers=[1], point="resid_mid", op="clamp", vector=v, value=2.0)]),
    ]


@pytest.mark.parametrize("eager", [False, True])
def test_graph_steps_equal_eager_steps(tiny_models, eager):
    folder = tiny_models["llama"]
    plain, graphed = _llm(folder, False, eager), _llm(folder, True, eager)
    cfg = plain.engine.model_config
    prompts = random_prompts([5, 12, 3, 20, 9, 14, 7], seed=11)
    params = _params(cfg.hidden_size, cfg.num_layers)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    runner = graphed.engine.runner.graphs
    assert runner.replays > 0
    assert set(runner.fallbacks) <= {"a prefill chunk in the step"}, runner.fallbacks
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.outputs[0].logprobs:
            _close(torch.tensor([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]),
                   torch.tensor([lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]))
        if a.hidden_states is not None:
            assert list(a.hidden_states.points) == list(b.hidden_states.points)
            for point in a.hidden_states.points:
                _close(a.hidden_states[point], b.hidden_states[point])


def test_set_patches_a_generated_position_inside_the_graph(tiny_models):
    folder = tiny_models["llama"]
    plain, graphed = _llm(folder, False), _llm(folder, True)
    hidden = plain.engine.model_config.hidden_size
    prompt = random_prompts([10], seed=2)[0]
    values = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            steering=[Steer(layers=[1], point="resid_pre", op="set", positions=[12], values=values)],
                            hidden_states=HiddenStatesSpec(points="final", positions="all"))
    a = plain.generate([prompt], params, use_tqdm=False)[0]
    b = graphed.generate([prompt], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _close(a.hidden_states["final"], b.hidden_states["final"])
    assert graphed.engine.runner.graphs.replays > 0


def test_what_a_graph_cannot_hold_runs_eagerly_and_says_why(tiny_models):
    graphed = _llm(tiny_models["llama"], True, max_num_seqs=16)
    prompt = random_prompts([6], seed=4)
    spec = HiddenStatesSpec(layers=[1], points="attn_pattern", positions="all")
    graphed.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, hidden_states=spec),
                     use_tqdm=False)
    heads = [Steer(layers=[1], point="z", heads=[0], vector=torch.ones(16))]
    graphed.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, steering=heads),
                     use_tqdm=False)
    many = random_prompts([3] * 9, seed=5)
    graphed.generate(many, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    reasons = graphed.engine.runner.graphs.fallbacks
    assert reasons["attention patterns are captured"] >= 2
    assert reasons["a steer edits heads, neurons or SAE features"] >= 2
    assert reasons[f"more than {max(SIZES)} rows"] >= 1


def test_padding_rows_never_touch_a_request_s_blocks(tiny_models):
    """A step of 3 decodes replays the 4-row graph: the padding row writes only the trash block."""
    graphed, plain = _llm(tiny_models["llama"], True), _llm(tiny_models["llama"], False)
    runner = graphed.engine.runner
    k0 = [k.clone() for k, _ in runner.kv_caches]
    prompts, params = random_prompts([4, 4, 4], seed=6), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    got = graphed.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    trash = runner.trash_block
    for (k, _), before in zip(runner.kv_caches, k0):
        assert not torch.equal(k[:, trash], before[:, trash])  # padding wrote there
    assert runner.graphs.replays > 0


def test_a_graph_captured_mid_run_keeps_the_step_s_inputs(tiny_models, monkeypatch):
    """A tapped graph is captured when a step first needs it, after that step's inputs were copied
    in: capturing runs on padding rows and must hand the step its own inputs back."""
    from tapllm.engine.cuda_graphs import _Graph

    folder = tiny_models["llama"]
    plain, graphed = _llm(folder, False), _llm(folder, True)
    runner = graphed.engine.runner.graphs
    recorded = []

    def record(b, tap):  # what capturing does to the buffers, without a GPU: a forward on padding rows
        assert int(runner.inputs[2, 0]) == runner.trash_slot  # the rows are padding while capturing
        runner._forward(b, tap)
        recorded.append(b)
        return _Graph(None, None)

    monkeypatch.setattr(runner, "capture", True)
    monkeypatch.setattr(runner, "_record", record)
    spec = HiddenStatesSpec(layers=[0, 2], points="resid_post", positions="all")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, hidden_states=spec)
    prompts = random_prompts([6, 9], seed=8)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert recorded  # tapped graphs were captured during the run
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        _close(a.hidden_states["resid_post"], b.hidden_states["resid_post"])
