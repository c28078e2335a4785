"""Reductions before the gather under tensor parallelism: a sharded point (q, k, v, z, mlp_post) that the
step's requests only capture, each with a reduction that folds (mean, sum, max, min, first, last), is
folded on every rank to one row per request before the ranks' parts are gathered; the result equals one
process's within 1e-5, and the bytes the ranks move for it are one row per request and step, not one per
position. Windows select rows before any gather too (only the window's rows are planned)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.hidden_states.reducers import BUILTIN_REDUCERS

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32)
SHARDED = ["q", "k", "v", "z", "mlp_post"]


@pytest.fixture(scope="module")
def pair(tiny_models):
    one = LLM(tiny_models["llama"], enforce_eager=True, **ENGINE)
    two = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.close()


def _states(outs, points):
    return [{p: o.hidden_states[p] for p in points} for o in outs]


def test_every_reduction_folds_and_equals_one_process(pair):
    one, two = pair
    prompts = random_prompts([45, 7, 30], seed=21)  # 45 > the budget of 32: a prompt in two chunks
    params = [greedy(5, hidden_states=HiddenStatesSpec(layers="all", points=SHARDED, positions=positions,
                                                       reduce=reduce, heads=heads))
              for reduce, positions, heads in [("mean", "all", None), ("max", (3, 11), [1, 3]), ("min", "prompt", None),
                                               ("sum", "generated", None), ("first", (2, 9), [0]),
                                               ("last", "all", None)]]
    params = params * 2
    prompts = prompts * 4
    want = one.generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    assert {p.hidden_states.reduce for p in params} == set(BUILTIN_REDUCERS)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for point in SHARDED:
            assert_close(b.hidden_states[point], a.hidden_states[point], 1e-5)


def test_folding_moves_one_row_per_request_and_step(pair):
    one, two = pair
    group = two.engine.runner.tp.group
    prompts = random_prompts([200], seed=5)  # 7 chunks of at most 32 rows, then 3 decode steps

    def moved(spec):
        before = group.bytes_moved
        out = two.generate(prompts, greedy(4, hidden_states=spec), use_tqdm=False)
        return group.bytes_moved - before, out

    base, _ = moved(None)
    mean = HiddenStatesSpec(layers="all", points=["z", "mlp_post"], positions="all", reduce="mean")
    rows = HiddenStatesSpec(layers="all", points=["z", "mlp_post"], positions="all")
    folded, out = moved(mean)
    whole, _ = moved(rows)
    assert whole - base > 0 and (folded - base) < 0.1 * (whole - base)
    want = one.generate(prompts, greedy(4, hidden_states=mean), use_tqdm=False)
    for point in ("z", "mlp_post"):
        assert_close(out[0].hidden_states[point], want[0].hidden_states[point], 1e-5)


def test_a_point_some_request_steers_or_needs_whole_is_gathered_whole(pair):
    """A steer at a captured point (its rows are gathered, steered, then folded on rank 0), and a request
    wanting every row of a point (no fold there: its rows are gathered), in one batch with folding requests."""
    one, two = pair
    mean = HiddenStatesSpec(layers="all", points=["mlp_post", "z"], positions="all", reduce="mean")
    every_row = HiddenStatesSpec(layers=[1], points=["mlp_post"], positions="all")
    steer = [Steer(layers=[0], point="mlp_post", op="scale", scale=0.0, neurons=[3, 100]),
             Steer(layers=[2], point="z", vector=torch.ones(16), scale=2.0, heads=[1, 2])]
    prompts = random_prompts([40, 9, 17, 12], seed=8)
    params = [greedy(4, hidden_states=mean), greedy(4, steering=steer), greedy(4, hidden_states=every_row),
              greedy(4, hidden_states=mean, steering=steer)]
    alone = [one.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    together = two.generate(prompts, params, use_tqdm=False)
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.hidden_states is not None:
            for point in a.hidden_states.points:
                assert_close(b.hidden_states[point], a.hidden_states[point], 1e-5)


def test_only_the_query_heads_asked_are_gathered(pair):
    """Requests keeping some query heads of q and z have only those gathered, each rank's part padded to the
    most any rank holds (head 3 alone: rank 1's one head, rank 0 padding); with a request wanting every head,
    all are."""
    one, two = pair
    group = two.engine.runner.tp.group
    prompts = random_prompts([60, 11], seed=4)

    def spec(heads):
        return HiddenStatesSpec(layers="all", points=["q", "z"], positions="all", heads=heads)

    cases = [[spec([3]), spec([3])], [spec([1, 2]), spec([2])], [spec([0]), spec(None)]]
    moved = []
    for specs in cases:
        params = [greedy(3, hidden_states=s) for s in specs]
        want = one.generate(prompts, params, use_tqdm=False)
        before = group.bytes_moved
        got = two.generate(prompts, params, use_tqdm=False)
        moved.append(group.bytes_moved - before)
        for a, b in zip(want, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for point in ("q", "z"):
                assert a.hidden_states[point].shape == b.hidden_states[point].shape
                assert_close(b.hidden_states[point], a.hidden_states[point], 1e-5)
    assert moved[0] == moved[1] < moved[2]
