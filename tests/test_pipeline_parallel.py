"""Pipeline parallelism on the CPU: PP 2 and TP 2 x PP 2 give what one process gives.

Greedy tokens identical; states at every point kind within 1e-5 in float32, in blocks of either
stage; steering at residual and sharded points of both stages, SAE features and feature steering
(rank 0 steers a later stage's point), the logit lens, chunked prefill, prefix-cache hits,
preemption, steps that stop before the last stage, seeded sampling with n > 1, every registered
family, and a random schedule of mixed requests against each request alone. A rank of a later
stage that dies or hangs makes the engine raise a clear error quickly, and no worker is left behind
(tests/test_tensor_parallel.py, with TP's ranks).
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.parallel import TensorParallelError
from tapllm.parallel.layout import stage_layers
from tapllm.tap.points import DENSE_POINTS as POINTS  # the dense models here have no router
from test_tensor_parallel import FAMILIES, _same, family_folders, same_as_each_alone  # noqa: F401 - a fixture

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32)
SPLITS = {"pp2": dict(pipeline_parallel_size=2), "tp2pp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2)}


@pytest.fixture(scope="module")
def one(tiny_models):
    return LLM(tiny_models["llama"], enforce_eager=True, **ENGINE)


@pytest.fixture(scope="module", params=list(SPLITS))
def split(request, tiny_models):
    llm = LLM(tiny_models["llama"], **SPLITS[request.param], **ENGINE)
    yield llm
    llm.close()


def test_every_point_token_and_logprob_equal_one_process(one, split):
    spec = HiddenStatesSpec(layers="all", points=list(POINTS), positions="all")
    params = greedy(6, hidden_states=spec, logprobs=2)
    prompts = random_prompts([5, 40, 11], seed=3)  # 40 > the budget of 32: chunked prefill
    a, b = one.generate(prompts, params, use_tqdm=False), split.generate(prompts, params, use_tqdm=False)
    _same(a, b, POINTS)
    for x, y in zip(a, b):
        for t, lx, ly in zip(x.outputs[0].token_ids, x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert set(lx) == set(ly) and abs(lx[t].logprob - ly[t].logprob) < 1e-5
    tp = split.engine.runner.tp
    assert tp.stages == [(0, 1), (1, 3)] and len(tp.procs) == tp.world - 1  # stage 0 runs the (large) head too
    assert "pipeline parallel: 2 stages" in split.describe()
    # a later stage holds its blocks only: no embedding, no LM head
    assert tp.weight_bytes[-1] < tp.weight_bytes[0] / 20


def test_two_batches_in_flight_and_the_synchronous_pipeline(one, split, tiny_models, monkeypatch):
    """Stage 0 starts a batch while stage 1 runs the one before (the engine's queue holds two), and the
    synchronous pipeline (``async_scheduling=False``: stages take turns on one batch) gives the same."""
    from tapllm.engine.step_loop import StepLoop

    loop = split.engine.loop
    assert loop.depth == 2 and split.engine.scheduler.pipelined
    depths = []
    take = StepLoop._take
    monkeypatch.setattr(StepLoop, "_take", lambda self, step: depths.append(len(self.queue)) or take(self, step))
    spec = HiddenStatesSpec(layers=[1, 2], points=["resid_post", "z"], positions="all")
    prompts = random_prompts([5, 9, 3, 17, 8, 12], seed=51)
    params = [greedy(7, hidden_states=spec), greedy(4), greedy(9, hidden_states=spec)] * 2
    expected = one.generate(prompts, params, use_tqdm=False)
    _same(expected, split.generate(prompts, params, use_tqdm=False), ["resid_post", "z"])
    assert max(depths) >= 1  # a batch was still in flight when another was taken
    sync = LLM(tiny_models["llama"], pipeline_parallel_size=2, async_scheduling=False, **ENGINE)
    try:
        assert sync.engine.loop.depth == 1 and not sync.engine.scheduler.pipelined
        _same(expected, sync.generate(prompts, params, use_tqdm=False), ["resid_post", "z"])
    finally:
        sync.close()


def test_grammars_and_logits_controls_beside_plain_requests(one, split):
    """A running request with a grammar or logits controls makes the pipeline take turns (its masks are
    computed a step at a time); the tokens are one process's either way."""
    params = [SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "[0-9]{3}-[a-z]+"}),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={5: 3.0, 7: -100.0}),
              greedy(8), greedy(5)]
    prompts = random_prompts([6, 10, 7, 13], seed=61)
    a, b = one.generate(prompts, params, use_tqdm=False), split.generate(prompts, params, use_tqdm=False)
    _same(a, b)


