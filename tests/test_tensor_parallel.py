"""Tensor parallelism on the CPU (gloo): TP 2 gives what one process gives.

Greedy tokens identical; states at every point kind (residual, attn_out, mlp_out, per-head
q/k/v/z and patterns, neurons, the logit lens) within 1e-5 in float32; steering at residual and
sharded points; chunked prefill, prefix-cache hits, seeded sampling with n > 1. A rank that dies
makes the engine raise a clear error quickly, and no worker is left behind.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import random
import signal
import time

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.parallel import ShardLayout, TensorParallelError, divisibility_problems
from tapllm.tap.points import DENSE_POINTS as POINTS  # the dense models here have no router

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32)


def _pair(folder) -> tuple[LLM, LLM]:
    return LLM(folder, enforce_eager=True, **ENGINE), LLM(folder, tensor_parallel_size=2, **ENGINE)


@pytest.fixture(scope="module")
def llama(tiny_models):
    one, two = _pair(tiny_models["llama"])
    yield one, two
    two.close()


def _same(outs_one, outs_two, points=None) -> None:
    for a, b in zip(outs_one, outs_two, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
        if points is None or a.hidden_states is None:
            assert (a.hidden_states is None) == (b.hidden_states is None)
            continue
        for point in points:
            assert_close(b.hidden_states[point], a.hidden_states[point], 1e-5)


def test_every_point_and_token_equal_one_process(llama):
    one, two = llama
    spec = HiddenStatesSpec(layers="all", points=list(POINTS), positions="all")
    params = greedy(6, hidden_states=spec, logprobs=2)
    prompts = random_prompts([5, 40, 11], seed=3)  # 40 > the budget of 32: chunked prefill
    a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
    _same(a, b, POINTS)
    for x, y in zip(a, b):
        for t, lx, ly in zip(x.outputs[0].token_ids, x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert set(lx) == set(ly) and abs(lx[t].logprob - ly[t].logprob) < 1e-5


def test_steering_at_residual_and_sharded_points(llama, monkeypatch):
    from tapllm.parallel.shard_tap import ShardTap

    one, two = llama
    gathered_rows = []
    gather = ShardTap.gather

    def spy(self, point, x, rows=None):
        gathered_rows.append((x.shape[0], None if rows is None else rows.numel()))
        return gather(self, point, x, rows)

    monkeypatch.setattr(ShardTap, "gather", spy)
    g = torch.Generator().manual_seed(5)
    hidden, head_dim = 64, 16

    def v(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g)

    steers = [
        Steer(layers=[0, 2], point="resid_post", vector=v(hidden), scale=2.0),
        Steer(layers=[1], point="attn_out", op="ablate", vector=v(hidden)),
        Steer(layers=[1], point="z", vector=v(head_dim), scale=3.0, heads=[1, 2]),  # one head on each rank
        Steer(layers=[0], point="mlp_post", op="scale", scale=0.0, neurons=[3, 64, 100]),
        Steer(layers=[2], point="k", vector=v(head_dim), heads=[1]),  # KV head 1 lives on rank 1
        Steer(layers=[2], point="v", op="clamp", vector=v(head_dim), value=0.5),
        Steer(layers=[0], point="q", op="scale", scale=1.5, heads=[0, 3], positions="generated"),
    ]
    spec = HiddenStatesSpec(layers="all", points=["resid_post", "z", "k", "mlp_post"], positions="all")
    params = [greedy(6, steering=steers, hidden_states=spec), greedy(6)]  # a steered and a plain request
    prompts = random_prompts([9, 14], seed=4)
    points = ["resid_post", "z", "k", "mlp_post"]
    # only the first request's rows of z, k, mlp_post are gathered
    _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False), points)
    assert any(n is not None and n < t for t, n in gathered_rows)
    a = one.generate(prompts[:1], params[0], use_tqdm=False)
    b = two.generate(prompts[:1], params[0], use_tqdm=False)
    _same(a, b, ["resid_post", "z", "k", "mlp_post"])


def test_lens_heads_prefix_hits_and_seeded_samples(llama):
    one, two = llama
    prefix = random_prompts([32], seed=8)[0]
    prompts = [prefix + [500, 600, 700], prefix + [800]]  # the second hits the first's cached blocks
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post", "z"], positions="generated", heads=[3],
                            lens=3, reduce="mean")
    sample = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2, hidden_states=spec)
    for llm_pair in ((one, two),):
        a = [o for p in prompts for o in llm_pair[0].generate([p], sample, use_tqdm=False)]
        b = [o for p in prompts for o in llm_pair[1].generate([p], sample, use_tqdm=False)]
        _same(a, b, ["resid_post", "z"])
        for x, y in zip(a, b):
            for point in x.hidden_states.lens:
                assert torch.equal(x.hidden_states.lens[point].token_ids, y.hidden_states.lens[point].token_ids)
                assert_close(y.hidden_states.lens[point].logprobs, x.hidden_states.lens[point].logprobs, 1e-5)


def test_sae_features_and_feature_steering(llama):
    from tapllm import SAE
    from tapllm.sae.model import SAEConfig

    one, two = llama
    g = torch.Generator().manual_seed(21)
    sae = SAE(SAEConfig("jumprelu", 64, 128, "resid_post", 1), torch.randn(64, 128, generator=g) * 0.3,
              torch.randn(128, generator=g) * 0.1, torch.randn(128, 64, generator=g) * 0.1,
              torch.randn(64, generator=g) * 0.1, threshold=torch.rand(128, generator=g) * 0.5)
    steers = [Steer(op="add", sae=sae, features={5: 8.0, 9: -4.0}), Steer(op="clamp", sae=sae, features={3: 20.0})]
    spec = HiddenStatesSpec(layers=[1], points=["resid_post"], sae=sae, features="all")
    params = greedy(5, steering=steers, hidden_states=spec)
    prompts = random_prompts([8, 13], seed=22)
    a, b = one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)
    _same(a, b, ["resid_post"])
    for x, y in zip(a, b):
        assert_close(y.hidden_states.features.dense, x.hidden_states.features.dense, 1e-5)


def mixed_requests(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Six requests of random lengths capturing, steering (at residual and sharded points of any of the tiny
    Llama's 3 blocks), sampling or neither."""
    rng = random.Random(seed)
    dims = {"z": 16, "q": 16, "v": 16, "mlp_post": 128, "resid_post": 64, "attn_out": 64}
    prompts, params = [], []
    for i in range(6):
        fields: dict = {}
        kind = rng.choice(["plain", "capture", "steer", "both", "sample"])
        if kind in ("capture", "both", "sample"):
            point = rng.choice(["z", "v", "mlp_post", "resid_mid", "attn_pattern"])
            fields["hidden_states"] = HiddenStatesSpec(layers=[rng.randrange(3)], points=[point],
                                                       positions=rng.choice(["all", "generated", "prompt"]))
        if kind in ("steer", "both"):
            point = rng.choice(list(dims))
            vec = torch.randn(dims[point], generator=torch.Generator().manual_seed(seed * 10 + i))
            fields["steering"] = [Steer(layers=[rng.randrange(3)], point=point, vector=vec, scale=2.0,
                                        op=rng.choice(["add", "ablate"]))]
        temperature = 0.9 if kind == "sample" else 0.0
        params.append(SamplingParams(max_tokens=rng.choice([2, 5, 9]), temperature=temperature, seed=i,
                                     ignore_eos=True, **fields))
        prompts.append(random_prompts([rng.choice([3, 9, 20, 37])], seed=100 * seed + i)[0])
    return prompts, params


