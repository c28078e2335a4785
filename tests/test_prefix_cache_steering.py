"""The prefix cache never serves KV computed under different steering (positions included).

A block's KV depends on which of its positions each steer touched, and a steer limited to
the prompt or to generated positions touches different positions of the same tokens when the
prompt ends elsewhere, as in a continuation of a steered reply. The property test runs random
mixes of steers, continuations, chunking and preemption with prefix caching on, and compares
every request with the same request run alone with no prefix cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, SamplingParams, Steer

HIDDEN = 64
LAYERS = 3


def _steer_pool(seed: int = 0) -> list[list[Steer]]:
    g = torch.Generator().manual_seed(seed)
    v1, v2 = torch.randn(HIDDEN, generator=g) * 4, torch.randn(HIDDEN, generator=g) * 4
    s_all = Steer(layers=[1], point="resid_post", vector=v1, scale=1.5, positions="all")
    s_prompt = Steer(layers=[0], point="mlp_out", vector=v2, scale=2.0, positions="prompt")
    s_gen = Steer(layers=[1], point="attn_out", vector=v1, scale=2.0, positions="generated")
    s_ablate = Steer(layers=[2], point="resid_pre", op="ablate", vector=v2, positions="prompt")
    return [[], [s_all], [s_prompt], [s_gen], [s_gen, s_all], [s_prompt, s_gen], [s_ablate, s_gen]]


def _params(steers: list[Steer], max_tokens: int, capture: bool) -> SamplingParams:
    hs = {"layers": [LAYERS - 1], "points": ["resid_post"], "positions": "last"} if capture else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, steering=steers or None,
                          hidden_states=hs)


def _next_call(rng: random.Random, history: list[tuple[list[int], int]], n_steers: int, per_round: int):
    """One generate call: fresh prompts, continuations of earlier replies, prefixes of them.

    A continuation mostly keeps the steers of the sequence it continues (a steered chat's next
    turn): that is where a block can be computed under the same steers but another split.
    """
    call = []
    for _ in range(rng.randint(1, per_round)):
        kind = rng.random()
        extra = random_prompts([rng.randint(1, 26)], seed=rng.randint(0, 10**6))[0]
        steer = rng.randrange(n_steers)
        if history and kind < 0.5:  # continue an earlier sequence (a chat's next turn)
            base, base_steer = rng.choice(history)
            prompt = base + extra[: rng.randint(0, 5)]
            steer = base_steer if rng.random() < 0.7 else steer
        elif history and kind < 0.7:  # a prefix of an earlier sequence
            base, base_steer = rng.choice(history)
            prompt = base[: rng.randint(1, len(base))]
            steer = base_steer if rng.random() < 0.5 else steer
        else:
            prompt = extra
        call.append((prompt[:60], steer, rng.randint(1, 8), rng.random() < 0.4))
    return call


def run_fuzz(model, seed: int, rounds: int, per_round: int) -> tuple[int, int, list[str]]:
    """One randomized run: returns (requests, mismatches, descriptions of the mismatches)."""
    rng = random.Random(seed)
    pool = _steer_pool(seed)
    cached = LLM(model, dtype="float32", block_size=4, kv_cache_blocks=rng.choice([24, 40, 200]),
                 max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=rng.choice([2, 4, 16]))
    solo = LLM(model, dtype="float32", block_size=4, enable_prefix_caching=False)
    requests = mismatches = 0
    problems: list[str] = []
    history: list[tuple[list[int], int]] = []
    for _ in range(rounds):
        call = _next_call(rng, history, len(pool), per_round)
        params = [_params(pool[s], n, cap) for _, s, n, cap in call]
        outs = cached.generate([p for p, *_ in call], params, use_tqdm=False)
        for (prompt, s, n, cap), p, out in zip(call, params, outs):
            ref = solo.generate([prompt], p, use_tqdm=False)[0]
            requests += 1
            got, want = out.outputs[0].token_ids, ref.outputs[0].token_ids
            ok = got == want
            if ok and cap:
                a, b = out.hidden_states["resid_post"], ref.hidden_states["resid_post"]
                ok = a.shape == b.shape and float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
            if not ok:
                mismatches += 1
                problems.append(f"prompt len {len(prompt)} steers #{s} max_tokens {n}: {got} != {want}")
            history.append((prompt + got, s))
    return requests, mismatches, problems


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_runs_equal_uncached_solo_runs_under_random_steering(tiny_models, seed):
    requests, mismatches, problems = run_fuzz(tiny_models["llama"], seed, rounds=5, per_round=6)
    assert requests >= 5
    assert mismatches == 0, problems[:5]


def test_continuation_of_a_prompt_steered_reply_does_not_reuse_its_blocks(tiny_models):
    """The bug this guards against: a prompt-only steer, then the reply continued under the same steer."""
    llm = LLM(tiny_models["llama"], dtype="float32", block_size=4)
    solo = LLM(tiny_models["llama"], dtype="float32", block_size=4, enable_prefix_caching=False)
    steer = _steer_pool()[2]  # positions="prompt"
    first = random_prompts([6])[0]
    params = _params(steer, 10, capture=False)
    out = llm.generate([first], params, use_tqdm=False)[0]
    continuation = first + out.outputs[0].token_ids  # positions 6..15 were not steered before; now they are
    got = llm.generate([continuation], params, use_tqdm=False)[0]
    want = solo.generate([continuation], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.metrics["num_cached_tokens"] == 4  # block 0 is steered at all its positions in both: shared


def test_unsteered_blocks_stay_shared_with_a_generated_only_steer(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", block_size=4)
    prompt = random_prompts([13])[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    steered = llm.generate([prompt], _params(_steer_pool()[3], 4, capture=False), use_tqdm=False)[0]
    assert steered.metrics["num_cached_tokens"] == 12  # every full prompt block came from the cache