def test_large_relays_and_inputs_in_flight_do_not_block(one, tiny_models):
    """Captures of later-stage points far larger than a pipe's buffer, long prompts (large step messages) and
    rank-0 steers of a later stage's point, with batches in flight: every side keeps reading (no deadlock)."""
    import threading

    from tapllm import SAE
    from tapllm.sae.model import SAEConfig

    g = torch.Generator().manual_seed(71)
    sae = SAE(SAEConfig("standard", 64, 32, "resid_post", 2), torch.randn(64, 32, generator=g) * 0.3,
              torch.randn(32, generator=g) * 0.1, torch.randn(32, 64, generator=g) * 0.1, torch.zeros(64))
    spec = HiddenStatesSpec(layers=[2], points=["resid_post", "mlp_post", "attn_pattern"], positions="all")
    params = [greedy(4, hidden_states=spec), greedy(4, steering=[Steer(op="add", sae=sae, features={1: 4.0})]),
              greedy(6, hidden_states=spec)] * 3
    prompts = random_prompts([300, 260, 310, 280, 290, 250, 270, 305, 295], seed=72)
    big = {**ENGINE, "kv_cache_blocks": 256, "max_num_batched_tokens": 1024}
    expected = LLM(tiny_models["llama"], enforce_eager=True, **big).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_models["llama"], pipeline_parallel_size=2, **big)
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(llm.generate(prompts, params, use_tqdm=False)), daemon=True)
    try:
        worker.start()
        worker.join(180)
        assert not worker.is_alive(), "the pipelined engine blocked"
        _same(expected, got, ["resid_post", "mlp_post", "attn_pattern"])
    finally:
        llm.close()


def test_the_eager_path_under_pipeline_stages(one, tiny_models):
    """``enforce_eager=True`` (the plain PyTorch step on every stage) gives what one process gives too."""
    llm = LLM(tiny_models["llama"], pipeline_parallel_size=2, tensor_parallel_size=2, enforce_eager=True, **ENGINE)
    try:
        spec = HiddenStatesSpec(layers="all", points=["resid_post", "z", "mlp_post"], positions="all")
        params = [greedy(5, hidden_states=spec), greedy(5)]
        prompts = random_prompts([9, 40], seed=81)
        _same(one.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False),
              ["resid_post", "z", "mlp_post"])
        assert all(path == "eager" for _, _, path in llm.engine.runner.model.last_runs)
    finally:
        llm.close()