def same_as_each_alone(one: LLM, split: LLM, seed: int) -> None:
    """``mixed_requests(seed)`` run together on ``split`` equal each run alone on ``one``."""
    prompts, params = mixed_requests(seed)
    alone = [one.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    together = split.generate(prompts, params, use_tqdm=False)
    for a, b in zip(alone, together):
        _same([a], [b], list(a.hidden_states.points) if a.hidden_states is not None else None)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_batch_equals_each_request_alone(llama, seed):
    """Requests of random lengths capturing, steering (at residual and sharded points), sampling or
    neither, run together at TP 2 (chunked, batched), each equal to its run alone in one process."""
    same_as_each_alone(*llama, seed)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3-rope-tied"])
def test_other_llama_family_models(arch, tiny_models):
    one, two = _pair(tiny_models[arch])
    try:
        spec = HiddenStatesSpec(layers="all", points=["resid_post", "q", "v", "mlp_post", "final"], positions="all")
        steer = [Steer(layers=[1], point="resid_mid", vector=torch.ones(64), scale=0.5)]
        prompts = random_prompts([7, 12], seed=6)
        params = greedy(5, hidden_states=spec, steering=steer)
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False),
              ["resid_post", "q", "v", "mlp_post", "final"])
        full = _checkpoint_bytes(tiny_models[arch])
        per_rank = two.engine.runner.tp.weight_bytes
        assert len(per_rank) == 2 and all(b <= full * (0.5 + 0.05) for b in per_rank), (per_rank, full)
        assert "tensor parallel: 2 ranks" in two.describe()
    finally:
        two.close()


