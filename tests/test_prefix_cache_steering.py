"""Random schedules of mixed requests equal each request run alone, and the prefix cache never
serves KV computed under different steering (positions included).

A block's KV depends on which of its positions each steer touched, and a steer limited to
the prompt or to generated positions touches different positions of the same tokens when the
prompt ends elsewhere, as in a continuation of a steered reply. The property test runs random
calls mixing steers, hidden-state specs, greedy and seeded sampling, continuations and
prefixes of earlier sequences, under random chunk budgets, batch limits and cache sizes
(preemption, eviction) with prefix caching on, and compares every request's tokens and states
with the same request run alone with no prefix cache.
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


CAPTURES = [
    None,
    {"layers": [LAYERS - 1], "points": ["resid_post"], "positions": "last"},
    {"layers": [0, 2], "points": ["resid_pre", "attn_out", "final"], "positions": "all"},
    {"layers": "all", "points": ["mlp_out"], "positions": "prompt", "reduce": "mean"},
    {"layers": [1], "points": ["resid_mid", "embed"], "positions": "last_prompt"},
]


def _call_params(steers: list[Steer], max_tokens: int, capture: int | bool, seed: int | None = None
                 ) -> SamplingParams:
    hs = CAPTURES[int(capture)]
    sampling = dict(temperature=0.9, top_p=0.95, top_k=50, seed=seed) if seed is not None else dict(temperature=0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, steering=steers or None, hidden_states=hs,
                          **sampling)


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
        capture = rng.randrange(len(CAPTURES)) if rng.random() < 0.5 else 0
        seed = rng.randint(0, 2**32) if rng.random() < 0.3 else None
        call.append((prompt[:60], steer, rng.randint(1, 8), capture, seed))
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
        params = [_call_params(pool[s], n, cap, seed) for _, s, n, cap, seed in call]
        outs = cached.generate([p for p, *_ in call], params, use_tqdm=False)
        for (prompt, s, n, cap, seed), p, out in zip(call, params, outs):
            ref = solo.generate([prompt], p, use_tqdm=False)[0]
            requests += 1
            got, want = out.outputs[0].token_ids, ref.outputs[0].token_ids
            ok = got == want and out.error is None
            if ok and cap:
                for point in ref.hidden_states.points:
                    a, b = out.hidden_states[point], ref.hidden_states[point]
                    ok = ok and a.shape == b.shape and torch.equal(out.hidden_states.positions,
                                                                   ref.hidden_states.positions)
                    ok = ok and float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
            if not ok:
                mismatches += 1
                problems.append(f"prompt len {len(prompt)} steers #{s} capture #{cap} seed {seed} max_tokens {n}: "
                                f"{got} != {want}")
            history.append((prompt + got, s))
    return requests, mismatches, problems


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_mixed_schedules_equal_uncached_solo_runs(tiny_models, seed):
    requests, mismatches, problems = run_fuzz(tiny_models["llama"], seed, rounds=5, per_round=6)
    assert requests >= 5
    assert mismatches == 0, problems[:5]


def test_continuation_of_a_prompt_steered_reply_does_not_reuse_its_blocks(tiny_models):
    """The bug this guards against: a prompt-only steer, then the reply continued under the same steer."""
    llm = LLM(tiny_models["llama"], dtype="float32", block_size=4)
    solo = LLM(tiny_models["llama"], dtype="float32", block_size=4, enable_prefix_caching=False)
    steer = _steer_pool()[2]  # positions="prompt"
    first = random_prompts([6])[0]
    params = _call_params(steer, 10, capture=0)
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
    steered = llm.generate([prompt], _call_params(_steer_pool()[3], 4, capture=0), use_tqdm=False)[0]
    assert steered.metrics["num_cached_tokens"] == 12  # every full prompt block came from the cache
