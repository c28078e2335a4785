"""Tensor parallelism with ranks 1..N-1 as Ray actors (``distributed_executor_backend="ray"``) on a
local 2-node Ray cluster: a head node with no CPU (the driver) and a worker node with one, so the
rank-1 actor is placed on the other node.

Checked here: TP 2 on Ray gives exactly what TP 2 with spawned processes gives (greedy tokens,
states at residual and per-head points, a steer at a residual and a per-head point); a killed actor,
an actor that raises and a hung one give the same TensorParallelError as with processes (naming the
rank, or the timeout); close() leaves no actor and no placement group; the option is validated where
it enters; the command line's flag starts a local Ray instance where none runs.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import random_prompts
from helpers import greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.config import EngineConfig
from tapllm.parallel import TensorParallelError

ray = pytest.importorskip("ray")

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32, tensor_parallel_size=2)
POINTS = ["resid_post", "attn_out", "z", "k", "mlp_post"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _gone(llm: LLM, timeout_s: float = 20.0) -> None:
    """Every actor of ``llm``'s ranks is dead, its placement group released and the CPUs free again."""
    tp = llm.engine.runner.tp
    _released(tp.ray_workers, tp.procs, timeout_s)


def _released(workers, ranks, timeout_s: float = 20.0) -> None:
    assert workers.pg is None and workers.ranks == []
    for rank in ranks:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(rank.actor.__ray_ready__.remote(), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        for point in POINTS:
            assert torch.equal(x.hidden_states[point], y.hidden_states[point]), point


def test_ray_ranks_equal_spawned_ranks_and_leave_nothing(cluster, tiny_models):
    mp_llm = LLM(tiny_models["llama"], **ENGINE)
    steers = [Steer(layers=[1], point="resid_mid", vector=torch.ones(64), scale=0.5),
              Steer(layers=[1], point="z", vector=torch.linspace(-1, 1, 16), scale=3.0, heads=[1, 2])]
    spec = HiddenStatesSpec(layers="all", points=POINTS, positions="all")
    heads = HiddenStatesSpec(layers=[0, 2], points=["q", "z"], positions="all", heads=[3])  # a per-head point
    params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steers),
              greedy(4, hidden_states=heads)]
    prompts = random_prompts([7, 40, 12], seed=6)  # 40 > the budget of 32: chunked prefill
    try:
        expected = mp_llm.generate(prompts, params, use_tqdm=False)
    finally:
        mp_llm.close()
    ray_llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        tp = ray_llm.engine.runner.tp
        assert "Ray actors" in ray_llm.describe()
        head = ray.get_runtime_context().get_node_id()
        placed = ray.util.placement_group_table(tp.ray_workers.pg)
        assert placed["strategy"] == "PACK" and placed["state"] == "CREATED"
        assert all(node != head for node in placed["bundles_to_node_id"].values())  # the worker node
        got = ray_llm.generate(prompts, params, use_tqdm=False)
        _same(expected[:2], got[:2])
        for x, y in zip(expected[2:], got[2:]):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for point in ("q", "z"):
                assert y.hidden_states[point].shape[2] == 1  # head 3 only
                assert torch.equal(x.hidden_states[point], y.hidden_states[point])
        pg = tp.ray_workers.pg
    finally:
        ray_llm.close()
        ray_llm.close()
    _gone(ray_llm)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_a_pipeline_stage_on_ray_equals_a_spawned_one(cluster, tiny_models):
    """PP 2: stage 1 (blocks 2..) as a Ray actor on the other node, its captures relayed to rank 0."""
    engine = {**ENGINE, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    steers = [Steer(layers=[2], point="resid_mid", vector=torch.ones(64), scale=0.5),
              Steer(layers=[2], point="z", vector=torch.linspace(-1, 1, 16), scale=3.0, heads=[1, 2])]
    spec = HiddenStatesSpec(layers="all", points=POINTS, positions="all")
    params = [greedy(5, hidden_states=spec), greedy(5, hidden_states=spec, steering=steers)]
    prompts = random_prompts([7, 40], seed=16)
    mp_llm = LLM(tiny_models["llama"], **engine)
    try:
        expected = mp_llm.generate(prompts, params, use_tqdm=False)
    finally:
        mp_llm.close()
    ray_llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **engine)
    try:
        assert "pipeline parallel: 2 stages" in ray_llm.describe() and "Ray actors" in ray_llm.describe()
        _same(expected, ray_llm.generate(prompts, params, use_tqdm=False))
    finally:
        ray_llm.close()
    _gone(ray_llm)


def test_a_killed_actor_is_a_clear_error_naming_its_rank(cluster, tiny_models):
    llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        llm.generate(random_prompts([6], seed=1), greedy(3), use_tqdm=False)
        ray.kill(llm.engine.runner.tp.procs[0].actor)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(Ray actor, pid \d+ on \S+\) died"):
            llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError):
            llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    finally:
        llm.close()
    _gone(llm)


def test_an_actor_that_raises_is_reported_with_its_rank(cluster, tiny_models):
    llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        llm.engine.runner.tp.send(object())  # the rank raises on a message it does not know and tells rank 0
        with pytest.raises(TensorParallelError, match="rank 1 raised TypeError: unknown message object"):
            llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
    finally:
        llm.close()
    _gone(llm)


def test_an_engine_dropped_without_close_releases_its_actors(cluster, tiny_models):
    import gc

    llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **ENGINE)
    workers, ranks = llm.engine.runner.tp.ray_workers, list(llm.engine.runner.tp.procs)
    pg = workers.pg
    del llm
    gc.collect()
    _released(workers, ranks)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_a_hung_actor_times_out(cluster, tiny_models, monkeypatch):
    import os
    import signal

    monkeypatch.setenv("TAPLLM_TP_TIMEOUT_S", "3")
    llm = LLM(tiny_models["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        os.kill(llm.engine.runner.tp.procs[0].pid, signal.SIGSTOP)  # the actor runs on this machine
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="timeout"):
            llm.generate(random_prompts([6], seed=2), greedy(3), use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.close()
    _gone(llm)


def test_the_option_is_checked_where_it_enters(tiny_models):
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \['mp', 'ray'\]"):
        EngineConfig(distributed_executor_backend="dask").validate()
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(tiny_models["llama"], distributed_executor_backend="dask", **ENGINE)
    one = LLM(tiny_models["llama"], distributed_executor_backend="ray", dtype="float32")  # TP 1: ignored
    assert one.engine.runner.tp is None


def test_command_line_flag_starts_a_local_ray(tiny_models, tmp_path):
    """``--distributed-executor-backend ray`` in a process with no Ray: it starts a local instance."""
    import json
    import os
    import subprocess
    import sys

    from tapllm.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--distributed-executor-backend", "dask"])
    ids = random_prompts([7], seed=30)[0]
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": ids}) + "\n")
    args = ["generate", "--model", str(tiny_models["llama"]), "--dtype", "float32", "--max-tokens", "5",
            "--ignore-eos", "--quiet", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "tapllm", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = LLM(tiny_models["llama"], dtype="float32", enforce_eager=True).generate([ids], greedy(5), use_tqdm=False)[0]
    assert json.loads((tmp_path / "out.jsonl").read_text())["token_ids"] == one.outputs[0].token_ids