# Every other registered family (each architecture's own checkpoint layout: Phi-3's fused q/k/v and
# gate/up, GPT-2's Conv1D, GPT-NeoX's per-head q/k/v, OLMo-2's norms over every head).
FAMILIES = ["mistral", "gemma2", "gemma3", "phi3", "phi3-longrope", "olmo2", "olmo2-one-kv-head", "gpt2", "pythia"]


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory, default_model_folder):
    from conftest import save_tiny_model
    from family_configs import family_configs

    configs = family_configs()
    configs["olmo2-one-kv-head"] = copy.deepcopy(configs["olmo2"])
    configs["olmo2-one-kv-head"].num_key_value_heads = 1  # replicated on both ranks, its k_norm too
    root = tmp_path_factory.mktemp("tp-families")
    return {name: save_tiny_model(root / name, configs[name], default_model_folder) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_one_process(family, family_folders):
    """Tokens, states at residual and sharded points, and a steer at a residual and a sharded point."""
    folder = family_folders[family]
    one, two = _pair(folder)
    try:
        hidden = one.engine.model_config.hidden_size
        points = ["resid_post", "attn_out", "q", "k", "z", "mlp_post", "final"]
        spec = HiddenStatesSpec(layers="all", points=points, positions="all")
        steer = [Steer(layers=[1], point="resid_mid", vector=torch.ones(hidden), scale=0.5),
                 Steer(layers=[0], point="mlp_post", op="scale", neurons=[1, 2, 100], scale=0.0)]
        prompts = random_prompts([7, 40], seed=6)  # 40 > the budget of 32: chunked prefill
        params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steer)]
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False), points)
        full = _checkpoint_bytes(folder)
        per_rank = two.engine.runner.tp.weight_bytes
        assert len(per_rank) == 2 and all(b <= full * (0.5 + 0.05) for b in per_rank), (per_rank, full)
    finally:
        two.close()


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path, default_model_folder):
    from transformers import LlamaConfig

    from conftest import TINY, save_tiny_model

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **{**TINY, "num_key_value_heads": 1})
    one, two = _pair(save_tiny_model(tmp_path / "mqa", cfg, default_model_folder))
    try:
        assert two.engine.runner.tp.layout.kv_replicas == 2
        points = ["q", "k", "v", "z", "attn_pattern", "resid_post"]
        steers = [Steer(layers=[1], point="k", vector=torch.ones(16), scale=0.5),
                  Steer(layers=[2], point="v", op="ablate", vector=torch.ones(16) / 4)]
        params = greedy(5, hidden_states=HiddenStatesSpec(layers="all", points=points, positions="all"),
                        steering=steers)
        prompts = random_prompts([6, 19], seed=12)
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False), points)
    finally:
        two.close()


def test_preemption_under_a_small_cache(tiny_models):
    small = {**ENGINE, "kv_cache_blocks": 8, "max_num_batched_tokens": 24}
    one = LLM(tiny_models["llama"], enforce_eager=True, **small)
    two = LLM(tiny_models["llama"], tensor_parallel_size=2, **small)
    try:
        params = greedy(20, hidden_states=HiddenStatesSpec(layers=[-1], points=["resid_post", "z"], positions="all"))
        prompts = random_prompts([30, 26, 28, 22], seed=13)
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False),
              ["resid_post", "z"])
        assert two.engine.scheduler.num_preemptions > 0
    finally:
        two.close()


