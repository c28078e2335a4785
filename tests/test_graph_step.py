"""Steps run from CUDA graphs equal the eager step, every tap and steer included.

No GPU here: the engine runs the CUDA backend on the CPU (``backend="cuda"``): its Triton kernels in
Triton's interpreter and its graphs emulated (each replay calls the very function a graph holds, on
the same static buffers, with the same padding rows and the same slot tables). The ``cuda`` tests
replay real graphs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, SAE, HiddenStatesSpec, SamplingParams, Steer
from tapllm.engine import model_runner
from tapllm.hidden_states import HIDDEN_POINTS
from tapllm.kernels import triton_tap
from tapllm.sae.sae_config import SAEConfig

pytestmark = pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

DECODE = [1, 2, 4, 8]
MIXED = [16, 32, 64]


def _graphed(folder, max_num_seqs: int = 8, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", MIXED[-1])
    return LLM(folder, dtype="float32", backend="cuda", max_num_seqs=max_num_seqs, cuda_graph_sizes=DECODE,
               cuda_graph_token_sizes=MIXED, **kw)


def _eager(folder, **kw) -> LLM:
    return LLM(folder, dtype="float32", enforce_eager=True, **kw)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within 1e-5 of the tensor's scale: the Triton kernels sum in another order than PyTorch."""
    assert a.shape == b.shape
    scale = max(1.0, float(a.float().abs().max())) if a.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


def _same(want, got) -> None:
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.outputs[0].logprobs:
            _close(torch.tensor([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]),
                   torch.tensor([lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]))
        if a.hidden_states is not None:
            assert list(a.hidden_states.points) == list(b.hidden_states.points)
            assert a.hidden_states.positions.tolist() == b.hidden_states.positions.tolist()
            for point in a.hidden_states.points:
                _close(a.hidden_states[point], b.hidden_states[point])


def _params(hidden: int, layers: int, heads: int, d_mlp: int) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(3)
    v = torch.randn(hidden, generator=g) * 4
    three = [0, layers // 2, layers - 1]
    spec_all = HiddenStatesSpec(layers="all", points=["resid_pre", "attn_out", "mlp_out", "mlp_post", "z", "k"],
                                positions="all")
    head_dim = hidden // heads

    def p(n: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)

    return [
        p(7),
        p(9, hidden_states=spec_all),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True,
                       hidden_states=HiddenStatesSpec(layers=three, points="resid_post", positions="generated",
                                                      reduce="mean")),
        p(8, steering=[Steer(layers=[1], point="resid_post", vector=v, scale=1.5)],
          hidden_states=HiddenStatesSpec(points="final", positions="all")),
        p(5, logprobs=2, steering=[Steer(layers=[0, 2], point="attn_out", op="ablate", vector=v,
                                         positions="generated")]),
        p(8, steering=[Steer(layers=[2], point="mlp_out", op="scale", scale=0.5),
                       Steer(layers=[2], point="mlp_out", vector=v, scale=0.3)],
          hidden_states=HiddenStatesSpec(layers=[2], points="resid_post", positions="last")),
        p(6, steering=[Steer(layers=[1], point="resid_mid", op="clamp", vector=v, value=2.0)]),
        p(6, steering=[Steer(layers=[1], point="z", heads=[0, 3], vector=torch.randn(head_dim, generator=g) * 3),
                       Steer(layers=[0], point="mlp_post", op="ablate", neurons=[1, 5, 9],
                             vector=torch.randn(3, generator=g)),
                       Steer(layers=[2], point="q", op="scale", heads=[1], scale=-1.0)],
          hidden_states=HiddenStatesSpec(layers=[1], points=["z", "mlp_post"], positions=(2, 9))),
    ]