def test_plan_equals_what_the_split_engine_holds(split, tiny_models):
    """``plan_split(..., pipeline_parallel_size=2)``: each rank's weight bytes and rank 0's KV bytes are what
    the running engine holds (counted on its loaded parameters and its cache)."""
    from tapllm.parallel import plan_split

    tp, runner = split.engine.runner.tp, split.engine.runner
    plan = plan_split(tiny_models["llama"], tp.size, "float32", pipeline_parallel_size=2)
    assert [r.weight_bytes for r in plan.ranks] == tp.weight_bytes
    assert [r.stage for r in plan.ranks] == [r // tp.size for r in range(tp.world)]
    held = sum(c.nbytes for pair in runner.kv_caches for c in pair)  # rank 0's: block 0 only
    assert held == (runner.num_blocks + 1) * 16 * plan.ranks[0].kv_bytes_per_token
    assert "stages: 0: blocks 0-0, 1: blocks 1-2" in str(plan)


def test_70b_at_tp4_pp2_fits_80gb_gpus_planned_on_meta():
    from tapllm.parallel import plan_split
    from test_tp_plan import LLAMA_70B

    plan = plan_split(LLAMA_70B, 4, "bfloat16", kv_tokens=8 * 8192, gpu_memory_gib=80, pipeline_parallel_size=2)
    assert plan.tensor_parallel_size == 4 and len(plan.ranks) == 8 and plan.fits is True
    # the head (128256 x 8192) weighs 1.2 blocks: stage 0 takes 39 blocks, stage 1 41
    assert [r.blocks for r in plan.ranks] == [(0, 39)] * 4 + [(39, 80)] * 4
    assert all(r.weight_bytes <= plan.model_weight_bytes * (1 / 8 + 0.01) for r in plan.ranks)
    assert [r.kv_bytes_per_token for r in plan.ranks] == [2 * 39 * 2 * 128 * 2] * 4 + [2 * 41 * 2 * 128 * 2] * 4
    with pytest.raises(ValueError, match="pipeline_parallel_size=81 exceeds"):
        plan_split(LLAMA_70B, 1, pipeline_parallel_size=81)


def test_steering_in_both_stages(one, split):
    g = torch.Generator().manual_seed(5)
    hidden, head_dim = 64, 16

    def v(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g)

    steers = [  # block 0 is stage 0's, blocks 1 and 2 stage 1's
        Steer(layers=[0, 2], point="resid_post", vector=v(hidden), scale=2.0),
        Steer(layers=[2], point="attn_out", op="ablate", vector=v(hidden)),
        Steer(layers=[2], point="z", vector=v(head_dim), scale=3.0, heads=[1, 2]),
        Steer(layers=[2], point="mlp_post", op="scale", scale=0.0, neurons=[3, 64, 100]),
        Steer(layers=[2], point="k", vector=v(head_dim), heads=[1]),
        Steer(layers=[0], point="v", op="clamp", vector=v(head_dim), value=0.5),
        Steer(layers=[2], point="q", op="scale", scale=1.5, heads=[0, 3], positions="generated"),
    ]
    points = ["resid_post", "z", "k", "mlp_post", "attn_pattern"]
    spec = HiddenStatesSpec(layers="all", points=points, positions="all")
    params = [greedy(6, steering=steers, hidden_states=spec), greedy(6)]  # a steered and a plain request
    prompts = random_prompts([9, 14], seed=4)
    _same(one.generate(prompts, params, use_tqdm=False), split.generate(prompts, params, use_tqdm=False), points)


def test_sae_features_and_feature_steering_in_a_later_stage(one, split):
    from tapllm import SAE
    from tapllm.sae.model import SAEConfig

    g = torch.Generator().manual_seed(21)
    sae = SAE(SAEConfig("jumprelu", 64, 128, "resid_post", 2), torch.randn(64, 128, generator=g) * 0.3,
              torch.randn(128, generator=g) * 0.1, torch.randn(128, 64, generator=g) * 0.1,
              torch.randn(64, generator=g) * 0.1, threshold=torch.rand(128, generator=g) * 0.5)
    steers = [Steer(op="add", sae=sae, features={5: 8.0, 9: -4.0}), Steer(op="clamp", sae=sae, features={3: 20.0})]
    spec = HiddenStatesSpec(layers=[2], points=["resid_post"], sae=sae, features="all")
    params = greedy(5, steering=steers, hidden_states=spec)
    prompts = random_prompts([8, 13], seed=22)
    a, b = one.generate(prompts, params, use_tqdm=False), split.generate(prompts, params, use_tqdm=False)
    _same(a, b, ["resid_post"])
    for x, y in zip(a, b):
        assert_close(y.hidden_states.features.dense, x.hidden_states.features.dense, 1e-5)


def test_lens_prefix_hits_and_seeded_samples(one, split):
    prefix = random_prompts([32], seed=8)[0]
    prompts = [prefix + [500, 600, 700], prefix + [800]]  # the second hits the first's cached blocks
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post", "z"], positions="generated", heads=[3],
                            lens=3, reduce="mean")
    sample = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2, hidden_states=spec)
    a = [o for p in prompts for o in one.generate([p], sample, use_tqdm=False)]
    b = [o for p in prompts for o in split.generate([p], sample, use_tqdm=False)]
    _same(a, b, ["resid_post", "z"])
    for x, y in zip(a, b):
        for point in x.hidden_states.lens:
            assert torch.equal(x.hidden_states.lens[point].token_ids, y.hidden_states.lens[point].token_ids)
            assert_close(y.hidden_states.lens[point].logprobs, x.hidden_states.lens[point].logprobs, 1e-5)