def _checkpoint_bytes(folder) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(4 * math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # float32
    return total


@pytest.mark.slow
def test_default_model_at_three_ranks(default_model_folder):
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings) splits evenly over 3 ranks (over 2 unevenly:
    tests/test_tensor_parallel_uneven.py)."""
    one = LLM(default_model_folder, enforce_eager=True, dtype="float32", kv_cache_blocks=32)
    three = LLM(default_model_folder, tensor_parallel_size=3, dtype="float32", kv_cache_blocks=32)
    try:
        points = ["resid_post", "z", "k", "mlp_post", "final"]
        params = greedy(4, hidden_states=HiddenStatesSpec(layers=[0, 15, -1], points=points, positions="all"))
        prompts = ["The capital of France is"]
        _same(one.generate(prompts, params, use_tqdm=False), three.generate(prompts, params, use_tqdm=False), points)
        assert len(three.engine.runner.tp.procs) == 2
    finally:
        three.close()


def test_layout_splits_and_names_fields_that_do_not_divide(tiny_models):
    parts = [ShardLayout(r, 4, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=100)
             for r in range(4)]
    assert [p.kv_head_start for p in parts] == [0, 0, 1, 1] and parts[0].kv_replicas == 2
    assert [p.head_start for p in parts] == [0, 2, 4, 6] and parts[3].vocab_start == 75
    # 2 KV heads over 3 ranks: neither whole KV groups per rank nor each KV head on 3 / 2 ranks; an
    # intermediate size that 3 does not divide splits unevenly
    problems = divisibility_problems(3, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=49152)
    assert any("num_key_value_heads=2" in p for p in problems)
    assert not any("intermediate_size" in p or "vocab_size" in p for p in problems)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        LLM(tiny_models["llama"], tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_models["llama"], tensor_parallel_size=0)


SPLITS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}  # rank 1: TP's, stage 1


@pytest.mark.parametrize("split", list(SPLITS))
def test_dead_rank_is_a_clear_error_and_leaves_no_process(tiny_models, split):
    llm = LLM(tiny_models["llama"], **SPLITS[split], **ENGINE)
    procs = list(llm.engine.runner.tp.procs)
    llm.generate(random_prompts([6], seed=1), greedy(3), use_tqdm=False)
    os.kill(procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelError):
        llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    llm.close()
    assert not any(p.is_alive() for p in procs)


def test_a_worker_error_is_reported_with_its_rank(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    llm.engine.runner.tp.send(object())  # the worker raises on a message it does not know, tells rank 0, exits
    with pytest.raises(TensorParallelError, match="rank 1 raised TypeError: unknown message object"):
        llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    llm.close()


def test_rank0_failing_mid_forward_breaks_the_group_without_a_hang(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.tp.procs)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    llm.engine.runner.model.shard.layers[1].mlp.forward = boom  # rank 0 fails before the MLP's all-reduce
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 0 raised RuntimeError during the forward: injected"):
        llm.generate(random_prompts([6, 9], seed=2), greedy(3), use_tqdm=False)
    assert time.monotonic() - start < 15
    assert not any(p.is_alive() for p in procs)
    llm.close()


@pytest.mark.parametrize("split", list(SPLITS))
def test_hung_rank_times_out(tiny_models, monkeypatch, split):
    monkeypatch.setenv("TAPLLM_TP_TIMEOUT_S", "3")
    llm = LLM(tiny_models["llama"], **SPLITS[split], **ENGINE)
    procs = list(llm.engine.runner.tp.procs)
    os.kill(procs[0].pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="timeout"):
            llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.close()
    assert not any(p.is_alive() for p in procs)


def test_close_stops_the_workers(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.tp.procs)
    assert all(p.is_alive() for p in procs)
    llm.close()
    llm.close()
    assert not any(p.is_alive() for p in procs)
    # an LLM that is dropped without close() stops its workers too
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.tp.procs)
    del llm
    gc.collect()
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_command_line_flag(tiny_models, tmp_path, flag):
    import subprocess
    import sys

    ids = random_prompts([7], seed=30)[0]
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": ids}) + "\n")
    args = ["generate", "--model", str(tiny_models["llama"]), "--dtype", "float32", "--max-tokens", "5",
            "--ignore-eos", "--quiet", flag, "2", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    one = LLM(tiny_models["llama"], dtype="float32").generate([ids], greedy(5), use_tqdm=False)[0]
    assert json.loads((tmp_path / "out.jsonl").read_text())["token_ids"] == one.outputs[0].token_ids
    args[args.index("2")] = "3" if flag == "--tensor-parallel-size" else "4"
    proc = subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=120)
    refused = "num_key_value_heads=2" if flag == "--tensor-parallel-size" else "num_hidden_layers=3"
    assert proc.returncode != 0 and refused in proc.stderr, proc.stderr


def test_untapped_decode_blocks_run_in_the_cpp_runner(llama):
    """The C++ block runner all-reduces o's and down's partial sums in shared memory itself: a decode
    step's blocks that no request taps run there, the tapped ones in Python, and every result is one
    process's."""
    one, two = llama
    stack = two.engine.runner.model.shard.stack
    assert stack is not None and stack.group is not None and stack.group.transport == "shared memory"
    runs: list[tuple[int, int]] = []
    run = stack.run

    def counted(x, start, stop, *rest):
        runs.append((start, stop))
        return run(x, start, stop, *rest)

    stack.run = counted
    try:
        spec = HiddenStatesSpec(layers=[1], points=["resid_post", "z", "mlp_post"], positions="all")
        prompts = random_prompts([7, 12, 5], seed=11)
        params = [greedy(6), greedy(6, hidden_states=spec), greedy(6)]
        rounds = stack.group.seq
        _same(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False),
              ["resid_post", "z", "mlp_post"])
        last = len(two.engine.runner.model.shard.layers)
        assert (0, 1) in runs and (2, last) in runs  # block 1 is tapped: it ran in Python
        assert stack.group.seq - rounds >= 2 * sum(b - a for a, b in runs)
        runs.clear()
        _same(one.generate(prompts, greedy(6), use_tqdm=False), two.generate(prompts, greedy(6), use_tqdm=False))
        assert (0, last) in runs
    finally:
        del stack.run