def test_graph_steps_equal_eager_steps(tiny_models):
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    cfg = graphed.engine.model_config
    prompts = random_prompts([5, 12, 3, 20, 9, 14, 7, 10], seed=11)
    params = _params(cfg.hidden_size, cfg.num_layers, cfg.num_heads, int(cfg.hf_config.intermediate_size))
    want = _eager(folder).generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    policy = graphed.engine.runner.policy
    assert policy.graph_steps > 0 and not policy.eager_steps, policy.eager_steps
    assert {k.kind for k in graphed.engine.runner.graph_step.graphs.replays} == {"decode", "mixed"}
    _same(want, got)


def test_set_patches_a_generated_position_inside_the_graph(tiny_models):
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    hidden = graphed.engine.model_config.hidden_size
    prompt = random_prompts([10], seed=2)[0]
    values = torch.randn(2, hidden, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            steering=[Steer(layers=[1], point="resid_pre", op="set", positions=[11, 12],
                                            values=values)],
                            hidden_states=HiddenStatesSpec(points="final", positions="all"))
    _same(_eager(folder).generate([prompt], params, use_tqdm=False), graphed.generate([prompt], params, use_tqdm=False))
    assert graphed.engine.runner.policy.graph_steps > 0


def test_what_a_graph_cannot_hold_runs_eagerly_and_says_why(tiny_models):
    graphed = _graphed(tiny_models["llama"], max_num_seqs=16)
    hidden = graphed.engine.model_config.hidden_size
    prompt = random_prompts([6], seed=4)
    spec = HiddenStatesSpec(layers=[1], points="attn_pattern", positions="all")
    graphed.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, hidden_states=spec),
                     use_tqdm=False)
    g = torch.Generator().manual_seed(0)
    sae = SAE(SAEConfig("standard", hidden, 32, point="resid_post", layer=1), torch.randn(hidden, 32, generator=g),
              torch.zeros(32), torch.randn(32, hidden, generator=g), torch.zeros(hidden))
    edit = [Steer(op="clamp", sae=sae, features={3: 5.0})]
    graphed.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, steering=edit),
                     use_tqdm=False)
    reasons = graphed.engine.runner.policy.eager_steps
    assert reasons["attention patterns are captured"] >= 2
    assert reasons["a steer edits SAE features"] >= 2
    stats = graphed.engine.stats()
    assert stats.graph_fallbacks == dict(reasons) and stats.graph_steps == graphed.engine.runner.policy.graph_steps


def test_a_step_whose_captures_overrun_the_buffer_runs_eagerly(tiny_models):
    """The capture buffer holds 8 hidden-size rows per token of the largest step; a step capturing more
    (every point of every block at every position of 22 prompt tokens, with steps of at most 32) runs
    eagerly instead of writing past it, and the later decode steps replay graphs."""
    folder = tiny_models["llama"]
    graphed = _graphed(folder, max_num_batched_tokens=32)
    spec = HiddenStatesSpec(layers="all", points=list(HIDDEN_POINTS), positions="all")
    prompts = random_prompts([10, 12], seed=13)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, hidden_states=spec)
    got = graphed.generate(prompts, params, use_tqdm=False)
    policy = graphed.engine.runner.policy
    assert policy.eager_steps == {"the step's captures exceed the capture buffer": 1}, policy.eager_steps
    assert policy.graph_steps == 2
    _same(_eager(folder).generate(prompts, params, use_tqdm=False), got)