def test_prompt_only_capture_stops_before_the_later_stage(one, split, monkeypatch):
    """A step of prompt-only requests that capture block 0 only runs stage 0 (the later stage is not asked)."""
    from tapllm.parallel import relay

    served = []
    serve = relay.serve_stage
    monkeypatch.setattr("tapllm.parallel.ranks.serve_stage", lambda *a: served.append(a[0].rank) or serve(*a))
    spec = HiddenStatesSpec(layers=[0], points=["resid_post", "z"], positions="all")
    prompts = random_prompts([7, 12], seed=41)
    _same(one.encode(prompts, spec, use_tqdm=False), split.encode(prompts, spec, use_tqdm=False), ["resid_post", "z"])
    assert served == []
    split.generate(prompts[:1], greedy(2), use_tqdm=False)
    assert served and set(served) == {split.engine.runner.tp.size}  # stage 1's first rank


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_batch_equals_each_request_alone(one, split, seed):
    """Requests of random lengths capturing, steering (at residual and sharded points, in either stage),
    sampling or neither, run together (chunked, batched, in flight), each equal to its run alone in one process."""
    same_as_each_alone(one, split, seed)


def test_preemption_under_a_small_cache(tiny_models):
    small = {**ENGINE, "kv_cache_blocks": 8, "max_num_batched_tokens": 24}
    one = LLM(tiny_models["llama"], enforce_eager=True, **small)
    two = LLM(tiny_models["llama"], pipeline_parallel_size=2, **small)
    try:
        params = greedy(20, hidden_states=HiddenStatesSpec(layers=[-1], points=["resid_post", "z"], positions="all"))
        prompts = random_prompts([30, 26, 28, 22], seed=13)
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False),
              ["resid_post", "z"])
        assert two.engine.scheduler.num_preemptions > 0
    finally:
        two.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_one_process(family, family_folders):  # noqa: F811 - the fixture
    """Every family at PP 2 and TP 2 x PP 2: tokens, states at residual and sharded points of both stages, a
    steer at a residual and a sharded point."""
    folder = family_folders[family]
    one = LLM(folder, enforce_eager=True, **ENGINE)
    hidden = one.engine.model_config.hidden_size
    points = ["embed", "resid_post", "attn_out", "q", "k", "z", "mlp_post", "final"]
    spec = HiddenStatesSpec(layers="all", points=points, positions="all")
    steer = [Steer(layers=[1], point="resid_mid", vector=torch.ones(hidden), scale=0.5),
             Steer(layers=[-1], point="mlp_post", op="scale", neurons=[1, 2, 100], scale=0.0)]
    prompts = random_prompts([7, 40], seed=6)  # 40 > the budget of 32: chunked prefill
    params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steer)]
    expected = one.generate(prompts, params, use_tqdm=False)
    for name in SPLITS:
        llm = LLM(folder, **SPLITS[name], **ENGINE)
        try:
            _same(expected, llm.generate(prompts, params, use_tqdm=False), points)
        finally:
            llm.close()


def test_stage_split_and_fields_named(tiny_models):
    assert stage_layers(3, 2) == [(0, 2), (2, 3)] and stage_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    # stage 0 runs the head too: the default model's (49152 x 576, 8 blocks' weights) leaves it 11 of 30 blocks
    assert stage_layers(30, 2, 8.0) == [(0, 11), (11, 30)] and stage_layers(3, 2, 76.0) == [(0, 1), (1, 3)]
    assert stage_layers(30, 4, 8.0) == [(0, 2), (2, 12), (12, 21), (21, 30)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's num_hidden_layers=3"):
        LLM(tiny_models["llama"], pipeline_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        LLM(tiny_models["llama"], pipeline_parallel_size=0)


def test_an_error_in_a_later_stage_is_reported_with_its_rank(tiny_models):
    llm = LLM(tiny_models["llama"], pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.tp.procs)
    llm.engine.runner.tp.send(object())  # every worker raises on a message it does not know, then exits
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank [123]"):
        llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.close()
    assert not any(p.is_alive() for p in procs)