def test_every_graph_is_captured_at_start_and_none_after(tiny_models):
    """Two graphs a bucket (plain, tapped): step graphs draw their random rows themselves."""
    graphed = _graphed(tiny_models["llama"])
    runner = graphed.engine.runner.graph_step.graphs
    graphs = 2 * (len(DECODE) + len(MIXED))
    assert runner.draws_in_step
    assert runner.buckets == len(DECODE) + len(MIXED) and runner.distinct_graphs == graphs
    spec = HiddenStatesSpec(layers=[0], points="resid_post", positions="all")
    prompts = random_prompts([4, 6, 5], seed=8)
    got = graphed.generate(prompts, [SamplingParams(max_tokens=4, temperature=0.8 if i == 1 else 0, seed=i,
                                                    ignore_eos=True, hidden_states=spec if i else None)
                                     for i in range(3)], use_tqdm=False)
    assert runner.captures_after_warmup == 0 and runner.distinct_graphs == graphs
    assert sum(runner.replays.values()) > 0
    want = _eager(tiny_models["llama"]).generate(prompts, [SamplingParams(
        max_tokens=4, temperature=0.8 if i == 1 else 0, seed=i, ignore_eos=True) for i in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_without_conditional_nodes_drawing_rows_run_sampler_graphs(tiny_models):
    """Where the driver captures no conditional node, drawing steps replay a sampler graph per sample
    size after the step's graph, with the same tokens."""
    graphed = _graphed(tiny_models["llama"])
    runner = graphed.engine.runner.graph_step.graphs
    runner.draws_in_step = False  # as the start-up probe decides on such a driver; then capture again
    runner.warm_up()
    assert runner.distinct_graphs == 2 * (len(DECODE) + len(MIXED)) + len(runner.draw_sizes)
    prompts = random_prompts([4, 6, 5], seed=9)
    params = [SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=7 + i, ignore_eos=True) for i in range(3)]
    got = graphed.generate(prompts, params, use_tqdm=False)
    want = _eager(tiny_models["llama"]).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_padding_rows_never_touch_a_request_s_blocks(tiny_models):
    """A step of 3 decodes replays the 4-row graph: the padding row writes only the padding block."""
    graphed = _graphed(tiny_models["llama"])
    runner = graphed.engine.runner
    k0 = [k.clone() for k, _ in runner.kv_caches]
    prompts, params = random_prompts([4, 4, 4], seed=6), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    got = graphed.generate(prompts, params, use_tqdm=False)
    want = _eager(tiny_models["llama"]).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    pad = runner.padding_block
    for (k, _), before in zip(runner.kv_caches, k0):
        assert not torch.equal(k[:, pad], before[:, pad])  # padding wrote there
    assert runner.graph_step.graphs.replays[next(iter(runner.graph_step.graphs.replays))] > 0


def test_a_slot_left_by_a_tapped_request_taps_nothing_for_the_next(tiny_models):
    folder = tiny_models["llama"]
    graphed = _graphed(folder, max_num_seqs=1)
    hidden = graphed.engine.model_config.hidden_size
    prompt = random_prompts([7], seed=9)
    steered = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                             steering=[Steer(layers=[0, 1, 2], point="resid_post", vector=torch.ones(hidden) * 5)],
                             hidden_states=HiddenStatesSpec(layers="all", points="resid_pre", positions="all"))
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    graphed.generate(prompt, steered, use_tqdm=False)
    tables = graphed.engine.runner.graph_step.taps
    assert not tables.rec.any() and not tables.steered.any()
    assert int(tables.st_count.abs().sum()) == 0 and int((tables.cap_off >= 0).sum()) == 0
    got = graphed.generate(prompt, plain, use_tqdm=False)
    want = _eager(folder).generate(prompt, plain, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_step_that_fails_before_its_upload_leaves_the_others_unchanged(tiny_models, monkeypatch):
    """Laying a graph step out counts its requests' block-table rows and slot tables as sent; when the
    step fails before its upload carried them, the halves it is rerun in must send them again."""
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    cfg = graphed.engine.model_config
    params = _params(cfg.hidden_size, cfg.num_layers, cfg.num_heads, int(cfg.hf_config.intermediate_size))
    prompts = random_prompts([5, 12, 3, 20, 9, 14, 7, 10], seed=11)
    poisoned = random_prompts([6], seed=99)[0]
    real = model_runner.upload_graph

    def upload_graph(lay, *args, **kwargs):
        if any(it.request.prompt_token_ids == poisoned for it in lay.items):
            raise RuntimeError("staging failure")
        return real(lay, *args, **kwargs)

    monkeypatch.setattr(model_runner, "upload_graph", upload_graph)
    got = graphed.generate([poisoned] + prompts, params[:1] + params, use_tqdm=False)
    assert "staging failure" in got.pop(0).error
    assert graphed.engine.runner.policy.graph_steps > 0
    _same(_eager(folder).generate(prompts, params, use_tqdm=False), got)


def test_a_kept_decode_placement_equals_placing_the_rows_again(tiny_models, monkeypatch):
    """A decode step that keeps the step before's placement of captured rows (the same slots a position
    further, no capture window's edge crossed) places them as the tables would again, windows opening and
    closing mid-decode and requests finishing included; the states equal the eager path's."""
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    gs = graphed.engine.runner.graph_step
    shape = type(gs).shape
    counts = {"kept": 0, "placed": 0}
    wrong = []

    def checked(self, lay):
        out = shape(self, lay)
        if lay.decode_only and self.taps.capturing and out.blocked is None:
            rows, total = self.taps.chunk_places(lay.item_slots, lay.pos)
            got = [] if self._placed is None else [(i, first, n) for i, first, n, _ in self._placed[0]]
            if got != [tuple(r) for r in rows] or (self._placed is not None and self._placed[1] != total):
                wrong.append((list(lay.pos), got, rows))  # (an assert here would fail the step, not the test)
            kept = self._steady is not None and self._steady.steps > 0
            counts["kept" if kept else "placed"] += 1
        return out

    monkeypatch.setattr(type(gs), "shape", checked)

    def p(n: int, positions) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                              hidden_states=HiddenStatesSpec(layers=[1], points="resid_post", positions=positions))

    params = [p(12, (3, 10)), p(14, "all"), p(9, "last"), SamplingParams(max_tokens=11, temperature=0,
                                                                         ignore_eos=True), p(13, (5, 12)), p(12, (10, 14))]
    prompts = random_prompts([7, 7, 5, 8, 6, 7], seed=4)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert not wrong
    assert counts["kept"] >= 3 and counts["placed"] >= 3
    _same(_eager(folder).generate(prompts, params, use_tqdm=False), got)


def test_a_preempted_request_captures_each_position_once(tiny_models):
    """A cache too small for every request: preempted requests recompute their positions, and capture
    each one once (their slot tables are written anew when they run again)."""
    folder = tiny_models["llama"]
    spec = HiddenStatesSpec(layers=[0, 2], points=["resid_post", "mlp_out"], positions="all")
    prompts = random_prompts([20, 18, 22, 19], seed=12)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, hidden_states=spec)
    graphed = _graphed(folder, kv_cache_blocks=7, block_size=8)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert graphed.engine.scheduler.num_preemptions > 0
    _same(_eager(folder).generate(prompts, params, use_tqdm=False), got)


def test_projected_head_selected_and_sae_extended_captures_in_a_graph(tiny_models):
    """A capture whose record differs from its result: a projection, a head selection, and raw states
    of layers other than the one its SAE reads (the record also holds the SAE's layer). The graph
    hands each request its rows as recorded (every head, full width, only its own layers)."""
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    hidden = graphed.engine.model_config.hidden_size
    g = torch.Generator().manual_seed(5)
    sae = SAE(SAEConfig("standard", hidden, 32, point="resid_post", layer=1), torch.randn(hidden, 32, generator=g),
              torch.zeros(32), torch.randn(32, hidden, generator=g), torch.zeros(hidden))
    specs = [HiddenStatesSpec(layers=[0, 2], points="resid_post", positions="all", project=torch.randn(2, hidden)),
             HiddenStatesSpec(layers=[1], points=["z", "k"], positions="all", heads=[2, 0]),
             HiddenStatesSpec(layers=[0], points="resid_post", positions="all", sae=sae, features="topk:4")]
    prompts = random_prompts([6, 9, 5], seed=13)
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, hidden_states=s) for s in specs]
    want = _eager(folder).generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in got), [o.error for o in got]
    assert graphed.engine.runner.policy.graph_steps > 0 and not graphed.engine.runner.policy.eager_steps
    _same(want, got)
    f, h = got[2].hidden_states.features, want[2].hidden_states.features
    assert f.ids.tolist() == h.ids.tolist()
    _close(f.values, h.values)
